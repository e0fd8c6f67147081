"""examples/train_with_manager.py: SIGKILL one rank mid-training, restart, resume.

The restarted job must resume from the newest checkpoint that was complete when the rank
died (either tier), and its losses must continue exactly where the uninterrupted run's are
(the data and arithmetic are deterministic).
"""

from __future__ import annotations

import os
import random
import re
import shutil
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


def _start(ckpt: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(ckpt), "--steps", str(STEPS), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=True,
    )


def _end(proc: subprocess.Popen[str]) -> None:
    """Kills whatever is left of the job `proc` started (its process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _finish(proc: subprocess.Popen[str]) -> str:
    """The output of a run started by `_start`, which must exit 0 within 280 s."""
    try:
        out, err = proc.communicate(timeout=280)
    finally:
        _end(proc)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    return out


def _run(ckpt: Path, *extra: str) -> str:
    return _finish(_start(ckpt, *extra))


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


def _run_until_killed(ckpt: Path, kill_at: int, victim: int, *extra: str) -> str:
    """Starts the job, SIGKILLs rank `victim` once step `kill_at` is printed; its output."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(ckpt), "--steps", str(STEPS), "--sleep", "0.3", *extra],
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
            if line.startswith(f"step {kill_at} "):
                # anywhere in the output: one CI run missed rank 1's line when matched only
                # at the start of a line (never reproduced)
                pids = {int(r): int(p) for r, p in re.findall(r"rank (\d+) pid (\d+)", seen)}
                assert victim in pids, f"no pid line of rank {victim} in the output:\n{seen}"
                os.kill(pids[victim], signal.SIGKILL)  # mid-training, between checkpoints
                break
        proc.wait(timeout=120)
    finally:
        _end(proc)
    assert f"step {kill_at} " in seen and proc.returncode != 0
    return seen


def test_sigkill_of_one_rank_then_restart_resumes_and_the_loss_continues(tmp_path):
    # the uninterrupted reference runs meanwhile: the killed run sleeps 0.3 s a step
    reference_run = _start(tmp_path / "reference")
    ckpt = tmp_path / "killed"
    try:
        _run_until_killed(ckpt, 17, 1)
        reference = _losses(_finish(reference_run))
    finally:
        _end(reference_run)
    assert sorted(reference) == list(range(1, STEPS + 1))
    expected = _newest_complete(ckpt)
    assert 14 <= expected <= 17

    resumed = _run(ckpt)
    assert f"resumed from step {expected} " in resumed, resumed[:500]
    losses = _losses(resumed)
    assert sorted(losses) == list(range(expected + 1, STEPS + 1))
    assert all(losses[s] == reference[s] for s in losses), (losses, reference)


def _newest_local_with_parity(ckpt: Path, world: int) -> int:
    """The newest local step whose every rank holds its part and its parity record."""
    node = ckpt / "local" / "dist_ckpt"
    steps = [
        int(m.group(1))
        for f in (node / "0").glob("iter_*_0_local.pt")
        for m in [re.fullmatch(r"iter_(\d+)_0_local\.pt", f.name)]
        if m
    ]
    return max(
        s
        for s in steps
        if all(
            (node / str(r) / f"iter_{s:07d}_{r}_{kind}").exists()
            for r in range(world)
            for kind in ("local.pt", "parity.bin")
        )
    )


def test_parity_local_tier_resumes_exactly_after_random_sigkills_and_node_losses(tmp_path):
    """Two rounds: a random rank SIGKILLed at a random step, then a random node's local files
    lost; each restart rebuilds the lost part from its group's parity (the local tier, not
    the persistent one) and recomputes the steps after it exactly as they were first
    computed (the losses of every step printed twice agree)."""
    args = ["--world-size", "4", "--parity", "4"]
    rng = random.Random(49)
    ckpt = tmp_path / "soak"
    kill_at = rng.randrange(5, 10)
    losses = _losses(_run_until_killed(ckpt, kill_at, rng.randrange(4), *args))
    for last in (False, True):
        expected = _newest_local_with_parity(ckpt, 4)
        assert kill_at - 3 <= expected < kill_at  # so some steps are computed again
        lost = rng.randrange(4)  # a node lost (or replaced by an empty one)
        shutil.rmtree(ckpt / "local" / "dist_ckpt" / str(lost))
        if last:
            seen = _run(ckpt, *args)
        else:
            kill_at = rng.randrange(expected + 5, expected + 9)
            seen = _run_until_killed(ckpt, kill_at, rng.randrange(4), *args)
        assert f"resumed from step {expected} (local)" in seen, (lost, seen[:500])
        again = _losses(seen)
        assert min(again) == expected + 1
        assert all(losses.get(s, v) == v for s, v in again.items()), (losses, again)
        losses.update(again)
    assert sorted(losses) == list(range(1, STEPS + 1))
