"""A script without a main guard gets one short error from the persistent async writer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import List

import pytest

from dist_checkpointing.async_save.callers import _is_main_test

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_BODY = """\
import sys
import torch
import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

def run(path):
    queue = AsyncCallsQueue(persistent=True)
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}
    queue.schedule_async_request(dc.save(sd, path, async_sharded_save=True))
    queue.close()
"""


def _run_script(tmp_path, tail: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(_BODY + textwrap.dedent(tail))
    env = dict(os.environ, PYTHONPATH=_ROOT, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.timeout(300)
def test_script_without_main_guard_gets_one_short_error(tmp_path):
    out = _run_script(tmp_path, "run(sys.argv[1])\n")
    assert out.returncode == 1
    assert "CheckpointingException: AsyncCallsQueue(persistent=True)" in out.stderr
    assert 'line 12 runs outside `if __name__ == "__main__":`' in out.stderr
    assert "persistent=False" in out.stderr
    assert "died with exit code" not in out.stderr
    assert out.stderr.count("Traceback") == 1, out.stderr  # nothing from a spawned child
    assert not (tmp_path / "ckpt" / "metadata.json").exists()


@pytest.mark.timeout(300)
def test_script_with_main_guard_saves_with_the_persistent_writer(tmp_path):
    out = _run_script(tmp_path, 'if __name__ == "__main__":\n    run(sys.argv[1])\n')
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "ckpt" / "metadata.json").exists()


@pytest.mark.parametrize(
    "test, expected",
    [
        ('__name__ == "__main__"', True),
        ("'__main__' == __name__", True),
        ('__name__ != "__main__"', False),
        ('__name__ == "other"', False),
        ("x == 1", False),
    ],
)
def test_main_guard_is_recognised_either_way_round(test, expected):
    import ast

    assert _is_main_test(ast.parse(test, mode="eval").body) is expected


def _children(pid: int) -> List[int]:
    """The pids whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
@pytest.mark.timeout(300)
def test_persistent_writer_ends_when_its_script_is_killed(tmp_path):
    """A launcher waiting for a killed training script's output must not wait forever for
    the script's background writer, which inherited the output pipe."""
    script = tmp_path / "train.py"
    script.write_text(
        _BODY
        + textwrap.dedent(
            """\
            if __name__ == "__main__":
                import time
                queue = AsyncCallsQueue(persistent=True)
                sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}
                queue.schedule_async_request(dc.save(sd, sys.argv[1], async_sharded_save=True))
                queue.maybe_finalize_async_calls(blocking=True)
                print("saved", flush=True)
                time.sleep(600)
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=_ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "saved"
    children = _children(proc.pid)
    assert children, "the persistent writer should be running"
    proc.kill()
    try:
        proc.communicate(timeout=30)  # EOF once every holder of the pipe is gone
        deadline = time.monotonic() + 5  # the pipe closes a moment before a process ends
        while any(_running(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        left = [pid for pid in children if _running(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not left


def _running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
