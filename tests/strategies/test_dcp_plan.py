"""Pure planning of the torch_dist backend: file grouping, metadata and read plans."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.storage import WriteResult

from dist_checkpointing.errors import CheckpointingException, ShardingIntegrityError
from dist_checkpointing.mapping import ShardedTensor
from dist_checkpointing.strategies.torch_dist.finalize import build_global_metadata, encode_report
from dist_checkpointing.strategies.torch_dist.plan import (
    TensorRequest,
    WriteEntry,
    is_empty_chunk,
    plan_tensor_reads,
    split_into_files,
    tensor_write_item,
)
from tests._sharding import shardings


def _item(key, offset, size, shape):
    return tensor_write_item(ShardedTensor(key, None, torch.float32, size, shape, offset, None))


def build_metadata(per_rank, dedup=False):
    """The global metadata from each rank's items, through the finalize reports."""
    reports = []
    for rank, items in enumerate(per_rank):
        stored = [it for it in items if not is_empty_chunk(it)]
        results = [
            WriteResult(it.index, 1, _StorageInfo(f"__{rank}_0.distcp", i, 1))
            for i, it in enumerate(stored)
        ]
        reports.append(encode_report(items, results, full_keys=True))
    return build_global_metadata(reports, dedup)


def test_split_into_files_balances_bytes_and_separates_hint():
    entries = [
        WriteEntry(_item(f"k{i}", (0,), (n,), (n,)), torch.zeros(n))
        for i, n in enumerate([100, 60, 50, 10])
    ]
    entries.append(WriteEntry(_item("opt.x", (0,), (5,), (5,)), torch.zeros(5)))
    files = split_into_files(entries, 2, separation_hint="opt.")
    groups = [(g, sorted(e.item.index.fqn for e in es)) for g, es in files]
    assert ("opt.", ["opt.x"]) in groups
    sizes = sorted(sum(e.nbytes for e in es) for g, es in files if g == "")
    assert sizes == [440, 440]  # 400+40 and 240+200


def test_build_metadata_rejects_duplicates_and_disagreement():
    a = _item("w", (0,), (2,), (4,))
    with pytest.raises(ShardingIntegrityError, match="written twice"):
        build_metadata([[a], [a]])
    assert len(build_metadata([[a], [a]], dedup=True).state_dict_metadata["w"].chunks) == 1
    with pytest.raises(ShardingIntegrityError, match="rank 1 writes shape"):
        build_metadata([[a], [_item("w", (2,), (2,), (5,))]])


def test_build_metadata_registers_empty_chunks_without_storing_them():
    full, empty = _item("w", (0,), (4,), (4,)), _item("w", (4,), (0,), (4,))
    md = build_metadata([[full], [empty], [empty]])
    assert [tuple(c.sizes) for c in md.state_dict_metadata["w"].chunks] == [(4,)]
    only_empty = build_metadata([[_item("z", (0, 0), (0, 3), (0, 3))]] * 2)
    assert only_empty.state_dict_metadata["z"].chunks == []
    assert tuple(only_empty.state_dict_metadata["z"].size) == (0, 3)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple))
def test_read_plans_cover_any_request_exactly(data, shape):
    saved = data.draw(shardings(shape, 0, 3, replicas=False))
    md = build_metadata([[_item("w", o, s, shape) for o, s, _ in boxes] for boxes in saved])
    stored = md.state_dict_metadata["w"]
    wanted = data.draw(shardings(shape, 0, 2, replicas=False))
    for slot, (offset, size, _) in enumerate(b for boxes in wanted for b in boxes):
        reads = plan_tensor_reads(TensorRequest("w", slot, offset, size), stored)
        covered = torch.zeros(size, dtype=torch.int32)
        for r in reads:
            view = covered
            for dim, (o, n) in enumerate(zip(r.dest_offsets, r.lengths)):
                view = view.narrow(dim, o, n)
            view += 1
            chunk = stored.chunks[r.storage_index.index]
            assert all(o + n <= c for o, n, c in zip(r.storage_offsets, r.lengths, chunk.sizes))
        assert bool((covered == 1).all())


def test_read_plan_reports_uncovered_region():
    md = build_metadata([[_item("w", (0,), (2,), (4,))]])
    with pytest.raises(CheckpointingException, match="holds 2 of the 4 elements"):
        plan_tensor_reads(TensorRequest("w", 0, (0,), (4,)), md.state_dict_metadata["w"])
    assert (
        len(
            plan_tensor_reads(
                TensorRequest("w", 0, (0,), (4,)), md.state_dict_metadata["w"], allow_partial=True
            )
        )
        == 1
    )
