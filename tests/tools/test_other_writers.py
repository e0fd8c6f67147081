"""Every `dist-ckpt` verb, through the command line, on checkpoints we did not write:
megatron-core 0.16.1 (`common.pt`), megatron-core 0.19.2 (common state inside the `.distcp`
files, no `common.pt`) and stock PyTorch DCP (no `metadata.json`). The megatron ones skip
when their side environments are missing."""

from __future__ import annotations

import io
import json
import shutil
import struct
import zipfile
from typing import Dict

import pytest
import torch

from dist_checkpointing.cli import main
from dist_checkpointing.tools._storage import read_dcp_metadata, stored_items
from tests.tools import _tools_fns
from tests.tools.test_convert_and_diff import _check_both_formats

pytestmark = pytest.mark.timeout(300)

WRITERS = [
    pytest.param("mcore", marks=pytest.mark.interop),
    pytest.param("mcore19", marks=pytest.mark.interop),
    "stock",
]


def _expected(which: str) -> Dict[str, torch.Tensor]:
    if which == "stock":
        return _tools_fns.full_tensors()
    from tests.interop.test_megatron_core import _expected as mcore_tensors

    full, stack = mcore_tensors()
    return {"w": full, "layers": stack}


def _tensor_data_start(item: bytes) -> int:
    """Where a DCP item's tensor bytes start: other writers store each chunk as a
    `torch.save` zip archive, whose data record follows its local file header."""
    with zipfile.ZipFile(io.BytesIO(item)) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    name_len, extra_len = struct.unpack_from("<HH", item, info.header_offset + 26)
    return info.header_offset + 30 + name_len + extra_len


def _json(capsys, argv) -> object:
    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("which", WRITERS)
def test_ls_and_inspect_list_a_foreign_checkpoint_as_json(which, request, tmp_path, capsys):
    ckpt = request.getfixturevalue(which)
    expected = _expected(which)
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(ckpt, root / "iter_0000005")
    (listed,) = _json(capsys, ["ls", "--json", str(root)])
    assert (listed["step"], listed["complete"]) == (5, True)
    assert listed["kind"] == ("dcp" if which == "stock" else "torch_dist")
    assert {t["key"] for t in listed["tensors"]} == set(expected)
    info = _json(capsys, ["inspect", "--json", str(ckpt)])
    tensors = {t["key"]: t for t in info["tensors"]}
    assert set(tensors) == set(expected)
    for key, value in expected.items():
        assert tensors[key]["shape"] == list(value.shape)
        assert tensors[key]["dtype"] == str(value.dtype)
        assert tensors[key]["shards"] >= 1
    assert info["checksums"]["present"] is False  # other writers record none
    if which != "stock":  # megatron's objects and common state, read and shown
        values = " ".join(info["objects"].values())
        assert "'seed': 0" in values and "'seed': 1" in values and "5" in values
    assert main(["inspect", str(ckpt)]) == 0  # the table form
    assert "checksums: none" in capsys.readouterr().out


@pytest.mark.parametrize("which", WRITERS)
def test_verify_passes_a_foreign_checkpoint_and_names_a_truncated_file(
    which, request, tmp_path, capsys
):
    ckpt = request.getfixturevalue(which)
    assert main(["verify", str(ckpt)]) == 0
    assert "OK" in capsys.readouterr().out
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    victim = max(copy.glob("*.distcp"), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    assert main(["verify", str(copy)]) == 1
    assert victim.name in capsys.readouterr().out


@pytest.mark.parametrize("which", WRITERS)
def test_convert_round_trips_a_foreign_checkpoint_bit_exactly(which, request, tmp_path):
    _check_both_formats(request.getfixturevalue(which), tmp_path, _expected(which))


@pytest.mark.parametrize("which", WRITERS)
def test_diff_of_a_foreign_checkpoint_finds_one_changed_value(which, request, tmp_path, capsys):
    ckpt = request.getfixturevalue(which)
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    assert main(["diff", str(ckpt), str(copy)]) == 0
    assert capsys.readouterr().out.startswith("equal")
    key = sorted(_expected(which))[-1]
    item = next(i for i in stored_items(read_dcp_metadata(copy)) if i.key == key)
    raw = bytearray((copy / item.file).read_bytes())
    raw[item.offset + _tensor_data_start(raw[item.offset : item.offset + item.length])] ^= 0x01
    (copy / item.file).write_bytes(bytes(raw))
    assert main(["diff", str(ckpt), str(copy)]) == 1
    out = capsys.readouterr().out
    assert f"values differ: {key}" in out and out.rstrip().endswith(")")


@pytest.mark.interop
def test_megatron_core_016_and_019_checkpoints_of_the_same_state_diff_equal(mcore, mcore19, capsys):
    """0.19 keeps the common state in an object, 0.16 in common.pt: compared as values."""
    assert main(["diff", str(mcore), str(mcore19)]) == 0
    assert capsys.readouterr().out.startswith("equal (2 tensors compared")
