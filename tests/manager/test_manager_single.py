"""CheckpointManager in one process: save policy, retention, the `latest` record after
crashes at each step of a save, fallback on load, failed saves under both policies."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dist_checkpointing import CheckpointManager, CheckpointManagerOptions, ShardedTensor
from dist_checkpointing.errors import CheckpointingException, NoUsableCheckpointError
from dist_checkpointing.manager.layout import LATEST_FNAME, read_latest, steps_to_delete
from dist_checkpointing.tools._storage import read_dcp_metadata, stored_items

pytestmark = pytest.mark.timeout(240)


def _state(value: float) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), value)), "step": value}


def _request() -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3))}


def _steps(root: Path) -> list:
    return sorted(
        int(p.name[5:])
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith("iter_") and "." not in p.name
    )


def _run(root: Path, steps, **opts) -> CheckpointManager:
    opts.setdefault("async_save", False)
    manager = CheckpointManager(root, CheckpointManagerOptions(**opts))
    for step in steps:
        manager.save(step, _state(float(step)))
    manager.close()
    return manager


@pytest.mark.parametrize("async_save", [False, True])
def test_save_policy_persistent_every_n_local_every_m(tmp_path, async_save):
    root, local = tmp_path / "p", tmp_path / "l"
    manager = CheckpointManager(
        root,
        CheckpointManagerOptions(
            save_interval=3,
            keep_last=10,
            async_save=async_save,
            local_root=local,
            local_save_interval=2,
        ),
    )
    started = [manager.save(s, _state(float(s))) for s in range(1, 10)]
    manager.close()
    assert started == [s % 3 == 0 or s % 2 == 0 for s in range(1, 10)]
    assert _steps(root) == [3, 6, 9] and read_latest(root) == 9
    assert manager.latest_step() == 9
    # the local tier keeps its newest step (8) on this rank (and the superseded part as a
    # spare for the next save to write over)
    held = sorted(p.name for p in (local / "dist_ckpt" / "0").iterdir())
    assert held[0] == "iter_0000008_0_local.pt" and len(held) == 2
    assert held[1].startswith("spare_")


class _Untouchable(dict):
    """A state dict that fails the test if anything reads it."""

    def _touched(self, *_a, **_k):
        raise AssertionError("save() read the state although nothing was due")

    __getitem__ = __iter__ = __len__ = items = keys = values = get = _touched  # type: ignore[assignment]


def test_save_does_no_work_when_nothing_is_due(tmp_path):
    # Behaviour, not timing: a call that is not due must neither read the state nor write.
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(save_interval=1000))
    for step in range(1, 999):
        assert manager.save(step, _Untouchable()) is False
    assert _steps(tmp_path) == []
    assert manager.save(1000, _state(1.0)) is True  # the due step does save
    manager.close()
    assert _steps(tmp_path) == [1000]


def test_retention_keeps_the_last_k_and_every_pth_step(tmp_path):
    _run(tmp_path, range(1, 11), save_interval=1, keep_last=2, keep_period=4)
    assert _steps(tmp_path) == [4, 8, 9, 10] and read_latest(tmp_path) == 10


def test_retention_rules_never_delete_the_newest_committed_nor_newer_steps():
    assert steps_to_delete([1, 2, 3], [], 3, keep_last=1) == [1, 2]
    assert steps_to_delete([1, 2, 3], [], 2, keep_last=1) == [1]  # 3 is newer: not ours to judge
    assert steps_to_delete([5], [6, 2], 5, keep_last=1) == [2]  # 6 may still be in flight
    assert steps_to_delete([], [], 0, keep_last=3) == []


@pytest.mark.parametrize("on_error", ["raise", "continue"])
@pytest.mark.parametrize("async_save", [False, True])
def test_failed_saves_follow_the_policy_and_the_next_save_runs(tmp_path, on_error, async_save):
    opts = CheckpointManagerOptions(
        save_interval=2, keep_last=1, on_error=on_error, async_save=async_save
    )
    manager = CheckpointManager(tmp_path, opts)
    manager.save(2, _state(2.0))
    manager.wait_until_finished()
    (tmp_path / "iter_0000004").write_text("a file where the checkpoint directory must go")
    if on_error == "raise":
        with pytest.raises(CheckpointingException, match="iter_0000004"):
            manager.save(4, _state(4.0))
    else:
        assert manager.save(4, _state(4.0)) is True
        assert manager.failed_saves and manager.failed_saves[0][0] == 4
    assert _steps(tmp_path) == [2]  # nothing deleted: no newer commit
    assert read_latest(tmp_path) == 2
    (tmp_path / "iter_0000004").unlink()
    manager.save(6, _state(6.0))
    manager.close()
    assert _steps(tmp_path) == [6] and read_latest(tmp_path) == 6


def _crash(root: Path, stage: str) -> None:
    """Leaves `root` as a crash at `stage` of the save of step 3 would (steps 1, 2 done)."""
    newest = root / "iter_0000003"
    if stage == "directory_created":
        newest.mkdir()
    elif stage == "data_written":
        shutil.copytree(root / "iter_0000002", newest)
        (newest / "metadata.json").unlink()
    elif stage == "committed_not_recorded":
        shutil.copytree(root / "iter_0000002", newest)
    elif stage == "recorded_not_retained":
        shutil.copytree(root / "iter_0000002", newest)
        (root / LATEST_FNAME).write_text("3\n")


@pytest.mark.parametrize(
    "stage,expected",
    [
        ("directory_created", 2),
        ("data_written", 2),
        ("committed_not_recorded", 3),
        ("recorded_not_retained", 3),
    ],
)
def test_latest_record_after_a_crash_at_each_step_of_a_save(tmp_path, stage, expected):
    _run(tmp_path, [1, 2], save_interval=1, keep_last=3)
    assert read_latest(tmp_path) == 2
    _crash(tmp_path, stage)
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(save_interval=1, keep_last=3))
    assert manager.latest_step() == expected and read_latest(tmp_path) == expected
    assert _steps(tmp_path) == list(range(1, expected + 1))  # incomplete leftovers removed
    _, step = manager.load(_request())
    assert step == expected
    manager.close()


def test_load_without_any_checkpoint_raises_clearly(tmp_path):
    manager = CheckpointManager(tmp_path / "empty", CheckpointManagerOptions())
    assert manager.latest_step() is None
    with pytest.raises(NoUsableCheckpointError, match="No usable checkpoint under"):
        manager.load(_request())
    manager.close()


def test_load_falls_back_when_the_newest_persistent_fails_its_checksums(tmp_path, caplog):
    _run(tmp_path, [1, 2, 3], save_interval=1, keep_last=3)
    newest = tmp_path / "iter_0000003"
    item = next(i for i in stored_items(read_dcp_metadata(newest)) if i.key == "w")
    raw = bytearray((newest / item.file).read_bytes())
    raw[item.offset + item.length - 20] ^= 0x40
    (newest / item.file).write_bytes(bytes(raw))
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(save_interval=1, keep_last=3))
    state, step = manager.load(_request())
    assert step == 2 and torch.equal(state["w"], torch.full((4, 3), 2.0))
    assert manager.last_restore is not None and "checksum" in manager.last_restore.skipped[0][1]
    assert read_latest(tmp_path) == 2 and _steps(tmp_path) == [1, 2]
    assert any(p.name.startswith("iter_0000003.unusable-") for p in tmp_path.iterdir())
    manager.save(3, _state(30.0))  # training resumes from 2; step 3 is saved anew
    manager.close()
    assert _steps(tmp_path) == [1, 2, 3] and read_latest(tmp_path) == 3


def test_load_prefers_the_local_tier_and_falls_back_to_persistent(tmp_path):
    opts = dict(save_interval=4, keep_last=2, local_root=tmp_path / "l", local_save_interval=1)
    _run(tmp_path / "p", range(1, 7), **opts)
    manager = CheckpointManager(tmp_path / "p", CheckpointManagerOptions(async_save=False, **opts))
    state, step = manager.load(_request())
    assert (step, manager.last_restore.tier) == (6, "local")
    assert torch.equal(state["w"], torch.full((4, 3), 6.0))
    manager.close()
    part = next((tmp_path / "l" / "dist_ckpt" / "0").glob("iter_*_local.pt"))
    raw = bytearray(part.read_bytes())
    raw[100] ^= 0xFF
    part.write_bytes(bytes(raw))
    manager = CheckpointManager(tmp_path / "p", CheckpointManagerOptions(async_save=False, **opts))
    state, step = manager.load(_request())
    assert (step, manager.last_restore.tier) == (4, "persistent")
    assert "local step 6" in manager.last_restore.skipped[0][0]
    manager.close()
