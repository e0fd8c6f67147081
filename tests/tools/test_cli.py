"""The `dist-ckpt` command: help for every verb, one-line errors, the demo (quiet and with
`-v`, whose INFO lines come from its workers), and `inspect` on a single-process save."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.cli import main

VERBS = ["ls", "inspect", "verify", "convert", "diff", "demo"]
_SMALL_DEMO = ("--hidden", "64", "--vocab", "256", "--layers", "1")


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
        ("demo", "--world-size", "3", *_SMALL_DEMO),
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


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """Two demo runs into one `--dir`, the second with `-v` (its stderr serves the verbose
    test, its stdout this one: one demo run fewer); returns the directory and both runs."""
    parent = tmp_path_factory.mktemp("demo_dir")
    runs = [
        _run(*verbose, "demo", "--world-size", "2", *_SMALL_DEMO, "--dir", str(parent))
        for verbose in ((), ("-v",))
    ]
    return parent, runs


@pytest.mark.timeout(400)  # the fixture's two demo runs count here
def test_demo_saves_reshards_verifies_and_reports(demo_runs):
    tmp_path, runs = demo_runs
    for step, out in zip((100, 200), runs):  # numbered like a training job's steps, each kept
        assert out.returncode == 0, out.stderr[-3000:]
        assert "verified: every byte" in out.stdout and "save GB/s" in out.stdout
        assert f"kept: {tmp_path / f'iter_{step:07d}'}" in out.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000100", "iter_0000200"]
    assert dc.check_is_distributed_checkpoint(tmp_path / "iter_0000200")


@pytest.mark.timeout(200)
def test_demo_without_a_directory_says_it_removes_its_temporary_one(tmp_path):
    out = _run("demo", "--world-size", "2", *_SMALL_DEMO)
    assert out.returncode == 0, out.stderr[-3000:]
    removed = re.search(r"removed (\S+) \(temporary; --keep or --dir keeps it\)", out.stdout)
    assert removed and not os.path.exists(removed.group(1)), out.stdout
    out = _run("demo", "--world-size", "2", *_SMALL_DEMO, "--keep")
    kept = re.search(r"kept: (\S+)/iter_0000100", out.stdout)
    assert kept and dc.check_is_distributed_checkpoint(f"{kept.group(1)}/iter_0000100")
    shutil.rmtree(kept.group(1))


def test_every_demo_option_is_documented(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option, help_text in [
        ("--world-size WORLD_SIZE", "processes (default 4)"),
        ("--hidden HIDDEN", "model width (default 512)"),
        ("--layers LAYERS", "transformer layers (default 4)"),
        ("--vocab VOCAB", "embedding rows (default 8192)"),
        ("--dir DIR", "parent of the checkpoint, kept (default: a temporary one)"),
        ("--keep", "keep the temporary directory"),
    ]:
        assert f"{option} {help_text}" in text, option


@pytest.mark.timeout(400)  # the fixture's two demo runs count here
def test_verbose_demo_shows_info_lines_from_its_workers(demo_runs):
    out = demo_runs[1][1]
    assert out.returncode == 0, out.stderr[-3000:]
    assert "INFO rank 0 dist_checkpointing" in out.stderr
    assert "Saved checkpoint" in out.stderr


def test_inspect_lists_tensors_objects_and_common_keys(tmp_path, capsys):
    dc.save(
        {
            "w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 3)),
            "o": ShardedObject("rng", 1, (1,), (0,)),
            "step": 4,
        },
        tmp_path / "c",
    )
    assert main(["inspect", str(tmp_path / "c")]) == 0
    text = capsys.readouterr().out
    assert (
        "torch_dist v1" in text
        and "(2, 3)" in text
        and "rng/shard_0_1" in text
        and "value   step" in text
    )
    assert main(["inspect", str(tmp_path)]) == 2
    assert "not a checkpoint but a directory of 1 checkpoint(s)" in capsys.readouterr().err


def _json_out(capsys, argv, code: int) -> object:
    import json

    capsys.readouterr()
    assert main(argv) == code
    return json.loads(capsys.readouterr().out)


def test_every_listing_verb_prints_json_with_its_exit_code(ours, tmp_path, capsys):
    import shutil

    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(ours, root / "iter_0000007")
    assert [e["step"] for e in _json_out(capsys, ["ls", "--json", str(root)], 0)] == [7]
    assert len(_json_out(capsys, ["inspect", "--json", str(ours)], 0)["tensors"]) == 6
    clean = _json_out(capsys, ["verify", "--json", str(ours)], 0)
    assert clean["ok"] is True and clean["problems"] == []
    converted = _json_out(
        capsys, ["convert", "--json", str(ours), str(tmp_path / "out.pt"), "--to", "torch"], 0
    )
    assert converted["tensors"] == 6 and converted["files"] == [str(tmp_path / "out.pt")]
    assert _json_out(capsys, ["diff", "--json", str(ours), str(root / "iter_0000007")], 0)["equal"]
    damaged = root / "iter_0000007" / "__0_0.distcp"
    damaged.write_bytes(damaged.read_bytes()[:-100])
    report = _json_out(capsys, ["verify", "--json", str(root / "iter_0000007")], 1)
    assert report["ok"] is False and report["problems"]
    assert any(p["file"] == "__0_0.distcp" for p in report["problems"])
