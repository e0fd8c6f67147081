"""A checkpoint is one sealed unit: each of its files replaced by another checkpoint's copy
(alone or with its sidecar), deleted, relinked or joined by an extra file is caught by
`load` and by `verify`, naming the file; the commit record protects itself and `metadata.json`.

Two 2-rank checkpoints of one layout (other values) are saved once per module; each case
edits a copy and loads it in this process (world 1 reads a 2-rank checkpoint whole).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from pathlib import Path
from typing import Dict

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing.errors import CheckpointingException
from dist_checkpointing.integrity import checksum
from dist_checkpointing.tools.verify import verify_checkpoint
from tests._world import get_world
from tests.trust import _seal_fns as F

pytestmark = pytest.mark.timeout(300)

DATA = ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"]
SIDECARS = [d + ".sums" for d in DATA]
FILES = [
    ".metadata",
    ".metadata.index",
    *DATA,
    *SIDECARS,
    "checksums.json",
    "claim.json",
    "common.pt",
    "metadata.json",
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Dict[str, Path]:
    base = tmp_path_factory.mktemp("sealed")
    dirs = {name: base / name for name in ("a", "b", "plain")}
    get_world(2).run_ok(F.save_pair, *(str(d) for d in dirs.values()), timeout=120)
    return dirs


def _copy(pair: Dict[str, Path], tmp_path: Path, which: str = "a") -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pair[which], ckpt)
    return ckpt


def _assert_detected(ckpt: Path, *names: str) -> None:
    """`load` raises and `verify` reports a problem, each naming one of `names`."""
    with pytest.raises(CheckpointingException) as info:
        F.load_whole(str(ckpt))
    assert any(n in str(info.value) for n in names), str(info.value)
    report = verify_checkpoint(ckpt)
    assert not report.ok
    assert any(n in str(p) for p in report.problems for n in names), report.problems


def _assert_loads_a(ckpt: Path) -> None:
    loaded = F.load_whole(str(ckpt))
    for key, value in F.full_tensors(1.0).items():
        assert torch.equal(loaded[key], value), key
    assert loaded["step"] == 1
    assert verify_checkpoint(ckpt).ok


def test_the_files_of_the_checkpoint_are_those_the_cases_edit(pair):
    assert sorted(os.listdir(pair["a"])) == sorted(FILES)
    _assert_loads_a(pair["a"])


@pytest.mark.parametrize("name", FILES)
def test_a_file_of_another_checkpoint_is_detected_or_identical(pair, tmp_path, name):
    ckpt = _copy(pair, tmp_path)
    shutil.copyfile(pair["b"] / name, ckpt / name)
    if (pair["a"] / name).read_bytes() == (pair["b"] / name).read_bytes():
        _assert_loads_a(ckpt)  # the same bytes (the layout's metadata): nothing changed
    else:
        _assert_detected(ckpt, name)


@pytest.mark.parametrize("name", DATA)
def test_a_data_file_swapped_with_its_sidecar_is_detected(pair, tmp_path, name):
    ckpt = _copy(pair, tmp_path)
    for n in (name, name + ".sums"):
        shutil.copyfile(pair["b"] / n, ckpt / n)
    _assert_detected(ckpt, name)


@pytest.mark.parametrize("name", [n for n in FILES if n != "metadata.json"])
def test_a_deleted_file_is_detected(pair, tmp_path, name):
    ckpt = _copy(pair, tmp_path)
    (ckpt / name).unlink()
    _assert_detected(ckpt, name)


@pytest.mark.parametrize("name", FILES)
def test_a_file_relinked_to_another_directory_is_detected(pair, tmp_path, name):
    ckpt = _copy(pair, tmp_path)
    (ckpt / name).unlink()
    (ckpt / name).symlink_to(pair["b"] / name)
    _assert_detected(ckpt, name)


@pytest.mark.parametrize("name", ["__2_0.distcp", "__0_0.distcp.sums.x.distcp", ".metadata.index"])
def test_an_extra_file_is_detected(pair, tmp_path, name):
    ckpt = _copy(pair, tmp_path)
    if name == ".metadata.index":  # a checkpoint saved without the index: one added later
        _strip_record(ckpt, lambda body: body["files"].pop(".metadata.index"))
    shutil.copyfile(pair["b"] / "__0_0.distcp", ckpt / name)
    _assert_detected(ckpt, name)


def test_a_bit_flip_in_the_backend_name_is_a_damaged_metadata_json(pair, tmp_path):
    ckpt = _copy(pair, tmp_path)
    raw = (ckpt / "metadata.json").read_bytes()
    at = raw.index(b'"torch"')  # the common backend
    (ckpt / "metadata.json").write_bytes(raw[: at + 1] + b"u" + raw[at + 2 :])  # 't' ^ 1 = 'u'
    with pytest.raises(dc.errors.CheckpointCorruptedError, match="metadata.json is damaged"):
        F.load_whole(str(ckpt))
    problems = verify_checkpoint(ckpt).problems
    assert [p.file for p in problems] == ["metadata.json"] and "damaged" in problems[0].message


@pytest.mark.parametrize("change", ["truncated", "another pickle"])
def test_a_damaged_dcp_metadata_is_detected_although_loads_read_the_index(pair, tmp_path, change):
    ckpt = _copy(pair, tmp_path)
    path = ckpt / ".metadata"
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2] if change == "truncated" else pickle.dumps({"a": 1}))
    _assert_detected(ckpt, ".metadata")


def test_a_flipped_data_byte_is_found_after_checksums_json_is_deleted(pair, tmp_path):
    ckpt = _copy(pair, tmp_path)
    (ckpt / "checksums.json").unlink()
    data = bytearray((ckpt / "__1_0.distcp").read_bytes())
    data[len(data) // 2] ^= 1
    (ckpt / "__1_0.distcp").write_bytes(bytes(data))
    _assert_detected(ckpt, "checksums.json")


def _strip_record(ckpt: Path, edit) -> None:
    """Edits `checksums.json`'s body and writes it back with a matching digest."""
    body = json.loads((ckpt / "checksums.json").read_bytes())
    del body["digest"]
    edit(body)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body["digest"] = f"{checksum(canonical):016x}"
    compact = json.dumps(body, sort_keys=True, separators=(",", ":"))  # as rank 0 writes it
    (ckpt / "checksums.json").write_bytes(compact.encode())


def test_a_checkpoint_written_before_sealing_still_loads(pair, tmp_path):
    ckpt = _copy(pair, tmp_path)

    def to_old_format(body: dict) -> None:  # format 2 as written before: no seal fields
        del body["save_id"]
        sealed = [n for n in body["files"] if n.endswith(".sums")]
        for name in sealed + ["metadata.json", "claim.json"]:
            del body["files"][name]

    _strip_record(ckpt, to_old_format)
    (ckpt / "claim.json").unlink()  # saves made no claim then
    assert sorted(json.loads((ckpt / "checksums.json").read_bytes())["files"]) == [
        ".metadata",
        ".metadata.index",
        "common.pt",
    ]
    _assert_loads_a(ckpt)


def test_verify_refuses_an_index_that_load_refuses(pair, tmp_path):
    ckpt = _copy(pair, tmp_path, "plain")  # no checksums: only the index checks stand
    path = ckpt / ".metadata.index"
    raw = path.read_bytes()
    head, rest = raw.split(b"\n", 1)
    top = json.loads(head)
    top["files"][0] = "../" + top["files"][0]
    path.write_bytes(json.dumps(top, separators=(",", ":")).encode() + b"\n" + rest)
    _assert_detected(ckpt, ".metadata.index")


def test_verify_refuses_an_index_that_differs_from_the_dcp_metadata(pair, tmp_path):
    ckpt = _copy(pair, tmp_path, "plain")
    path = ckpt / ".metadata.index"
    head, rest = path.read_bytes().split(b"\n", 1)
    top = json.loads(head)
    top["files"] = top["files"][::-1]  # every entry now points into another data file
    path.write_bytes(json.dumps(top, separators=(",", ":")).encode() + b"\n" + rest)
    report = verify_checkpoint(ckpt)
    assert [p.file for p in report.problems] == [".metadata.index"], report.problems


def test_a_checkpoint_without_checksums_loads_with_one_warning(pair, tmp_path, caplog):
    ckpt = _copy(pair, tmp_path, "plain")
    with caplog.at_level(logging.WARNING, logger="dist_checkpointing"):
        for _ in range(2):
            _assert_loads_a(ckpt)
    warned = [r for r in caplog.records if "without verification" in r.getMessage()]
    assert len(warned) == 1 and "checksums.json" in warned[0].getMessage()


def test_every_rank_of_a_load_raises_what_the_one_checking_rank_found(pair, tmp_path):
    swapped = _copy(pair, tmp_path)
    for n in ("__1_0.distcp", "__1_0.distcp.sums"):  # rank 0 reads neither file
        shutil.copyfile(pair["b"] / n, swapped / n)
    flipped = tmp_path / "flipped"
    shutil.copytree(pair["a"], flipped)
    raw = (flipped / "metadata.json").read_bytes()
    at = raw.index(b'"torch"')
    (flipped / "metadata.json").write_bytes(raw[: at + 1] + b"u" + raw[at + 2 :])
    for ckpt, names in ((swapped, ("__1_0.distcp",)), (flipped, ("metadata.json", "damaged"))):
        outcomes = get_world(2).run_ok(F.load_outcome, str(ckpt), timeout=120)
        for cls, message in outcomes:
            assert cls == "CheckpointCorruptedError", message
            assert all(n in message for n in names), message
