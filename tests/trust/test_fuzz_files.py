"""Property-based fuzzing of the files a torch_dist checkpoint is made of.

Each example damages one file of a pristine checkpoint (truncation, bit flips, garbage,
wrong JSON types, missing fields, future versions) and loads it. The only acceptable
outcomes: a `CheckpointingException` subclass, or (for harmless damage) exactly the saved
values. Never another exception, a hang, or a wrong tensor. Without `checksums.json` the
parsers themselves must still fail cleanly.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.errors import CheckpointingException
from dist_checkpointing.integrity import CHECKSUMS_FNAME, Checksums

pytestmark = pytest.mark.timeout(600)

FILES = ["metadata.json", ".metadata", "common.pt", CHECKSUMS_FNAME]
_SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _state(fill: bool = True) -> Dict[str, Any]:
    w = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    b = torch.arange(5, dtype=torch.int64)
    return {
        "w": ShardedTensor.from_rank_offsets("w", w if fill else torch.zeros_like(w)),
        "b": ShardedTensor.from_rank_offsets("b", b if fill else torch.zeros_like(b)),
        "o": ShardedObject("o", {"k": [1, 2]} if fill else None, (1,), (0,)),
        "step": 3,
        "name": "run",
    }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("fuzz") / "ckpt"
    dc.save(_state(), ckpt)
    assert all((ckpt / f).exists() for f in FILES)
    return ckpt


def _check_outcome(ckpt: Path, values_must_match: bool) -> None:
    assert isinstance(dc.check_is_distributed_checkpoint(ckpt), bool)  # never raises
    calls: Dict[str, Callable[[], Any]] = {
        "load": lambda: dc.load(_state(fill=False), ckpt),
        "common": lambda: dc.load_common_state_dict(ckpt),
        "metadata": lambda: dc.load_sharded_metadata(ckpt),
    }
    for name, call in calls.items():
        try:
            result = call()
        except CheckpointingException:
            continue
        if not values_must_match:
            continue
        if name == "load":
            want = _state()
            assert torch.equal(result["w"], want["w"].data) and torch.equal(
                result["b"], want["b"].data
            )
            assert result["o"] == {"k": [1, 2]} and result["step"] == 3 and result["name"] == "run"
        elif name == "common":
            assert result["step"] == 3 and result["name"] == "run"
        else:
            assert set(result) == {"w", "b", "o/shard_0_1"}
            assert result["w"].global_shape == (8, 6) and result["w"].dtype == torch.float32


def _damage_bytes(data: Any, raw: bytes) -> bytes:
    kind = data.draw(st.sampled_from(["truncate", "flip", "garbage", "append", "empty"]))
    if kind == "truncate":
        return raw[: data.draw(st.integers(0, max(0, len(raw) - 1)))]
    if kind == "flip":
        pos = data.draw(st.integers(0, len(raw) - 1))
        return raw[:pos] + bytes([raw[pos] ^ (1 << data.draw(st.integers(0, 7)))]) + raw[pos + 1 :]
    if kind == "garbage":
        return data.draw(st.binary(min_size=1, max_size=400))
    if kind == "append":
        return raw + data.draw(st.binary(min_size=1, max_size=64))
    return b""


_JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.text(max_size=12),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _damage_json(data: Any, raw: bytes) -> bytes:
    body = json.loads(raw)
    key = data.draw(st.sampled_from(sorted(body)))
    kind = data.draw(st.sampled_from(["drop", "retype", "future"]))
    if kind == "drop":
        del body[key]
    elif kind == "retype":
        body[key] = data.draw(_JSON_VALUES)
    else:
        body[key] = (
            data.draw(st.integers(2, 10**6)) if "version" in key or key == "format" else "v99"
        )
    return json.dumps(body).encode()


def _with_copy(pristine: Path, mutate: Callable[[Path], bool]) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="dc-fuzz-"))
    try:
        ckpt = tmp / "ckpt"
        shutil.copytree(pristine, ckpt)
        values_must_match = mutate(ckpt)
        _check_outcome(ckpt, values_must_match)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@_SETTINGS
@given(data=st.data(), target=st.sampled_from(FILES))
def test_damaged_bytes_with_checksums(pristine, data, target):
    def mutate(ckpt: Path) -> bool:
        path = ckpt / target
        path.write_bytes(_damage_bytes(data, path.read_bytes()))
        return True  # checksums on: whatever loads must be exactly what was saved

    _with_copy(pristine, mutate)


@_SETTINGS
@given(data=st.data(), target=st.sampled_from([".metadata", "common.pt", "metadata.json"]))
def test_damaged_bytes_without_checksums(pristine, data, target):
    """The parsers alone (a checkpoint from another writer has no checksums.json)."""

    def mutate(ckpt: Path) -> bool:
        (ckpt / CHECKSUMS_FNAME).unlink()
        path = ckpt / target
        path.write_bytes(_damage_bytes(data, path.read_bytes()))
        return target == "metadata.json"  # undetectable value changes are possible elsewhere

    _with_copy(pristine, mutate)


@_SETTINGS
@given(data=st.data(), target=st.sampled_from(["metadata.json", CHECKSUMS_FNAME]))
def test_wrong_types_missing_fields_and_future_versions(pristine, data, target):
    def mutate(ckpt: Path) -> bool:
        path = ckpt / target
        path.write_bytes(_damage_json(data, path.read_bytes()))
        return True

    _with_copy(pristine, mutate)


def test_future_checksum_format_with_a_valid_digest_is_refused(pristine, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pristine, ckpt)
    body = json.loads((ckpt / CHECKSUMS_FNAME).read_bytes())
    body.pop("digest")
    body["format"] = 3
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    from dist_checkpointing.integrity import checksum

    body["digest"] = f"{checksum(canonical):016x}"
    (ckpt / CHECKSUMS_FNAME).write_text(json.dumps(body))
    with pytest.raises(CheckpointingException, match="unsupported format 3"):
        dc.load(_state(fill=False), ckpt)
    assert Checksums  # the public parser is what refused it


def test_each_data_item_flip_is_detected(pristine, tmp_path):
    """Exhaustive over positions of one data file: every flipped byte of an item the load
    reads is caught (the plain values recorded for DCP readers are read from common.pt)."""
    from dist_checkpointing.tools._storage import read_dcp_metadata, stored_items

    ckpt = tmp_path / "ckpt"
    shutil.copytree(pristine, ckpt)
    data_file = next(p for p in ckpt.iterdir() if p.suffix == ".distcp" and p.stat().st_size)
    raw = data_file.read_bytes()
    metadata = read_dcp_metadata(ckpt)
    read = [
        (i.offset, i.offset + i.length)
        for i in stored_items(metadata)
        if i.file == data_file.name and i.key not in (metadata.planner_data or {})
    ]
    for pos in range(0, len(raw), max(1, len(raw) // 64)):
        if not any(a <= pos < b for a, b in read):
            continue
        data_file.write_bytes(raw[:pos] + bytes([raw[pos] ^ 0x01]) + raw[pos + 1 :])
        with pytest.raises(CheckpointingException):
            dc.load(_state(fill=False), ckpt)
    data_file.write_bytes(raw)
    dc.load(_state(fill=False), ckpt)


def test_regressions_found_by_the_fuzzer(pristine, tmp_path):
    """A one-byte common.pt (struct.error in torch.load) and DCP metadata whose objects lost
    an attribute (a flipped bit in a field name) are corruption, not crashes."""
    import pickle

    from dist_checkpointing.strategies.torch_dist.metadata_file import read_metadata

    ckpt = tmp_path / "ckpt"
    shutil.copytree(pristine, ckpt)
    (ckpt / CHECKSUMS_FNAME).unlink()
    (ckpt / "common.pt").write_bytes(b"J")
    with pytest.raises(CheckpointingException):
        dc.load_common_state_dict(ckpt)
    shutil.copy(pristine / "common.pt", ckpt / "common.pt")
    md = read_metadata(ckpt)
    for value in md.state_dict_metadata.values():
        if hasattr(value, "size"):
            del value.size
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointingException, match="malformed DCP metadata"):
        dc.load_sharded_metadata(ckpt)  # (loads of given keys read the index instead)
