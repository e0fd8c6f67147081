"""Ranks agree on a sync save's write path: each measures its own, all keep the combination."""

from __future__ import annotations

import pytest

from tests.distributed._failure_fns import good_state
from tests.distributed._rank_fns import save_with_fixed_write_probe


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "buffered_wins_on,direct",
    [([0], True), ([1], True), ([], True), ([0, 1], False)],
)
def test_every_rank_writes_the_same_way_buffered_only_if_it_won_everywhere(
    world, tmp_path, buffered_wins_on, direct
):
    ckpt = str(tmp_path / "c")
    got = world.run_ok(save_with_fixed_write_probe, good_state, ckpt, buffered_wins_on, timeout=60)
    assert got == [[direct, direct], [direct, direct]]
