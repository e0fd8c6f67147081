"""Ranks agree on the read path: each measures its own, all keep the combination."""

from __future__ import annotations

import pytest

from tests.distributed._failure_fns import good_state
from tests.distributed._rank_fns import load_with_fixed_probe


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "direct_wins_on,agreed",
    # one rank's pair each way is a tie, which goes to O_DIRECT; the page cache must win
    # in total and in at least half of the pairs
    [([0], True), ([1], True), ([], False), ([0, 1], True)],
)
def test_every_rank_reads_the_same_way_the_page_cache_only_where_it_won(
    world, saved, direct_wins_on, agreed
):
    got = world.run_ok(load_with_fixed_probe, good_state, saved, direct_wins_on, timeout=60)
    assert got == [agreed, agreed]
