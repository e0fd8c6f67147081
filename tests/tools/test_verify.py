"""`dist-ckpt verify`: clean checkpoints pass; every kind of damage is named precisely."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dist_checkpointing.cli import main
from dist_checkpointing.integrity import CHECKSUMS_FNAME
from dist_checkpointing.tools import verify_checkpoint
from dist_checkpointing.tools._storage import read_dcp_metadata, stored_items

pytestmark = pytest.mark.timeout(300)


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("which", ["ours", "stock", "local_ckpt"])
def test_verify_passes_a_clean_checkpoint(which, request, capsys):
    ckpt = request.getfixturevalue(which)
    report = verify_checkpoint(ckpt)
    assert report.ok, report.problems
    assert report.items > 0 and report.bytes > 0
    assert report.checksummed == (which != "stock")
    assert main(["verify", str(ckpt)]) == 0
    assert ": OK:" in capsys.readouterr().out


@pytest.mark.interop
def test_verify_passes_a_megatron_core_checkpoint(mcore):
    report = verify_checkpoint(mcore)
    assert report.ok and not report.checksummed and report.items > 0


def _damage(raw: bytes, kind: str) -> bytes:
    if kind == "truncate":
        return raw[: len(raw) // 2]
    if kind == "flip":
        pos = len(raw) // 2
        return raw[:pos] + bytes([raw[pos] ^ 0x10]) + raw[pos + 1 :]
    if kind == "garbage":
        return b"\x00garbage" * 3
    if kind == "append":
        return raw + b"tail"
    return b""


@pytest.mark.parametrize("kind", ["truncate", "flip", "garbage", "append", "empty"])
@pytest.mark.parametrize("target", ["metadata.json", ".metadata", "common.pt", CHECKSUMS_FNAME])
def test_verify_names_each_damaged_file(ours, tmp_path, target, kind, capsys):
    """The damage kinds of tests/trust/test_fuzz_files.py, on every small file."""
    ckpt = _copy(ours, tmp_path)
    path = ckpt / target
    path.write_bytes(_damage(path.read_bytes(), kind))
    report = verify_checkpoint(ckpt)
    assert not report.ok
    assert any(p.file == target for p in report.problems), report.problems
    assert main(["verify", str(ckpt)]) == 1
    assert target in capsys.readouterr().out


@pytest.mark.parametrize("change", ["drop", "retype", "future"])
def test_verify_reports_wrong_types_missing_fields_and_future_versions(ours, tmp_path, change):
    ckpt = _copy(ours, tmp_path)
    body = json.loads((ckpt / "metadata.json").read_text())
    if change == "drop":
        del body["sharded_backend"]
    elif change == "retype":
        body["sharded_backend_version"] = "one"
    else:
        body["sharded_backend_version"] = 99
    (ckpt / "metadata.json").write_text(json.dumps(body))
    report = verify_checkpoint(ckpt)
    assert [p.file for p in report.problems] == ["metadata.json"], report.problems


def test_verify_names_file_key_and_byte_range_of_a_flipped_data_byte(ours, tmp_path):
    ckpt = _copy(ours, tmp_path)
    items = [i for i in stored_items(read_dcp_metadata(ckpt)) if i.key == "rows"]
    item = items[0]
    path = ckpt / item.file
    raw = bytearray(path.read_bytes())
    pos = item.offset + item.length - 70  # inside the tensor's data
    raw[pos] ^= 0x01
    path.write_bytes(bytes(raw))
    (problem,) = verify_checkpoint(ckpt).problems
    assert problem.file == item.file and problem.key == "rows"
    assert problem.start is not None and problem.end is not None
    assert problem.start <= pos < problem.end
    assert f"bytes {problem.start}-{problem.end}" in str(problem)


def test_verify_reads_every_data_byte(ours, tmp_path):
    """Exhaustive over positions of one data file: every flipped byte of an item is caught."""
    ckpt = _copy(ours, tmp_path)
    items = sorted(stored_items(read_dcp_metadata(ckpt)), key=lambda i: i.offset)
    data_file = ckpt / items[0].file
    raw = data_file.read_bytes()
    covered = [(i.offset, i.offset + i.length) for i in items if i.file == items[0].file]
    for pos in range(0, len(raw), max(1, len(raw) // 64)):
        if not any(a <= pos < b for a, b in covered):
            continue
        data_file.write_bytes(raw[:pos] + bytes([raw[pos] ^ 0x01]) + raw[pos + 1 :])
        problems = verify_checkpoint(ckpt).problems
        assert problems and all(p.file == items[0].file for p in problems), pos
    data_file.write_bytes(raw)
    assert verify_checkpoint(ckpt).ok


def test_verify_reports_missing_and_truncated_data_files(ours, tmp_path):
    ckpt = _copy(ours, tmp_path)
    files = sorted(p for p in ckpt.iterdir() if p.suffix == ".distcp" and p.stat().st_size)
    files[0].unlink()
    raw = files[1].read_bytes()
    files[1].write_bytes(raw[: len(raw) // 2])
    problems = verify_checkpoint(ckpt).problems
    assert any(p.file == files[0].name and "missing" in p.message for p in problems)
    assert any(p.file == files[1].name and "truncated" in p.message for p in problems)


def test_verify_catches_damage_without_checksums_by_structure(stock, tmp_path):
    ckpt = _copy(stock, tmp_path)
    item = next(i for i in stored_items(read_dcp_metadata(ckpt)) if i.key == "rows")
    path = ckpt / item.file
    raw = path.read_bytes()
    path.write_bytes(raw[: item.offset] + b"\x00" * 40 + raw[item.offset + 40 :])
    (problem,) = verify_checkpoint(ckpt).problems
    assert problem.key == "rows" and problem.start == item.offset


def test_verify_names_a_damaged_local_part(local_ckpt, tmp_path):
    ckpt = _copy(local_ckpt, tmp_path)
    part = next((ckpt / "1").glob("*_local.pt"))
    raw = bytearray(part.read_bytes())
    raw[len(raw) // 3] ^= 0xFF
    part.write_bytes(bytes(raw))
    (problem,) = verify_checkpoint(ckpt).problems
    assert problem.file == str(part.relative_to(ckpt))


def test_verify_of_a_missing_path_is_one_line_exit_2(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such file" in err
