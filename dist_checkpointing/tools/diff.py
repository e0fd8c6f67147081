"""`diff_checkpoints`: what differs between two DCP-format checkpoints. Not collective.
Keys, shapes and dtypes from the metadata, then values tensor by tensor (one tensor of each
in memory at a time), then the common state and objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

from ..core import maybe_load_config
from ..errors import CheckpointingException
from ..storage import objstore
from . import _storage
from ._info import PathArg
from .convert import _source

__all__ = ["DiffReport", "diff_checkpoints"]

_MCORE_COMMON_OBJECT = "common_state/"  # key prefix of megatron-core 0.17+ common state
_SLICE = 1 << 20


@dataclass
class DiffReport:
    """Differences between checkpoints A and B (empty lists: equal).

    Attributes:
        only_in_a / only_in_b: keys (tensors, objects, common values) present on one side.
        mismatched: `(key, description)` of shape or dtype differences.
        differing: `(key, largest absolute difference)` of tensors whose values differ
            beyond the tolerances (`nan` when NaNs differ; for booleans, 1.0).
        differing_values: keys of objects or common values that differ.
        tensors_compared: tensors compared by value.
    """

    only_in_a: List[str] = field(default_factory=list)
    only_in_b: List[str] = field(default_factory=list)
    mismatched: List[Tuple[str, str]] = field(default_factory=list)
    differing: List[Tuple[str, float]] = field(default_factory=list)
    differing_values: List[str] = field(default_factory=list)
    tensors_compared: int = 0

    @property
    def equal(self) -> bool:
        """No difference found."""
        found = (self.only_in_a, self.only_in_b, self.mismatched, self.differing)
        return not any(found) and not self.differing_values


def _max_difference(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> float:
    """The largest |a - b| where a and b are not close; 0.0 when all are close."""
    if a.dtype == torch.bool or not (a.is_floating_point() or a.is_complex()):
        if torch.equal(a, b):
            return 0.0
        if a.dtype == torch.bool:
            return 1.0
    fa, fb = a.reshape(-1), b.reshape(-1)
    worst = 0.0
    for i in range(0, fa.numel(), _SLICE):
        x, y = fa[i : i + _SLICE].to(torch.float64), fb[i : i + _SLICE].to(torch.float64)
        close = torch.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
        if bool(close.all()):
            continue
        gap = (x - y).abs()[~close]
        worst = max(worst, float("nan") if bool(gap.isnan().any()) else float(gap.max()))
    return worst


def _values_equal(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        both = isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        return both and x.shape == y.shape and x.dtype == y.dtype and bool(torch.equal(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_values_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(map(_values_equal, x, y))
    try:
        return bool(x == y)
    except Exception:  # objects whose == does not give a bool
        return repr(x) == repr(y)


def _values(ckpt: Path, metadata: Any, checksums: Any) -> Dict[str, Any]:
    """Common values and stored objects by key."""
    config = maybe_load_config(ckpt)
    has_common_file = objstore.exists(ckpt / _storage.COMMON_FNAME)
    keys = _storage.object_keys(metadata, ckpt)
    # megatron-core 0.17+ keep the common state in `common_state/` objects instead of
    # common.pt: compared as common values, so that their checkpoints and ours match
    common_objects = {k for k in keys if k.startswith(_MCORE_COMMON_OBJECT)}
    if config is None or has_common_file:
        common_objects = set()
    stored = [k for k in keys if k not in common_objects]
    out = {k: _storage.read_object(ckpt, metadata, k, checksums) for k in stored}
    if config is not None and (has_common_file or common_objects):
        from ..serialization import load_common_state_dict

        out.update({f"common:{k}": v for k, v in load_common_state_dict(ckpt).items()})
    return out


def diff_checkpoints(a: PathArg, b: PathArg, *, rtol: float = 0.0, atol: float = 0.0) -> DiffReport:
    """Compares two `torch_dist` or stock DCP checkpoint directories.

    Args:
        rtol, atol: relative and absolute tolerances for tensor values (as `torch.isclose`).

    Raises:
        NotACheckpointError: a path is missing or not a complete checkpoint.
        CheckpointCorruptedError: a damaged chunk.
        CheckpointingException: a checkpoint of another backend.
    """
    if rtol < 0 or atol < 0:
        raise CheckpointingException(f"tolerances must be >= 0, got rtol={rtol}, atol={atol}")
    pa, pb = Path(a), Path(b)
    (ma, sa), (mb, sb) = _source(pa, "diff"), _source(pb, "diff")
    report = DiffReport()
    ta, tb = _storage.tensor_entries(ma, pa), _storage.tensor_entries(mb, pb)
    va, vb = _values(pa, ma, sa), _values(pb, mb, sb)
    report.only_in_a = sorted((set(ta) - set(tb)) | (set(va) - set(vb)))
    report.only_in_b = sorted((set(tb) - set(ta)) | (set(vb) - set(va)))
    for key in sorted(set(ta) & set(tb)):
        xa, xb = ta[key], tb[key]
        shape_a, shape_b = tuple(xa.size), tuple(xb.size)
        dtype_a, dtype_b = xa.properties.dtype, xb.properties.dtype
        if shape_a != shape_b or dtype_a != dtype_b:
            report.mismatched.append((key, f"A {shape_a} {dtype_a} vs B {shape_b} {dtype_b}"))
            continue
        x = _storage.read_full_tensor(pa, ma, key, sa)
        y = _storage.read_full_tensor(pb, mb, key, sb)
        report.tensors_compared += 1
        worst = _max_difference(x, y, rtol, atol)
        if worst != 0.0:
            report.differing.append((key, worst))
        del x, y
    report.differing_values = sorted(
        k for k in set(va) & set(vb) if not _values_equal(va[k], vb[k])
    )
    return report
