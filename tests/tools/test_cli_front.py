"""The `dist-ckpt` front: help for every verb, one-line errors, log level reaching demo workers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dist_checkpointing.cli import main

VERBS = ["ls", "inspect", "verify", "convert", "diff", "demo"]


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_has_help(verb, capsys):
    with pytest.raises(SystemExit) as e:
        main([verb, "--help"])
    assert e.value.code == 0
    assert f"usage: dist-ckpt {verb}" in capsys.readouterr().out


def _run(*args: str, timeout: float = 170) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dist_checkpointing", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "args",
    [
        ("demo", "--world-size", "3", "--hidden", "64", "--vocab", "256", "--layers", "1"),
        ("inspect", "/nonexistent/ckpt"),
        ("convert", "/nonexistent/ckpt", "/tmp/x", "--to", "torch"),
        ("diff", "/nonexistent/a", "/nonexistent/b"),
        ("convert", "/nonexistent/ckpt", "/tmp/x"),  # usage error: --to missing
        ("verify",),  # usage error: path missing
    ],
)
def test_cli_errors_are_one_line_and_non_zero(args):
    out = _run(*args)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"dist-ckpt {args[0]}: error: ")


@pytest.mark.timeout(200)
def test_verbose_demo_shows_info_lines_from_its_workers(tmp_path):
    out = _run(
        "-v",
        "demo",
        "--world-size",
        "2",
        "--hidden",
        "64",
        "--layers",
        "1",
        "--vocab",
        "256",
        "--dir",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "INFO rank 0 dist_checkpointing" in out.stderr
    assert "Saved checkpoint" in out.stderr
