"""`dist-ckpt inspect / verify / convert / diff` on a checkpoint of quantized weights (the
test-local wrapper subclass of tests/_quant.py, row-split on 2 ranks): each weight shows as its
inner tensors (`w::qdata`, `w::scale`), convert writes them bit for bit, diff names the one
scale value that differs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

import pytest
import torch

from dist_checkpointing.cli import main
from dist_checkpointing.tools import diff_checkpoints
from tests import _quant
from tests._world import get_world
from tests.tools import _tools_fns

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> Path:
    """`a`: the weights of `_tools_fns.save_quantized`; `b`: the same with one scale changed."""
    base = tmp_path_factory.mktemp("quantized")
    world = get_world(2)
    world.run_ok(_tools_fns.save_quantized, str(base / "a"), timeout=120)
    world.run_ok(_tools_fns.save_quantized, str(base / "b"), True, timeout=120)
    return base


def _stored() -> Dict[str, torch.Tensor]:
    """Every stored key and the global tensor it holds."""
    out: Dict[str, torch.Tensor] = {}
    for key, q in _tools_fns.quantized_weights().items():
        out[f"{key}::qdata"] = q.qdata
        if key == "sw":  # swizzled scales: one key per saved piece, as that piece laid them out
            for r in range(2):
                out[f"sw::scale[{4 * r}:{4 * r + 4},0:64]"] = _quant.swizzle(
                    _quant.piece(q, "mx", 0, r, 2)
                ).scale
        else:
            out[f"{key}::scale"] = q.scale
    out["plain"] = torch.arange(16, dtype=torch.float32).reshape(4, 4).to(torch.float8_e5m2)
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_quant.bits(a), _quant.bits(b))


def test_inspect_shows_quantized_weights_as_their_inner_tensors(quantized, capsys):
    assert main(["inspect", "--json", str(quantized / "a")]) == 0
    got = {
        t["key"]: (t["dtype"], tuple(t["shape"]))
        for t in json.loads(capsys.readouterr().out)["tensors"]
    }
    assert got == {k: (str(v.dtype), tuple(v.shape)) for k, v in _stored().items()}
    assert main(["inspect", str(quantized / "a")]) == 0
    lines = capsys.readouterr().out.splitlines()
    for key in ("w::qdata", "w::scale", "mx::scale", "sw::scale[0:4,0:64]"):
        (line,) = [s for s in lines if s.split()[:1] == [key]]
        assert str(_stored()[key].dtype) in line


def test_verify_passes_on_a_quantized_checkpoint(quantized, capsys):
    assert main(["verify", str(quantized / "a")]) == 0
    assert ": OK:" in capsys.readouterr().out


def test_convert_writes_the_inner_tensors_bit_for_bit(quantized, tmp_path):
    out = tmp_path / "all.pt"
    assert main(["convert", str(quantized / "a"), str(out), "--to", "torch"]) == 0
    back = torch.load(out, weights_only=True)
    want = _stored()
    assert set(back) == set(want)
    assert all(_same_bits(back[k], want[k]) for k in want), [
        k for k in want if not _same_bits(back[k], want[k])
    ]


def test_convert_to_safetensors_names_a_dtype_safetensors_lacks(quantized, tmp_path, capsys):
    """safetensors has float8_e4m3fn and float8_e5m2 but no float8_e8m0fnu (MX scales)."""
    assert main(["convert", str(quantized / "a"), str(tmp_path / "hf"), "--to", "safetensors"]) == 2
    err = capsys.readouterr().err
    assert "'mx::scale'" in err and "float8_e8m0fnu" in err


def test_diff_names_the_one_scale_that_differs(quantized, capsys):
    report = diff_checkpoints(quantized / "a", quantized / "b")
    old = _tools_fns.quantized_weights()["w"].scale[4, 0].item()  # rank 1's first row, doubled
    assert report.differing == [("w::scale", pytest.approx(old))]
    assert report.only_in_a == report.only_in_b == report.mismatched == []
    assert main(["diff", str(quantized / "a"), str(quantized / "b")]) == 1
    assert "values differ: w::scale (max abs difference" in capsys.readouterr().out
    assert diff_checkpoints(quantized / "a", quantized / "a").equal
