"""`dist-ckpt convert` (bit-exact round trips, HF layout, memory bound) and `dist-ckpt diff`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.cli import main
from dist_checkpointing.errors import CheckpointExistsError
from dist_checkpointing.tools import convert_checkpoint, diff_checkpoints
from tests.tools import _tools_fns

pytestmark = pytest.mark.timeout(300)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def _check_both_formats(ckpt: Path, tmp_path: Path, expected: dict) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    assert main(["convert", str(ckpt), str(out), "--to", "safetensors"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    loaded = {}
    for name in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(str(out / name)))
    assert set(loaded) == set(expected) == set(index["weight_map"])
    assert all(_same_bits(loaded[k], expected[k]) for k in expected)
    assert main(["convert", str(ckpt), str(tmp_path / "all.pt"), "--to", "torch"]) == 0
    back = torch.load(tmp_path / "all.pt", weights_only=True)
    assert set(back) == set(expected) and all(_same_bits(back[k], expected[k]) for k in expected)


def test_convert_round_trips_our_checkpoint_bit_exactly(ours, tmp_path):
    _check_both_formats(ours, tmp_path, _tools_fns.full_tensors())


def test_convert_round_trips_a_stock_dcp_checkpoint_bit_exactly(stock, tmp_path):
    _check_both_formats(stock, tmp_path, _tools_fns.full_tensors())


@pytest.mark.interop
def test_convert_round_trips_a_megatron_core_checkpoint_bit_exactly(mcore, tmp_path):
    from tests.interop.test_megatron_core import _expected

    full, stack = _expected()
    _check_both_formats(mcore, tmp_path, {"w": full, "layers": stack})


def test_convert_writes_hugging_face_shards_within_max_shard_size(ours, tmp_path):
    out = tmp_path / "hf"
    result = convert_checkpoint(ours, out, "safetensors", max_shard_size=200)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 1 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    sizes = {k: v.numel() * v.element_size() for k, v in _tools_fns.full_tensors().items()}
    assert index["metadata"]["total_size"] == sum(sizes.values()) == result.bytes
    per_file: dict = {}
    for key, name in index["weight_map"].items():
        per_file.setdefault(name, []).append(sizes[key])
    assert all(sum(v) <= 200 or len(v) == 1 for v in per_file.values())
    with pytest.raises(CheckpointExistsError):
        convert_checkpoint(ours, out, "safetensors")


def test_convert_refuses_other_backends_in_one_line(local_ckpt, tmp_path, capsys):
    assert main(["convert", str(local_ckpt), str(tmp_path / "x"), "--to", "torch"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "torch_dist" in err


@pytest.mark.timeout(600)
def test_convert_memory_stays_within_the_largest_tensor_plus_buffers(world_factory, tmp_path):
    """12 tensors of 16 MiB (192 MiB), column-sharded: peak RSS growth must stay under the
    stated bound (largest tensor + its largest stored piece + 40 MiB of buffers)."""
    ckpt = tmp_path / "big"
    n, rows, cols = 12, 2048, 2048
    world_factory(2).run_ok(_tools_fns.save_big, str(ckpt), n, rows, cols, timeout=300)
    largest = rows * cols * 4
    bound = largest + largest // 2 + (40 << 20)
    script = Path(__file__).with_name("_convert_rss.py")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    for to, out in (("safetensors", tmp_path / "hf"), ("torch", tmp_path / "big.pt")):
        proc = subprocess.run(
            [sys.executable, str(script), str(ckpt), str(out), to],
            capture_output=True,
            text=True,
            timeout=400,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        measured = json.loads(proc.stdout.strip().splitlines()[-1])
        assert measured["bytes"] == n * largest > bound
        assert measured["growth"] < bound, (to, measured["growth"], bound)
        print(to, "peak RSS growth", measured["growth"], "bound", bound)
    from safetensors import safe_open

    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    with safe_open(str(tmp_path / "hf" / index["weight_map"]["t07"]), "pt") as f:
        t = f.get_tensor("t07")
    assert torch.equal(t[5], torch.arange(cols, dtype=torch.float32) + 7.0)


def _save(path: Path, w: torch.Tensor, step: int = 1, extra: bool = False) -> None:
    sd = {
        "w": ShardedTensor.from_rank_offsets("w", w),
        "o": ShardedObject("o", {"k": 1}, (1,), (0,)),
        "step": step,
    }
    if extra:
        sd["b"] = ShardedTensor.from_rank_offsets("b", torch.zeros(2))
    dc.save(sd, path)


def test_diff_is_equal_only_for_equal_checkpoints(tmp_path, capsys):
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    _save(tmp_path / "a", w)
    _save(tmp_path / "same", w.clone())
    assert diff_checkpoints(tmp_path / "a", tmp_path / "same").equal
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "same")]) == 0
    capsys.readouterr()
    close = w.clone()
    close[1, 2] += 0.25
    _save(tmp_path / "close", close)
    report = diff_checkpoints(tmp_path / "a", tmp_path / "close")
    assert report.differing == [("w", 0.25)]
    assert diff_checkpoints(tmp_path / "a", tmp_path / "close", atol=0.3).equal
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "close")]) == 1
    assert "values differ: w (max abs difference 0.25)" in capsys.readouterr().out
    assert main(["diff", "--atol", "0.3", str(tmp_path / "a"), str(tmp_path / "close")]) == 0


def test_diff_reports_keys_shapes_dtypes_and_values(tmp_path, capsys):
    _save(tmp_path / "a", torch.zeros(3, 4), step=1)
    _save(tmp_path / "b", torch.zeros(4, 3), step=2, extra=True)
    _save(tmp_path / "c", torch.zeros(3, 4, dtype=torch.float16))
    report = diff_checkpoints(tmp_path / "a", tmp_path / "b")
    assert report.only_in_b == ["b"] and report.only_in_a == []
    assert [k for k, _ in report.mismatched] == ["w"] and report.differing_values == ["common:step"]
    assert "float16" in diff_checkpoints(tmp_path / "a", tmp_path / "c").mismatched[0][1]
    assert main(["diff", "--json", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["equal"] is False and data["only_in_b"] == ["b"]


def test_diff_compares_across_writers(ours, stock, tmp_path):
    """Ours vs stock DCP of the same tensors: tensors equal; only non-tensor keys differ."""
    report = diff_checkpoints(ours, stock)
    assert report.mismatched == [] and report.differing == [] and report.tensors_compared == 6
    assert "step" in report.only_in_b and "common:iteration" in report.only_in_a
    shutil.copytree(ours, tmp_path / "copy")
    assert diff_checkpoints(ours, tmp_path / "copy").equal


@pytest.mark.interop
def test_diff_and_ls_read_megatron_core_checkpoints(mcore, tmp_path):
    from dist_checkpointing.tools import list_checkpoints

    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(mcore, root / "iter_0000005")
    (found,) = list_checkpoints(root)
    assert (found.step, found.kind, found.complete, len(found.tensors)) == (
        5,
        "torch_dist",
        True,
        2,
    )
    report = diff_checkpoints(mcore, root / "iter_0000005")
    assert report.equal and report.tensors_compared == 2


def test_convert_shows_a_progress_bar_when_asked(ours, tmp_path, capsys):
    convert_checkpoint(ours, tmp_path / "x.pt", "torch", progress=True)
    err = capsys.readouterr().err
    assert "convert" in err and "100%" in err
    convert_checkpoint(ours, tmp_path / "y.pt", "torch")  # not a terminal: no bar
    assert capsys.readouterr().err == ""
