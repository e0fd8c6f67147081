"""The host-memory tier: a local root in /dev/shm (tmpfs) is detected, written without fsync,
and what a process saved there outlives the process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from dist_checkpointing.local.memory import filesystem_type, is_memory_path

MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0
/dev/vdb /data xfs rw 0 0
tmpfs /data/ram tmpfs rw 0 0
none /mnt/with\\040space ramfs rw 0 0
"""


@pytest.mark.parametrize(
    "path,kind",
    [
        ("/dev/shm/ckpt/not/yet/created", "tmpfs"),
        ("/dev/shm", "tmpfs"),
        ("/dev/shmem/x", "ext4"),  # a name that only starts like the mount point
        ("/data/ckpt", "xfs"),
        ("/data/ram/ckpt", "tmpfs"),  # the longest mount point wins
        ("/mnt/with space/x", "ramfs"),  # escaped mount points
        ("/home/u", "ext4"),
    ],
)
def test_memory_file_systems_are_told_from_the_mount_table(path, kind):
    assert filesystem_type(path, MOUNTS) == kind
    assert is_memory_path(path, MOUNTS) == (kind in ("tmpfs", "ramfs"))


def test_no_mount_table_means_not_memory():
    assert filesystem_type("/anything", "") == "" and not is_memory_path("/anything", "")


_SAVE_AND_DIE = """
import os, sys, torch
from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

m = LocalCheckpointManager(sys.argv[1], "job")
assert m.in_memory and not m.fsync, (m.in_memory, m.fsync)
queue = AsyncCallsQueue()
state = {"w": torch.arange(100_000, dtype=torch.float32), "step": 5}
queue.schedule_async_request(m.save(BasicTensorAwareStateDict(state), 5, is_async=True))
queue.close()
os._exit(9)  # a crash: no interpreter teardown
"""


@pytest.mark.skipif(not is_memory_path("/dev/shm"), reason="/dev/shm is not a tmpfs here")
def test_a_checkpoint_in_dev_shm_outlives_the_process_that_saved_it(tmp_path):
    import torch

    from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager

    root = tempfile.mkdtemp(prefix="dc-memory-tier-", dir="/dev/shm")
    try:
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        out = subprocess.run(
            [sys.executable, "-c", _SAVE_AND_DIE, root], env=env, capture_output=True, timeout=120
        )
        assert out.returncode == 9, out.stderr[-2000:]
        manager = LocalCheckpointManager(root, "job")
        assert manager.in_memory and manager.find_latest() == 5
        state, _ = manager.load()
        assert torch.equal(state.state_dict["w"], torch.arange(100_000, dtype=torch.float32))
        assert not LocalCheckpointManager(tmp_path, "job").in_memory or is_memory_path(tmp_path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
