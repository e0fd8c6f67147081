"""Values real training state holds, and malicious payloads wrapped in each of them.

Shared by the safe-loading tests (module level so ranks of a test world can import them).
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import random
import signal
import types
from typing import Any, Callable, Dict

import numpy as np
import torch

MARKER_ENV = "DIST_CKPT_TEST_PWNED_MARKER"


def benign_values() -> Dict[str, Any]:
    """One value of every type the safe loader accepts by default."""
    py_random = random.Random(5)
    np_random = np.random.RandomState(7)
    return {
        "bytesio": io.BytesIO(b"extra state \x00\x01"),
        "random_state": py_random.getstate(),
        "numpy_rng_state": np_random.get_state(),
        "numpy_rng_dict": np_random.get_state(legacy=False),
        # what torch.get_rng_state() returns, the same on every rank
        "torch_rng_state": torch.Generator().manual_seed(11).get_state(),
        "namespace": argparse.Namespace(lr=0.1, name="gpt", layers=[1, 2], dtype=torch.bfloat16),
        "simple_namespace": types.SimpleNamespace(tp=2, pp=None),
        "numpy_array": np.arange(12, dtype=np.int16).reshape(3, 4),
        "numpy_fortran": np.asfortranarray(np.linspace(0, 1, 6).reshape(2, 3)),
        "numpy_strings": np.array(["ab", "c"]),
        "numpy_dtype": np.dtype("float32"),
        "numpy_float": np.float32(1.5),
        "numpy_int": np.int64(-3),
        "numpy_bool": np.bool_(True),
        "path": pathlib.PosixPath("/data/run/ckpt"),
        "signal": signal.SIGTERM,
    }


def same(a: Any, b: Any) -> bool:
    """Deep equality for the values above (arrays, tensors and BytesIO by content and type)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, io.BytesIO):
        return a.getvalue() == b.getvalue() and a.tell() == b.tell()
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (argparse.Namespace, types.SimpleNamespace)):
        return same(vars(a), vars(b))
    return bool(a == b)


class Evil:
    """Pickles as a call of os.system that creates the marker file named by MARKER_ENV."""

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {os.environ[MARKER_ENV]}",))


class _Reduce:
    """Pickles as `fn(*args)`: lets a test write what an attacker's pickle would hold."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> Any:
        return (self.fn, self.args)


def _bytesio_with_payload() -> io.BytesIO:
    b = io.BytesIO(b"x")
    b.payload = Evil()  # type: ignore[attr-defined]  # lands in BytesIO's pickled __dict__
    return b


def malicious_values() -> Dict[str, Any]:
    """Each accepted type wrapping a payload (or used with arguments the allowlist refuses)."""
    core = getattr(np, "_core", None) or np.core
    return {
        "bytesio": _bytesio_with_payload(),
        "random_state": (3, (Evil(),) * 3, None),
        "numpy_rng_state": ("MT19937", np.array([Evil()], dtype=object), 0, 0, 0.0),
        "torch_rng_state": [torch.get_rng_state(), Evil()],
        "namespace": argparse.Namespace(lr=Evil()),
        "simple_namespace": types.SimpleNamespace(x=Evil()),
        "numpy_object_array": np.array([Evil(), 1], dtype=object),
        "numpy_structured_object": np.array([(Evil(),)], dtype=[("o", object)]),
        "numpy_array_of_other_type": _Reduce(
            core.multiarray._reconstruct, argparse.Namespace, (0,), b"b"
        ),
        "numpy_dtype_from_object": _Reduce(np.dtype, Evil()),
        "numpy_scalar_from_object": _Reduce(core.multiarray.scalar, np.dtype("O"), Evil()),
        "path": _Reduce(pathlib.PosixPath, Evil()),
        "signal": _Reduce(signal.Signals, Evil()),
    }


def _state(values: Dict[str, Any], rank: int, world: int, with_data: bool) -> Dict[str, Any]:
    from dist_checkpointing import ShardedObject, ShardedTensor

    return {
        "w": ShardedTensor.from_rank_offsets(
            "w", torch.full((2,), float(rank)) if with_data else torch.empty(2), (0, rank, world)
        ),
        "objects": {
            k: ShardedObject(f"obj/{k}", v if with_data else None, (world,), (rank,))
            for k, v in values.items()
        },
        "common": dict(values),
    }


def save_and_load_values(root: str, backend: str) -> Dict[str, bool]:
    """Rank function: saves every benign value in common state and as this rank's
    ShardedObjects with `backend`, loads them back; returns {name: equal} per value."""
    import torch.distributed as dist

    import dist_checkpointing as dc

    rank, world = dist.get_rank(), dist.get_world_size()
    values = benign_values()
    dc.save(
        _state(values, rank, world, True),
        root,
        sharded_strategy=(backend, 2 if backend == "local" else 1),
    )
    loaded = dc.load(_state(values, rank, world, False), root)
    out = {}
    for k, v in values.items():
        out[f"common/{k}"] = same(loaded["common"][k], v)
        out[f"object/{k}"] = same(loaded["objects"][k], v)
    return out
