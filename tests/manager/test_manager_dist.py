"""CheckpointManager on 2 and 4 gloo ranks: fallback in every order, all ranks agreeing,
with the local tier unreplicated and replicated (factor 2)."""

from __future__ import annotations

import time

import pytest

from tests.manager import _manager_fns

pytestmark = pytest.mark.timeout(600)

CASES = [
    ("intact", (7, "local", 0)),
    ("local_lost", (6, "persistent", 0)),  # a rank lost its part: local 7 is not a candidate
    ("local_damaged", (6, "persistent", 1)),  # checksum failure on one rank
    ("persistent_incomplete", (4, "persistent", 0)),  # newest persistent never committed
    ("persistent_damaged_on_one_rank", (4, "persistent", 1)),
]


@pytest.mark.parametrize("world_size", [2, 4])
def test_load_falls_back_in_every_order_on_every_rank(world_factory, tmp_path, world_size):
    world = world_factory(world_size)
    for kind, (step, tier, skipped) in CASES:
        base = tmp_path / kind
        results = world.run_ok(_manager_fns.train_damage_and_resume, str(base), kind, timeout=240)
        assert results == [(step, tier, True, skipped)] * world_size, (kind, results)


# replication factor 2: rank 1's replica is on rank 0 (2 ranks) or rank 3 (4 ranks)
REPLICATED_CASES = [
    ("intact", (7, "local", 0)),
    ("repl_local_lost", (7, "local", 0)),  # rank 1's disk lost: its part comes from the peer
    ("repl_local_damaged", (7, "local", 0)),  # rank 1's part fails its checksum: the replica
    ("repl_clique_lost", (6, "persistent", 0)),  # part and replica lost: no local candidate
    ("repl_clique_damaged", (6, "persistent", 1)),  # both copies fail their checksums
    ("repl_clique_lost_persistent_incomplete", (4, "persistent", 0)),
    ("repl_clique_damaged_persistent_incomplete", (4, "persistent", 1)),
]


@pytest.mark.parametrize("world_size", [2, 4])
def test_load_with_replicated_local_tier_recovers_or_falls_back(
    world_factory, tmp_path, world_size
):
    world = world_factory(world_size)
    for kind, (step, tier, skipped) in REPLICATED_CASES:
        base = tmp_path / kind
        results = world.run_ok(
            _manager_fns.train_damage_and_resume, str(base), kind, True, timeout=240
        )
        assert results == [(step, tier, True, skipped)] * world_size, (kind, results)


def test_nothing_usable_raises_on_every_rank(world_factory, tmp_path):
    messages = world_factory(2).run_ok(_manager_fns.nothing_usable, str(tmp_path), timeout=240)
    assert len(set(messages)) == 1 and messages[0].startswith("No usable checkpoint under")
    assert "local step 2" in messages[0] and "persistent step 2" in messages[0]


def test_ranks_saving_other_steps_raise_at_once_naming_each(world_factory, tmp_path):
    """Before, each rank saved into its own step's directory and the claim check failed
    with a message about a removed directory; now the first agreement names the steps."""
    start = time.monotonic()
    results = world_factory(2).run_ok(_manager_fns.save_other_steps, str(tmp_path))
    assert time.monotonic() - start < 30
    for message, left in results:
        assert message.startswith("CheckpointingException"), message
        assert "rank 0: step=10" in message and "rank 1: step=11" in message, message
        assert left == []  # the step rank 0 prepared is removed again
