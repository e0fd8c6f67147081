"""megatron-core's jobs of `mcore_side.py`, one side run per megatron version and session;
and the long side runs that start in the background (`in_background`, `wait_for`).

A side run costs an interpreter and two ranks that import megatron (about 8 s on 2 cores).
The interop tests and the tools tests ask megatron-core 0.16.1 for four jobs (its save, its
load of ours, and the float8 pair) and 0.19.2 for two (its save, its load of ours), each
once; so the first test that needs a version's results runs all of its jobs: our 2-rank
world saves the checkpoints megatron loads, then one side run does every job in order in
one megatron world, each writing its own result file. Each test still checks its own job's
result and checkpoint; the checkpoints are shared and must not be changed (copy them).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, TypeVar

import pytest

from tests.interop import _launch

MCORE016_MODES = ("load", "load-f8", "save", "save-f8")
MCORE019_MODES = ("load", "save")


@dataclass(frozen=True)
class Job:
    """One job of a side run: its checkpoint directory and its merged result."""

    ckpt: str
    result: Dict[str, Any]


def _ours(mode: str) -> Optional[Callable[[str], None]]:
    """The rank function that saves (with our package) what a `mode` job loads, if any."""
    if mode == "load":
        from tests.interop.test_megatron_core import save_for_mcore

        return save_for_mcore
    if mode == "load-f8":
        from tests.interop.test_float8_interop import save_rows

        return save_rows
    return None


def run_jobs(
    base: Path, python: str, modes: tuple, timeout: float, env: Optional[Dict[str, str]] = None
) -> Dict[str, Job]:
    """Saves what the load jobs read, then runs every mode of `modes` in one side run."""
    from tests._world import get_world

    args: List[str] = []
    for mode in modes:
        ckpt = str(base / mode)
        saver = _ours(mode)
        if saver is not None:
            get_world(2).run_ok(saver, ckpt, timeout=240)
        args += [mode, ckpt, str(base / f"{mode}.json")]
    side = _launch.side_script("mcore_side.py")
    _launch.run_side(python, [side, *args], timeout=timeout, env=env)
    return {
        mode: Job(str(base / mode), _launch.read_json(str(base / f"{mode}.json"))) for mode in modes
    }


def mcore016(base: Path) -> Dict[str, Job]:
    """megatron-core 0.16.1's jobs (skips when it is not installed)."""
    python = _launch.mcore_python()
    if python is None:
        pytest.skip(
            "megatron-core is not installed: set DIST_CKPT_MCORE_PYTHON to a python with "
            "megatron-core==0.16.1 and psutil (.ci/run does)"
        )
    return run_jobs(base, python, MCORE016_MODES, timeout=480)


def mcore019(base: Path) -> Dict[str, Job]:
    """megatron-core 0.19.2's jobs (skips when its side environment is not set up)."""
    found = _launch.mcore19()
    if found is None:
        pytest.skip(
            "megatron-core 0.19.2 is not set up: set DIST_CKPT_MCORE19_PYTHON and "
            "DIST_CKPT_MCORE19_PATH (.ci/run does)"
        )
    env = {"PYTHONPATH": found["path"]}
    return run_jobs(base, found["python"], MCORE019_MODES, timeout=600, env=env)


T = TypeVar("T")

#: at most two long side runs at a time beside the tests (each is 2 ranks on a 2-core CI)
_POOL: Optional[ThreadPoolExecutor] = None
_STARTED: Dict[str, Future[Any]] = {}


def in_background(key: str, run: Callable[[], Any]) -> None:
    """Starts `run()` (a side run: subprocesses and files only, nothing printed or logged in
    this process) in a background thread, once per session; `wait_for(key, ...)` collects it.

    The long side runs of the interop tests (tens of seconds each) leave a core idle at
    times (interpreter starts, one rank's work, the ranks waiting for each other), so the
    first interop test starts them together, and each module's fixture waits for its own.
    """
    global _POOL
    if key in _STARTED:
        return
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="side-run")
    _STARTED[key] = _POOL.submit(run)


def wait_for(key: str, run: Callable[[], T]) -> T:
    """The result of the background run `key` (its exception re-raised), or of `run()` now
    when none was started."""
    future = _STARTED.get(key)
    return future.result() if future is not None else run()


def stop_background() -> None:
    """Drops the background runs not started yet and waits for the running ones."""
    global _POOL
    if _POOL is not None:
        _POOL.shutdown(wait=True, cancel_futures=True)
    _POOL = None
    _STARTED.clear()
