"""A script without a main guard gets one short error from the persistent async writer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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
