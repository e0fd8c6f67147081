"""Every benchmark keeps importing and parsing its options (`--help`), run as a module."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))


def test_benchmarks_are_found():
    assert len(BENCHMARKS) >= 6, BENCHMARKS


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_help_runs(name, monkeypatch, capsys):
    """`python -m benchmarks.<name> --help`, in this process (cheap: torch is loaded)."""
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_benchmark_runs_as_a_module_from_the_repository_root():
    """The command the docs give, in a fresh interpreter, with no path set up for it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's package, as an installed one would be
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_checksums", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr
