"""Ranks agree on a sync save's write path: each measures its own, all keep the combination,
and a restarted job takes the node's record of it instead of measuring."""

from __future__ import annotations

import os

import pytest

from tests.distributed._failure_fns import good_state
from tests.distributed._rank_fns import save_after_restart, save_with_fixed_write_probe


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


@pytest.mark.timeout(120)
def test_a_restarted_job_takes_the_nodes_record_instead_of_probing(world, tmp_path):
    dirs = [str(tmp_path / f"records{r}") for r in range(2)]
    got = world.run_ok(save_after_restart, good_state, str(tmp_path / "c"), dirs, timeout=90)
    # measured by the first save only, then taken from the records; a rank whose record is
    # gone measures again, and every rank still writes the same way (the page cache, which
    # only the recorded measurement chooses)
    assert [g[0] for g in got] == [["save 0"], ["save 0", "save 2"]]
    assert [g[1:] for g in got] == [([False, False, False], True)] * 2
    assert all(os.listdir(d) for d in dirs)  # the new combination recorded again
