"""A save owns its directory: concurrent jobs, links in the target, path-like options, a rank
lost after the commit, what a failed save leaves, and the newcomer's mistakes (2 gloo ranks)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dist_checkpointing
from dist_checkpointing.errors import CheckpointingException
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from dist_checkpointing.tools import list_checkpoints
from tests._world import World, get_world
from tests.distributed import _ownership_fns as F

pytestmark = pytest.mark.timeout(300)

TRIALS = 50


def _run_together(worlds, fn, args_of, timeout=240.0):
    """Starts `fn` on every world at once; returns each world's outcomes."""
    for job, world in enumerate(worlds):
        for inbox in world.inboxes:
            inbox.put((fn, args_of(job)))
    return [world._collect(fn.__name__, timeout) for world in worlds]


@pytest.mark.parametrize(
    "strategy, trials", [(None, TRIALS), (("local", 2), 20)], ids=["torch_dist", "node-local"]
)
def test_two_jobs_saving_into_one_directory_exactly_one_succeeds(tmp_path, strategy, trials):
    other = World(2)  # a second job: its own processes and process group
    try:
        outcomes = _run_together(
            [get_world(2), other], F.race, lambda job: (str(tmp_path), job, trials, strategy)
        )
    finally:
        other.close(kill=True)
    results = [[o.unwrap() for o in job] for job in outcomes]  # [job][rank][trial]
    winners = []
    for i in range(trials):
        ok = [all(results[job][rank][i] == ("", "") for rank in range(2)) for job in range(2)]
        assert sum(ok) == 1, (
            f"trial {i}: {[[results[j][r][i] for r in range(2)] for j in range(2)]}"
        )
        winner = ok.index(True)
        winners.append(winner)
        for rank in range(2):  # the other job failed on every rank, naming the directory
            name, message = results[1 - winner][rank][i]
            assert name in ("CheckpointClaimedError", "CheckpointExistsError"), (name, message)
            assert str(tmp_path / f"t{i}") in message
    assert all(get_world(2).run_ok(F.winners_hold, str(tmp_path), winners, timeout=120)[0])


@pytest.mark.parametrize("link_claim", [False, True], ids=["data-links", "claim-linked-too"])
@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_links_to_a_complete_checkpoint_in_the_target_are_never_written_through(
    world_factory, tmp_path, kind, link_claim
):
    for untouched, outcome, a_ok, t_ok in world_factory(2).run_ok(
        F.save_into_links, str(tmp_path), kind, link_claim
    ):
        assert untouched and a_ok  # the earlier checkpoint: byte for byte, and it loads
        if link_claim:  # the target holds another save's claim: refused on every rank
            assert outcome[0] == "CheckpointClaimedError" and "claim.json" in outcome[1]
        else:
            assert outcome == ("", "") and t_ok


@pytest.mark.parametrize("hint", ["../x", "/tmp/elsewhere", "a/b", ".hidden", "a\\b"])
def test_separation_hint_that_is_not_a_plain_name_is_refused(hint):
    with pytest.raises(CheckpointingException, match="separation_hint"):
        TorchDistSaveShardedStrategy("torch_dist", 1, separation_hint=hint)


@pytest.mark.parametrize(
    "size, victim, is_async", [(2, 1, False), (4, 2, True)], ids=["2-ranks-sync", "4-ranks-async"]
)
def test_rank_killed_right_after_the_commit_survivors_report_committed_naming_it(
    tmp_path, size, victim, is_async
):
    outcomes = get_world(size).run_tolerating_deaths(
        F.die_after_commit, str(tmp_path), victim, is_async, timeout=120
    )
    assert outcomes[victim] is None, "the victim should have died"
    limit = 10.0 if size == 2 else 5.0 + 10.0  # 4 ranks: some notice by the 5 s timeout
    raised = 0
    for rank, outcome in enumerate(outcomes):
        if rank == victim:
            continue
        assert outcome is not None, f"survivor {rank} must not hang"
        name, message, seconds = outcome.unwrap()
        assert seconds < limit
        if size > 2 and name == "":  # its part of the agreement had all it needed: success
            continue
        assert name == "RankLostAfterCommitError", message
        assert "committed and complete" in message and f"rank {victim} failed" in message
        assert str(tmp_path / "K") in message
        raised += 1
    assert raised >= 1
    assert get_world(size).run_ok(F.loads_after_commit, str(tmp_path), timeout=120) == [True] * size


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_failed_save_removes_what_it_wrote(world_factory, tmp_path, is_async):
    for name, left in world_factory(2).run_ok(
        F.full_disk_leaves_nothing, str(tmp_path), 1, is_async
    ):
        assert name in ("CheckpointingException", "AsyncSaveError", "DistributedFailureError"), name
        assert left == []


def test_newcomer_mistakes_are_refused_on_every_rank(world_factory, tmp_path):
    world = world_factory(2)
    for name, message in world.run_ok(F.save_a_list, str(tmp_path)):
        assert name == "CheckpointingException" and "must be a dict" in message
        assert "got a list" in message
    assert not (tmp_path / "L").exists()
    for name, message in world.run_ok(F.claimed_by_hand, str(tmp_path)):
        assert name == "CheckpointClaimedError", message
        assert "no longer runs: the claim is stale" in message
        assert str(tmp_path / "S" / "claim.json") in message  # how to clear it
    assert (tmp_path / "S" / "claim.json").exists()  # never taken over
    (found,) = list_checkpoints(tmp_path / "S")  # and `dist-ckpt ls` says who holds it
    assert found.state == "incomplete" and "claimed by pid" in found.problem


def test_async_request_never_scheduled_is_reported_at_exit(tmp_path):
    script = textwrap.dedent(
        f"""
        import torch, dist_checkpointing as dc
        from dist_checkpointing import ShardedTensor
        sd = {{"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}}
        request = dc.save(sd, {str(tmp_path / "U")!r}, async_sharded_save=True)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(dist_checkpointing.__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "never scheduled" in done.stderr and str(tmp_path / "U") in done.stderr


def _survivor_of_rank_1(fn, tmp: str):
    """Runs `fn(tmp, 1)` on 2 ranks, where rank 1 dies: rank 0's (class, message, seconds)."""
    outcomes = get_world(2).run_tolerating_deaths(fn, tmp, 1, timeout=120)
    assert outcomes[1] is None and outcomes[0] is not None
    return outcomes[0].unwrap()


def test_rank_killed_while_its_async_writer_hangs_fails_the_others_at_once(tmp_path):
    # the writer, forked from the victim, holds the victim's sockets: it must die with it
    name, message, seconds = _survivor_of_rank_1(F.die_while_writer_runs, str(tmp_path))
    assert name == "DistributedFailureError", message
    assert seconds < 20.0  # not the writer's 120 s stall, nor the 600 s collective timeout


def test_rank_lost_before_the_first_collective_fails_the_survivor_within_the_timeout(tmp_path):
    name, message, seconds = _survivor_of_rank_1(F.die_before_first_collective, str(tmp_path))
    assert name == "DistributedFailureError", message
    assert seconds < 60.0  # the 5 s collective timeout, not the process group's
