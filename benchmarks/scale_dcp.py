"""PyTorch DCP's planners on a `bench_scale` layout, every rank simulated in this process.

Runs torch's real `DefaultSavePlanner` / `DefaultLoadPlanner` code. Each rank's state dict
holds one metadata-only object per key (`_MetaShard`, all of that rank's chunks of the key,
as megatron's torch_dist hands DCP one sharded tensor with several local shards); it
implements DCP's `__create_write_items__` / `__create_chunk_list__` protocol the way DTensor
does (`planner_helpers._create_write_items_for_dtensor`, with the local shape and offset
given instead of computed from a mesh), so nothing is allocated and the planners run as
they do on DTensors. Every rank lists all its chunks, replicas included: DCP deduplicates
replicas on the coordinator (`dedup_save_plans`).

What a save costs, per rank (CPU seconds, `time.thread_time`):
- other ranks: `set_up_planner` + `create_local_plan` + pickling the plan (`gather_object`)
  + unpickling its piece of the global plan (`scatter_object_list`);
- the coordinator (rank 0): its own local plan, unpickling every rank's plan, then
  `create_global_plan` (dedup, metadata, `_validate_global_plan`), pickling every rank's
  piece for the scatter, and pickling the `.metadata` it writes.
- bytes: torch's object collectives pad every object to the largest one, so the coordinator
  receives `world x max(plan)` in the gather and each rank `max(piece)` in the scatter.
- warm save: `enable_plan_caching=True` (torch >= 2.7), measured on a sample of ranks (a
  rank's cost does not depend on the world) plus the coordinator's cached global plan.
- load: a rank unpickles `.metadata` (with `storage_data` as FileSystemWriter writes it) and
  runs `DefaultLoadPlanner.create_local_plan` (its `_init_state_dict`, which only moves
  meta tensors to a device, is bypassed), for the first and last rank.

The per-rank loops run with the cyclic GC off (each real rank holds only its own objects);
the coordinator's `create_global_plan` runs with it on, as in a real process.
"""

from __future__ import annotations

import gc
import pickle
import random
import time
from typing import Any, Callable, Dict, List, Sequence

import torch
from torch.distributed.checkpoint import default_planner as _default_planner
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from benchmarks.scale_layouts import Layout, Record, resharded

__all__ = ["run", "state_dict"]

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class _MetaShard:
    """A key's local chunks on one rank, without data (DCP's `_Checkpointable` protocol)."""

    __slots__ = ("chunks", "dtype", "global_size")

    def __init__(self, dtype: torch.dtype, global_size: torch.Size) -> None:
        self.dtype = dtype
        self.global_size = global_size
        self.chunks: List[ChunkStorageMetadata] = []

    def size(self) -> torch.Size:
        return self.global_size

    def __create_write_items__(self, fqn: str, obj: Any) -> List[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, c.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=c.offsets, sizes=c.sizes),
                    properties=TensorProperties(dtype=self.dtype),
                    size=self.global_size,
                ),
            )
            for c in self.chunks
        ]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return list(self.chunks)


def state_dict(records: Sequence[Record]) -> Dict[str, _MetaShard]:
    """A rank's DCP state dict for its records."""
    sd: Dict[str, _MetaShard] = {}
    for rec in records:
        shard = sd.get(rec.key)
        if shard is None:
            shard = sd[rec.key] = _MetaShard(_DTYPES[rec.dtype], torch.Size(rec.global_shape))
        shard.chunks.append(
            ChunkStorageMetadata(torch.Size(rec.global_offset), torch.Size(rec.local_shape))
        )
    return sd


def _cpu(fn: Callable[..., Any], *args: Any) -> tuple:
    """(fn(*args), the CPU seconds this thread spent in it)."""
    t0 = time.thread_time()
    out = fn(*args)
    return out, time.thread_time() - t0


def _local_plan(planner: DefaultSavePlanner, sd: Dict[str, Any], is_coordinator: bool) -> bytes:
    """A rank's local plan, pickled as `gather_object` sends it."""
    planner.set_up_planner(sd, is_coordinator=is_coordinator)
    return pickle.dumps(planner.create_local_plan())


def _nbytes(sizes: torch.Size, dtype: torch.dtype) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n * dtype.itemsize


def run(layout: Layout, emit: Callable[[Dict[str, Any]], None]) -> Dict[str, Any]:
    """Simulates a DCP save (cold, then warm) and one rank's load plan; returns the figures."""
    world = layout.world
    out: Dict[str, Any] = {}
    gc.disable()
    all_plans: List[SavePlan] = []
    other_s = [0.0] * world
    gather_sizes: List[int] = []
    unpickle_all_s = 0.0
    coordinator = DefaultSavePlanner(enable_plan_caching=True)
    for r in range(world):
        sd = state_dict(layout.rank_records(r))
        planner = coordinator if r == 0 else DefaultSavePlanner(enable_plan_caching=True)
        blob, other_s[r] = _cpu(_local_plan, planner, sd, r == 0)
        gather_sizes.append(len(blob))
        plan, t = _cpu(pickle.loads, blob)
        unpickle_all_s += t
        all_plans.append(plan)
        if r % 1024 == 1023:
            emit({"ranks_planned": r + 1, "local_plan_max_s": max(other_s)})
    out["local_plan_max_s"] = max(other_s)
    out["coordinator_unpickle_s"] = unpickle_all_s
    out["gather_recv_bytes"] = world * max(gather_sizes)
    out["gather_pickled_bytes"] = sum(gather_sizes)
    emit(dict(out))

    gc.enable()
    (delta, metadata), out["global_plan_s"] = _cpu(coordinator.create_global_plan, all_plans)
    emit(dict(out))
    gc.disable()
    pieces, scatter_pickle_s = _cpu(lambda: [pickle.dumps(p) for p in delta])
    for r, blob in enumerate(pieces):
        _, t = _cpu(pickle.loads, blob)
        other_s[r] += t
    scatter_bytes = max(len(b) for b in pieces)
    del pieces

    metadata.storage_data = {
        item.index: _StorageInfo(
            f"__{r}_0.distcp",
            k,
            _nbytes(item.tensor_data.chunk.sizes, item.tensor_data.properties.dtype),
        )
        for r, p in enumerate(delta)
        for k, item in enumerate(p.items)
    }
    md_blob, md_pickle_s = _cpu(pickle.dumps, metadata)
    out.update(
        save_coordinator_s=other_s[0]
        + unpickle_all_s
        + out["global_plan_s"]
        + scatter_pickle_s
        + md_pickle_s,
        save_other_max_s=max(other_s[1:], default=0.0),
        scatter_recv_bytes=scatter_bytes,
        max_recv_bytes=max(out["gather_recv_bytes"], scatter_bytes),
        metadata_bytes=len(md_blob),
        unique_chunks=sum(len(p.items) for p in delta),
    )
    emit(dict(out))

    out.update(_warm(layout, coordinator, delta))
    emit(dict(out))
    out.update(_load(layout, md_blob))
    return out


def _warm(layout: Layout, coordinator: DefaultSavePlanner, delta: List[SavePlan]) -> Dict[str, Any]:
    """The second save of an unchanged structure with DCP's plan caching."""
    world = layout.world
    rng = random.Random(0)
    sample = sorted({0, 1, world // 2, world - 1, *rng.sample(range(world), min(world, 28))})
    rank_s: Dict[int, float] = {}
    sizes = []
    for r in sample:
        # each rank's class-level caches, as its own process would have them
        SavePlanner._cached_save_plan = {}
        SavePlanner._cached_final_save_plan = {}
        first = DefaultSavePlanner(enable_plan_caching=True)
        first.set_up_planner(state_dict(layout.rank_records(r)), is_coordinator=r == 0)
        first.create_local_plan()
        first.finish_plan(delta[r])
        sd = state_dict(layout.rank_records(r))
        planner = DefaultSavePlanner(enable_plan_caching=True)

        def again() -> bytes:
            planner.set_up_planner(sd, is_coordinator=r == 0)
            blob = pickle.dumps(planner.create_local_plan())
            piece = pickle.loads(pickle.dumps(SavePlan([], usable=False)))
            planner.finish_plan(piece)
            return blob

        blob, rank_s[r] = _cpu(again)
        sizes.append(len(blob))

    def global_again() -> None:
        plans = [pickle.loads(pickle.dumps(SavePlan([], usable=False))) for _ in range(world)]
        new_delta, _ = coordinator.create_global_plan(plans)
        for p in new_delta:
            pickle.dumps(p)

    gc.enable()
    _, coord_s = _cpu(global_again)
    gc.disable()
    others = [s for r, s in rank_s.items() if r != 0]
    return {
        "warm_save_s": max(rank_s[0] + coord_s, max(others, default=0.0)),
        "warm_coordinator_s": rank_s[0] + coord_s,
        "warm_other_max_s": max(others, default=0.0),
        "warm_max_recv_bytes": world * max(sizes),
        "warm_ranks_sampled": len(sample),
    }


def _load(layout: Layout, md_blob: bytes) -> Dict[str, Any]:
    """One rank's DCP load: unpickle `.metadata`, set up and run the local load plan."""
    real_init = _default_planner._init_state_dict
    _default_planner._init_state_dict = lambda sd: None  # only moves meta tensors to a device
    times, sizes, resharded_times = [], [], []
    try:
        for target, timed in ((layout, times), (resharded(layout), resharded_times)):
            for r in sorted({0, target.world - 1}):
                sd = state_dict(target.rank_records(r))
                plan, t = _cpu(_open_and_plan, md_blob, sd, r == 0)
                timed.append(t)
                if target is layout:
                    sizes.append(len(pickle.dumps(plan)))
    finally:
        _default_planner._init_state_dict = real_init
    return {
        "load_open_plan_s": max(times),
        "load_open_plan_resharded_s": max(resharded_times),
        "load_gather_recv_bytes": layout.world * max(sizes),
    }


def _open_and_plan(md_blob: bytes, sd: Dict[str, Any], is_coordinator: bool) -> Any:
    metadata = pickle.loads(md_blob)  # FileSystemReader.read_metadata
    planner = DefaultLoadPlanner()
    planner.set_up_planner(sd, metadata, is_coordinator=is_coordinator)
    return planner.create_local_plan()
