"""`_dist.all_gather_object` on gloo: one exchange for small objects, two past the frame."""

from __future__ import annotations

import pytest

from dist_checkpointing._object_gather import inline_bytes
from tests.distributed._rank_fns import gather_objects_counting_exchanges

INLINE = inline_bytes(2)  # the frame's pickle bytes in the 2-rank world


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "sizes,exchanges",
    [
        ([0, 0], 1),
        ([10, INLINE - 200], 1),  # both pickles fit the first frame
        ([10, INLINE + 1], 2),  # one rank's pickle needs the second exchange
        ([3 * INLINE, INLINE + 5000], 2),  # both do, by different amounts
    ],
)
def test_every_rank_gets_every_object_as_torchs_gather_gives_it(world, sizes, exchanges):
    got = world.run_ok(gather_objects_counting_exchanges, sizes, timeout=60)
    for ours, theirs, calls in got:
        assert ours == theirs
        assert [o["blob"] for o in ours] == [bytes([r]) * n for r, n in enumerate(sizes)]
        assert calls == exchanges
