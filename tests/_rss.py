"""Resident memory of this process, for the scripts that measure a peak's growth."""

import os
import resource
import subprocess
import sys
from pathlib import Path


def peak() -> int:
    """The process's peak resident set size so far, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current() -> int:
    """The process's resident set size now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def run_script(script: Path, *args: str) -> str:
    """Runs a measuring script of tests/ in a fresh interpreter (its peak RSS its own); its
    stdout (asserts that it succeeded)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=240, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
