"""Ranks agree on the read path: each measures its own, all keep the combination."""

from __future__ import annotations

import os

import pytest

from tests.distributed._failure_fns import good_state
from tests.distributed._rank_fns import load_after_restart, load_with_fixed_probe


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


@pytest.mark.timeout(120)
def test_a_restarted_job_takes_the_nodes_record_instead_of_probing(world, saved, tmp_path):
    dirs = [str(tmp_path / f"records{r}") for r in range(2)]
    got = world.run_ok(load_after_restart, good_state, saved, dirs, timeout=90)
    # measured by the first load only, then taken from the records; a rank whose record is
    # gone measures again, and every rank still reads the same way
    assert [g[0] for g in got] == [["first"], ["first", "restart 2"]]
    assert [g[1:] for g in got] == [(False, False, True)] * 2
    assert all(os.listdir(d) for d in dirs)  # the new combination recorded again
