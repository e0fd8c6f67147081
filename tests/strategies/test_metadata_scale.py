"""The torch_dist save's compact reports and load index, and item checksums kept beside each
data file: same metadata as DCP's own planner, loads that read only their keys, old
checkpoints still verified, damage named."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.errors import CheckpointCorruptedError, CheckpointingException
from dist_checkpointing.integrity import Checksums, read_checksums, write_checksums
from dist_checkpointing.strategies.torch_dist.finalize import (
    build_global_metadata,
    encode_report,
    write_global_metadata,
)
from dist_checkpointing.strategies.torch_dist.metadata_file import (
    INDEX_FNAME,
    open_for_load,
    read_metadata,
)
from dist_checkpointing.strategies.torch_dist.plan import object_write_item, tensor_write_item
from dist_checkpointing.tools import verify_checkpoint


def _layout(tp=4, pp=5, dp=50, keys=12):
    """Per rank of a tp x pp x dp job: its write items and results. Each (tp, pp) group's
    chunks are spread over its dp ranks (as a fully parallel save spreads them); some
    tensors are split by tp, some replicated (kept on tp 0), plus one object per stage."""
    world = tp * pp * dp
    items = [[] for _ in range(world)]
    for p in range(pp):
        for t in range(tp):
            group = [p * tp * dp + t * dp + d for d in range(dp)]
            for k in range(keys):
                key = f"decoder.layers.{p}.mlp.linear_fc{k % 3}.weight_{k}"
                if k % 4 == 3 and t:
                    continue  # replicated over tp: written by tp 0 only
                split = k % 4 != 3
                shape = (8 * tp, 16) if split else (8, 16)
                offset = (8 * t, 0) if split else (0, 0)
                sh = ShardedTensor(key, None, torch.bfloat16, (8, 16), shape, offset, None)
                items[group[(k * 7 + t) % dp]].append(tensor_write_item(sh))
            if t == 0:
                obj = ShardedObject(f"rng_state.{p}", None, (1,), (0,))
                items[group[-1]].append(object_write_item(obj))
    results = []
    for rank, rank_items in enumerate(items):
        offset, res = 0, []
        for it in rank_items:
            length = 4096 + 17 * len(res)
            res.append(
                WriteResult(it.index, length, _StorageInfo(f"__{rank}_0.distcp", offset, length))
            )
            offset += length
        results.append(res)
    return items, results


def test_reports_of_1000_ranks_build_what_dcp_planner_builds_with_every_location():
    items, results = _layout()
    reports = [encode_report(i, r) for i, r in zip(items, results)]
    md = build_global_metadata(reports)
    _, reference = create_default_global_save_plan([SavePlan(i) for i in items])
    assert md.state_dict_metadata == reference.state_dict_metadata
    assert md.storage_data == {r.index: r.storage_data for res in results for r in res}
    # compact: a fraction of the pickled DCP items and results the coordinator used to get
    pickled = sum(len(pickle.dumps((i, r))) for i, r in zip(items, results))
    assert sum(map(len, reports)) * 4 < pickled
    assert reports == [encode_report(i, r) for i, r in zip(items, results)]  # deterministic


def test_reports_naming_keys_by_digest_only_need_whole_keys_from_someone():
    items, results = _layout(tp=2, pp=1, dp=2, keys=4)
    no_origin = [
        ([it for it in i if it.tensor_data is None or any(it.tensor_data.chunk.offsets)], r)
        for i, r in zip(items, results)
    ]
    no_origin = [
        (i, [r for r in rs if any(r.index == it.index for it in i)]) for i, rs in no_origin
    ]
    with pytest.raises(CheckpointingException, match="digest"):
        build_global_metadata([encode_report(i, r) for i, r in no_origin])
    md = build_global_metadata([encode_report(i, r, full_keys=True) for i, r in no_origin])
    assert all(len(v.chunks) == 1 for k, v in md.state_dict_metadata.items() if "rng" not in k)


def test_load_index_gives_exactly_the_requested_keys_of_the_full_metadata(tmp_path):
    items, results = _layout(dp=8)
    digests = write_global_metadata(
        tmp_path, [encode_report(i, r) for i, r in zip(items, results)], False
    )
    assert set(digests) == {".metadata", INDEX_FNAME}
    full = read_metadata(tmp_path)
    keys = sorted(full.state_dict_metadata)[::7]
    part = open_for_load(tmp_path, keys, Checksums(files=digests))
    assert part.state_dict_metadata == {k: full.state_dict_metadata[k] for k in keys}
    assert part.storage_data == {i: s for i, s in full.storage_data.items() if i.fqn in keys}
    assert open_for_load(tmp_path, None) == full
    assert (
        open_for_load(tmp_path, ["no such key"]) == full
    )  # the full metadata names what is missing


def _state(fill=True):
    w = torch.arange(96, dtype=torch.float32).reshape(12, 8)
    return {
        "w": ShardedTensor.from_rank_offsets("w", w if fill else torch.zeros_like(w)),
        "b": ShardedTensor.from_rank_offsets(
            "b", torch.arange(5) if fill else torch.zeros(5, dtype=torch.int64)
        ),
        "o": ShardedObject("o", {"k": 1} if fill else None, (1,), (0,)),
    }


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "c"
    dc.save(_state(), path)
    return path


def _check(out):
    want = _state()
    assert torch.equal(out["w"], want["w"].data) and torch.equal(out["b"], want["b"].data)
    assert out["o"] == {"k": 1}


def test_loads_read_the_index_not_the_pickled_metadata(ckpt):
    for path in [*ckpt.glob("*.sums"), ckpt / "checksums.json"]:  # no record: nothing checks it
        path.unlink()
    (ckpt / ".metadata").write_bytes(b"\x80\x04garbage")  # only the index can serve the load
    _check(dc.load(_state(fill=False), ckpt))
    rows = ShardedTensor.from_rank_offsets("w", torch.zeros(6, 8), (0, 1, 2))  # a reshard
    out = dc.load({"w": rows}, ckpt, validate_access_integrity=False)
    assert torch.equal(out["w"], _state()["w"].data[6:])
    with pytest.raises(CheckpointCorruptedError, match=r"\.metadata"):
        dc.load_tensors_metadata(ckpt)  # asks for every key: reads .metadata


def test_a_damaged_pickled_metadata_fails_the_load_that_plans_from_the_index(ckpt):
    (ckpt / ".metadata").write_bytes(b"\x80\x04garbage")  # the sealed record's digest differs
    with pytest.raises(CheckpointCorruptedError, match=r"\.metadata: checksum mismatch"):
        dc.load(_state(fill=False), ckpt)


def test_item_checksums_live_beside_the_data_files_not_in_checksums_json(ckpt):
    body = json.loads((ckpt / "checksums.json").read_bytes())
    assert body["format"] == 2 and "ranges" not in body
    data = sorted(p.name for p in ckpt.iterdir() if p.suffix == ".distcp")
    assert data and all((ckpt / f"{name}.sums").is_file() for name in data)
    # whole files only: the metadata, and the sidecars and metadata.json that the commit seals
    sidecars = {f"{name}.sums" for name in data}
    bound = {".metadata", INDEX_FNAME, "common.pt", "metadata.json", "claim.json"}
    assert set(body["files"]) == bound | sidecars


def _make_old_style(ckpt):
    """As saved before: every item checksum in checksums.json (format 1), no sidecars or index."""
    sums = read_checksums(ckpt)
    for name in [p.name for p in ckpt.iterdir() if p.suffix == ".distcp"]:
        sums.item_sums(name)
        (ckpt / f"{name}.sums").unlink()
    sums.directory = None
    sums.save_id = None  # nor the fields of the sealed record
    sums.files = {k: v for k, v in sums.files.items() if k in (".metadata", "common.pt")}
    (ckpt / INDEX_FNAME).unlink()
    write_checksums(ckpt, sums)
    assert json.loads((ckpt / "checksums.json").read_bytes())["format"] == 1


def test_old_style_checkpoint_loads_and_verifies(ckpt):
    _make_old_style(ckpt)
    _check(dc.load(_state(fill=False), ckpt))
    assert verify_checkpoint(ckpt).ok and verify_checkpoint(ckpt).checksummed
    data = next(p for p in ckpt.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptedError, match=data.name):
        dc.load(_state(fill=False), ckpt)
    assert [p.file for p in verify_checkpoint(ckpt).problems] == [data.name]


@pytest.mark.parametrize("target", ["sidecar", "index", "data"])
def test_damage_is_reported_naming_the_file(ckpt, target):
    data = next(p for p in sorted(ckpt.iterdir()) if p.suffix == ".distcp")
    path = {"sidecar": ckpt / f"{data.name}.sums", "index": ckpt / INDEX_FNAME, "data": data}[
        target
    ]
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x04
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptedError, match=path.name.replace(".", r"\.")):
        dc.load(_state(fill=False), ckpt)
    report = verify_checkpoint(ckpt)
    assert not report.ok and any(path.name in str(p) for p in report.problems), report.problems


def test_missing_sidecar_is_corruption_and_stock_dcp_still_reads_the_checkpoint(ckpt, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    sidecar = next(p for p in copy.iterdir() if p.name.endswith(".sums"))
    sidecar.unlink()
    with pytest.raises(CheckpointCorruptedError, match="missing"):
        dc.load(_state(fill=False), copy)
    out = {"w": torch.zeros(12, 8), "b": torch.zeros(5, dtype=torch.int64)}
    dcp.load(out, checkpoint_id=str(ckpt), no_dist=True)
    assert torch.equal(out["w"], _state()["w"].data) and torch.equal(out["b"], torch.arange(5))


def test_remove_sharded_tensors_rewrites_the_index(tmp_path):
    from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    sd = {**_state(), "opt.m": ShardedTensor.from_rank_offsets("opt.m", torch.ones(3))}
    strategy = TorchDistSaveShardedStrategy(separation_hint="opt.")
    dc.save(sd, tmp_path / "c", sharded_strategy=strategy)
    dc.remove_sharded_tensors(tmp_path / "c", "opt.")
    assert not any(p.name.startswith("opt.") for p in (tmp_path / "c").iterdir())
    _check(dc.load(_state(fill=False), tmp_path / "c"))
    assert verify_checkpoint(tmp_path / "c").ok
