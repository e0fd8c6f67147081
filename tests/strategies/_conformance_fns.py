"""Rank functions of the backend conformance suite (module level: sent to worker ranks).

Every function takes the backend's name and a root directory and runs on every rank of a
gloo world. They use public entry points only (`dist_checkpointing.save/load/...`), so
they hold for any sharded backend: 'torch_dist', 'local' (each rank its own directory,
as on node-local disks) and the test's own registered ('per_rank', 1).
Outcomes are returned as plain data (value, or exception type and message) so that the
test process can check that every rank saw the same thing.
"""

from __future__ import annotations

import glob
import logging
import os
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from dist_checkpointing.validation import StrictHandling
from tests._sharding import bitwise_equal
from tests.strategies import _per_rank_backend

BACKENDS: Dict[str, Tuple[str, int]] = {
    "torch_dist": ("torch_dist", 1),
    "local": ("local", 2),
    "per_rank": (_per_rank_backend.BACKEND, 1),
}
#: Backends whose load accepts a sharding other than the saved one.
RESHARDING = {"torch_dist"}

#: Files of rank 1's part of a checkpoint, per backend (glob under the checkpoint root).
RANK1_DATA = {
    "torch_dist": "{root}/{name}/__1_*.distcp",
    "local": "{root}/node1/{name}/*/*_local.pt",
    "per_rank": "{root}/{name}/shards_1.pt",
}

Outcome = Tuple[str, Any]  # ("ok", value) or ("err", "ExceptionType: message")


def ckpt_dir(backend: str, root: str, name: str, rank: Optional[int] = None) -> str:
    """Where a rank's checkpoint `name` lives: node-local backends get a directory per rank."""
    r = dist.get_rank() if rank is None else rank
    return os.path.join(root, f"node{r}", name) if backend == "local" else os.path.join(root, name)


def _setup(backend: str) -> Tuple[str, int]:
    _per_rank_backend.register()  # idempotent; every process needs it before a lookup
    return BACKENDS[backend]


def _global(key: str, shape: Tuple[int, ...], dtype: torch.dtype, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}/{step}".encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype in (torch.int8, torch.int64):
        return torch.randint(-100, 100, shape, generator=g).to(dtype)
    return (torch.randn(shape, generator=g) * 100).to(dtype)


def _split(key: str, g: torch.Tensor, axis: int, zero: bool, **kw: Any) -> ShardedTensor:
    r, w = dist.get_rank(), dist.get_world_size()
    size = g.shape[axis] // w
    local = g.narrow(axis, r * size, size).clone()
    return ShardedTensor.from_rank_offsets(
        key, local.zero_() if zero else local, (axis, r, w), **kw
    )


# (key, global shape, dtype, how it is split: axis or None for replicated on every rank)
TENSORS: List[Tuple[str, Tuple[int, ...], torch.dtype, Optional[int]]] = [
    ("fp32", (8, 6), torch.float32, 0),
    ("fp16", (4, 10), torch.float16, 1),
    ("bf16", (5,), torch.bfloat16, None),
    ("i64", (6, 3), torch.int64, 0),
    ("i8", (2, 12), torch.int8, 1),
    ("bool", (4, 4), torch.bool, 1),
    ("layers.0.w", (6, 4), torch.float32, 0),
]


def state(step: int = 0, zero: bool = False) -> Dict[str, Any]:
    """A state dict with every dtype, nested containers, ShardedObjects and common state.

    With `zero`, the same structure with zeroed tensors and empty objects (a load request).
    """
    r, w = dist.get_rank(), dist.get_world_size()
    sharded: Dict[str, Any] = {}
    for key, shape, dtype, axis in TENSORS:
        g = _global(key, shape, dtype, step)
        if axis is None:
            sharded[key] = ShardedTensor.from_rank_offsets(
                key, g.clone().zero_() if zero else g.clone(), replica_id=r
            )
        else:
            sharded[key] = _split(key, g, axis, zero)
    # prepend_axis_num: each rank's 2-D piece is one slice of a 3-D global tensor
    g3 = _global("stacked", (w, 3, 2), torch.float32, step)
    stacked = ShardedTensor.from_rank_offsets(
        "stacked", g3[r].clone().zero_() if zero else g3[r].clone(), (0, r, w), prepend_axis_num=1
    )
    return {
        "model": {
            "fp32": sharded["fp32"],
            "layers": [{"w": sharded["layers.0.w"]}],
            "stacked": stacked,
        },
        "opt": [sharded[k] for k in ("fp16", "bf16", "i64", "i8", "bool")],
        "rng": ShardedObject("rng", None if zero else {"rank": r, "step": step}, (w,), (r,)),
        "sched": ShardedObject("sched", None if zero else {"lr": 0.5, "step": step}, (1,), (0,), r),
        "step": step,
        "cfg": {"name": "run", "sizes": [1, 2, 3], "t": torch.arange(4) + step},
    }


def compare(got: Any, want: Any, path: str = "") -> List[str]:
    """Exact comparison of nested state (tensors bitwise); returns the differences."""
    if isinstance(want, ShardedTensor):
        want = want.data
    if isinstance(want, ShardedObject):
        want = want.data
    if isinstance(want, torch.Tensor):
        ok = isinstance(got, torch.Tensor) and bitwise_equal(got, want)
        return [] if ok else [f"{path}: {got!r} != {want!r}"]
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{path}: keys {sorted(got) if isinstance(got, dict) else got!r}"]
        return [p for k in want for p in compare(got[k], want[k], f"{path}.{k}")]
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{path}: {got!r}"]
        return [p for i, (a, b) in enumerate(zip(got, want)) for p in compare(a, b, f"{path}[{i}]")]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


def _outcome(fn: Callable[[], Any]) -> Outcome:
    try:
        return ("ok", fn())
    except Exception as e:
        return ("err", f"{type(e).__name__}: {e}")


def round_trip(backend: str, root: str) -> Dict[str, Any]:
    """Saves `state(1)`, loads it into zeroed tensors; reports differences and metadata."""
    spec = _setup(backend)
    ckpt = ckpt_dir(backend, root, "rt")
    dc.save(state(1), ckpt, sharded_strategy=spec)
    loaded = dc.load(state(1, zero=True), ckpt)
    meta = dc.load_tensors_metadata(ckpt)
    return {
        "problems": compare(loaded, state(1)),
        "common": dc.load_common_state_dict(ckpt),
        "tensors": {k: (tuple(v.global_shape), v.dtype) for k, v in meta.items()},
        "is_ckpt": dc.check_is_distributed_checkpoint(ckpt),
    }


def reshard(backend: str, root: str) -> Dict[str, Outcome]:
    """Saves rows/columns split; loads columns/rows split and whole replicated tensors."""
    spec = _setup(backend)
    ckpt = ckpt_dir(backend, root, "rs")
    r, w = dist.get_rank(), dist.get_world_size()
    g = _global("m", (8, 8), torch.float32, 0)
    dc.save({"m": _split("m", g, 0, False)}, ckpt, sharded_strategy=spec)
    columns = {"m": _split("m", g, 1, True)}
    whole = {"m": ShardedTensor.from_rank_offsets("m", torch.zeros(8, 8), replica_id=r)}
    want_cols = g.narrow(1, r * 8 // w, 8 // w)
    return {
        "columns": _outcome(lambda: bitwise_equal(dc.load(columns, ckpt)["m"], want_cols)),
        "whole": _outcome(lambda: bitwise_equal(dc.load(whole, ckpt)["m"], g)),
    }


# Saved: 'a' and 'b' split, the object 'o' replicated, the object 'p' one piece per rank;
# requested: 'a' on every rank and 'extra' on rank 1 only. So 'extra' is unexpected (on
# rank 1); 'b', 'o' and both pieces of 'p' are missing (in the checkpoint, asked by no rank).
STRICT_MISSING = {"b", "o/shard_0_1", "p/shard_0_2", "p/shard_1_2"}
STRICT_UNEXPECTED = {"extra"}


def _strict_state(zero: bool, with_extra: bool) -> Dict[str, Any]:
    r = dist.get_rank()
    sd: Dict[str, Any] = {"a": _split("a", _global("a", (4, 4), torch.float32, 0), 0, zero)}
    if not zero:
        sd["b"] = _split("b", _global("b", (4, 2), torch.float32, 0), 0, False)
        sd["o"] = ShardedObject("o", {"v": 1}, (1,), (0,), replica_id=r)
        sd["p"] = ShardedObject("p", {"rank": r}, (dist.get_world_size(),), (r,))
    if with_extra and r == 1:
        sd["extra"] = ShardedTensor.from_rank_offsets("extra", torch.zeros(3))
    return sd


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def strict_modes(backend: str, root: str) -> Dict[str, Dict[str, Any]]:
    """Loads one checkpoint under every StrictHandling mode; reports what each did."""
    spec = _setup(backend)
    ckpt = ckpt_dir(backend, root, "strict")
    dc.save(_strict_state(False, False), ckpt, sharded_strategy=spec)
    want_a = _strict_state(False, False)["a"].data
    records = _Records()
    logging.getLogger("dist_checkpointing").addHandler(records)
    out: Dict[str, Dict[str, Any]] = {}
    try:
        for mode in StrictHandling:
            records.messages.clear()
            res = _outcome(lambda m=mode: dc.load(_strict_state(True, True), ckpt, strict=m))
            entry: Dict[str, Any] = {"error": res[1] if res[0] == "err" else None}
            if res[0] == "ok":
                value = res[1]
                sd, missing, unexpected = value if isinstance(value, tuple) else (value, None, None)
                entry.update(
                    keys=set(sd),
                    a_ok=bitwise_equal(sd["a"], want_a),
                    missing=missing,
                    unexpected=unexpected,
                    returned_tuple=isinstance(value, tuple),
                )
            entry["logged"] = " ".join(records.messages)
            out[mode.name] = entry
    finally:
        logging.getLogger("dist_checkpointing").removeHandler(records)
    return out


def _delete_rank1_data(backend: str, root: str, name: str) -> List[str]:
    files = glob.glob(RANK1_DATA[backend].format(root=root, name=name))
    if dist.get_rank() == 1:
        for f in files:
            os.remove(f)
    dist.barrier()
    return files


def _corrupt_rank1_data(backend: str, root: str, name: str) -> List[str]:
    files = glob.glob(RANK1_DATA[backend].format(root=root, name=name))
    if dist.get_rank() == 1:
        for f in files:
            with open(f, "r+b") as fh:
                size = os.path.getsize(f)
                for pos in range(0, size, max(1, size // 64)):
                    fh.seek(pos)
                    byte = fh.read(1)
                    fh.seek(pos)
                    fh.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    return files


def errors_everywhere(backend: str, root: str) -> Dict[str, Outcome]:
    """Failures that start on one rank (rank 1); each must raise on every rank."""
    spec = _setup(backend)
    r, w = dist.get_rank(), dist.get_world_size()
    out: Dict[str, Outcome] = {}
    g = _global("a", (4, 4), torch.float32, 0)

    def good() -> Dict[str, Any]:
        return {"a": _split("a", g, 0, False), "step": 3}

    for name in ("base", "gone", "flipped"):
        dc.save(good(), ckpt_dir(backend, root, name), sharded_strategy=spec)
    base = ckpt_dir(backend, root, "base")

    def unknown_key() -> Any:
        sd = {"a": _split("a", g, 0, True)}
        if r == 1:
            sd["nope"] = ShardedTensor.from_rank_offsets("nope", torch.zeros(2))
        return dc.load(sd, base)

    def bad_sharding() -> Any:
        shape = (4, 4) if r == 0 else (4, 5)  # rank 1 disagrees on the global shape
        bad = ShardedTensor.from_rank_offsets("a", torch.zeros(shape[0] // w, shape[1]), (0, r, w))
        return dc.save({"a": bad}, ckpt_dir(backend, root, "bad"), sharded_strategy=spec)

    out["unknown_key"] = _outcome(unknown_key)
    out["bad_sharding"] = _outcome(bad_sharding)
    out["overwrite"] = _outcome(lambda: dc.save(good(), base, sharded_strategy=spec))
    out["files_deleted"] = ("ok", _delete_rank1_data(backend, root, "gone"))
    out["missing_file"] = _outcome(
        lambda: dc.load({"a": _split("a", g, 0, True)}, ckpt_dir(backend, root, "gone"))
    )
    out["files_corrupted"] = ("ok", _corrupt_rank1_data(backend, root, "flipped"))
    out["corrupted_file"] = _outcome(
        lambda: dc.load({"a": _split("a", g, 0, True)}, ckpt_dir(backend, root, "flipped"))
    )
    # the world is still usable: a good load after all the failures
    out["after"] = _outcome(lambda: bitwise_equal(dc.load(good(), base)["a"], good()["a"].data))
    return out


def async_equivalence(backend: str, root: str) -> Dict[str, Any]:
    """Sync save vs async save + finalize of the same state; the caller's tensors are changed
    right after the async `save()` returns (what is written is the state at save time)."""
    spec = _setup(backend)
    dc.save(state(2), ckpt_dir(backend, root, "sync"), sharded_strategy=spec)
    queue = AsyncCallsQueue(persistent=False)
    try:
        live = state(2)
        request = dc.save(
            live, ckpt_dir(backend, root, "async"), sharded_strategy=spec, async_sharded_save=True
        )
        assert request is not None
        for leaf in [live["model"]["fp32"], *live["opt"]]:
            leaf.data.fill_(7)
        queue.schedule_async_request(request)
        committed_early = dc.check_is_distributed_checkpoint(ckpt_dir(backend, root, "async"))
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    loaded = {
        which: dc.load(state(2, zero=True), ckpt_dir(backend, root, which))
        for which in ("sync", "async")
    }
    return {
        "problems": compare(loaded["async"], loaded["sync"]) + compare(loaded["sync"], state(2)),
        "committed_early": committed_early,
    }
