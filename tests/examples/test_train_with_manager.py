"""examples/train_with_manager.py: SIGKILL one rank mid-training, restart, resume.

The restarted job must resume from the newest checkpoint that was complete when the rank
died (either tier), and its losses must continue exactly where the uninterrupted run's are
(the data and arithmetic are deterministic).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

pytestmark = pytest.mark.timeout(600)

SCRIPT = Path(__file__).parents[2] / "examples" / "train_with_manager.py"
STEPS = 24


def _env() -> Dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1]), "OMP_NUM_THREADS": "1"}


def _losses(text: str) -> Dict[int, str]:
    return {int(s): v for s, v in re.findall(r"^step (\d+) loss (\S+)$", text, re.M)}


def _run(ckpt: Path, *extra: str) -> str:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(ckpt), "--steps", str(STEPS), *extra],
        capture_output=True,
        text=True,
        timeout=280,
        env=_env(),
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def _newest_complete(ckpt: Path, world: int = 2) -> int:
    """The newest step complete on disk in either tier (what a restart must resume from)."""
    steps: List[int] = []
    persistent = ckpt / "persistent"
    for p in persistent.glob("iter_*"):
        if (p / "metadata.json").exists() and re.fullmatch(r"iter_\d{7}", p.name):
            steps.append(int(p.name[5:]))
    local = ckpt / "local" / "dist_ckpt"
    parts: Dict[int, set] = {}
    for f in local.glob("*/iter_*_local.pt"):
        m = re.fullmatch(r"iter_(\d+)_(\d+)_local\.pt", f.name)
        if m:
            parts.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    steps += [s for s, owners in parts.items() if owners == set(range(world))]
    return max(steps)


def test_sigkill_of_one_rank_then_restart_resumes_and_the_loss_continues(tmp_path):
    reference = _losses(_run(tmp_path / "reference"))
    assert sorted(reference) == list(range(1, STEPS + 1))

    ckpt = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(ckpt), "--steps", str(STEPS), "--sleep", "0.3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    seen = ""
    pids: Dict[int, int] = {}
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen += line
            if line.startswith("step 17 "):
                # anywhere in the output: one CI run missed rank 1's line when matched only
                # at the start of a line (never reproduced)
                pids = {int(r): int(p) for r, p in re.findall(r"rank (\d+) pid (\d+)", seen)}
                assert 1 in pids, f"no pid line of rank 1 in the output:\n{seen}"
                os.kill(pids[1], signal.SIGKILL)  # mid-training, between checkpoints
                break
        proc.wait(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the job is left
        except ProcessLookupError:
            pass
        proc.wait()
    assert "step 17 " in seen and proc.returncode != 0
    expected = _newest_complete(ckpt)
    assert 14 <= expected <= 17

    resumed = _run(ckpt)
    assert f"resumed from step {expected} " in resumed, resumed[:500]
    losses = _losses(resumed)
    assert sorted(losses) == list(range(expected + 1, STEPS + 1))
    assert all(losses[s] == reference[s] for s in losses), (losses, reference)
