"""Every example the README shows runs as shown: `torchrun --standalone --nproc-per-node 2`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import pytest

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).parents[2]


def _torchrun(script: str, *args: str, cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd: List[str] = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", "2", str(ROOT / "examples" / script), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280, cwd=cwd)


def _ok(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    return out.stdout


def test_quickstart_reshards_and_runs_twice_in_the_same_directory(tmp_path):
    for _ in range(2):  # the second run must not stop at CheckpointExistsError
        assert "loaded row blocks of 'w'" in _ok(_torchrun("quickstart.py", str(tmp_path)))


def test_async_save_example_commits_both_saves(tmp_path):
    assert "['iter_0000003', 'iter_0000006']: OK" in _ok(_torchrun("async_save.py", str(tmp_path)))


def test_local_checkpoints_example_recovers_a_lost_rank_directory(tmp_path):
    text = _ok(_torchrun("local_checkpoints.py", str(tmp_path)))
    assert "rank 0: recovered iteration 20" in text and "rank 1: recovered iteration 20" in text


def test_custom_strategy_example_round_trips_through_the_registry(tmp_path):
    assert "with the per_rank backend: OK" in _ok(_torchrun("custom_strategy.py", str(tmp_path)))


def test_local_sharded_example_round_trips_both_ways_and_recovers_a_lost_node(tmp_path):
    text = _ok(_torchrun("local_sharded.py", str(tmp_path)))
    for rank in (0, 1):
        assert f"rank {rank}: MCoreTensorAwareStateDict through the manager: OK" in text
        assert f"rank {rank}: ('local', 2) backend, recovered after losing node 1: OK" in text


def test_an_example_without_a_directory_announces_a_temporary_one_and_removes_it(tmp_path):
    before = sorted(ROOT.iterdir())
    text = _ok(_torchrun("custom_strategy.py", cwd=tmp_path))
    found = re.search(r"writing under (\S+) \(temporary, removed at exit", text)
    assert found and not Path(found.group(1)).exists(), text
    assert sorted(ROOT.iterdir()) == before and list(tmp_path.iterdir()) == []


def test_fsdp2_example_round_trips_get_state_dict_output_bitwise(tmp_path):
    text = _ok(_torchrun("fsdp2.py", str(tmp_path)))
    assert "saved and loaded the FSDP2 model and Adam state" in text
