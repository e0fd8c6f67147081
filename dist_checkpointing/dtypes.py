"""Which dtype conversions a load makes: those exact for every value of the stored dtype
(float16 -> float32) at once; others value by value (`copy_exact`: int64 -> float32 of
integers below 2**24 loads, 2**24 + 1 raises `LossyDtypeConversionError`), unless opted in
with `allow_lossy_dtype_conversion=True` (on `load` or `TorchDistLoadShardedStrategy`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import Dict, FrozenSet, Iterator, Sequence

import torch

from .errors import LossyDtypeConversionError

logger = logging.getLogger(__name__)

__all__ = [
    "is_exact_conversion",
    "check_dtype_conversion",
    "copy_exact",
    "lossy_conversion_allowed",
]

_F8 = [
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
]
_REAL_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_FROM_BYTE = frozenset({torch.int16, torch.int32, torch.int64}) | _REAL_FLOATS
_U16, _U32 = getattr(torch, "uint16", None), getattr(torch, "uint32", None)

#: stored dtype -> requested dtypes that hold every stored value exactly
_EXACT: Dict[torch.dtype, FrozenSet[torch.dtype]] = {
    torch.bool: _FROM_BYTE | {torch.uint8, torch.int8},
    torch.uint8: _FROM_BYTE,
    torch.int8: _FROM_BYTE,
    torch.int16: frozenset({torch.int32, torch.int64, torch.float32, torch.float64}),
    torch.int32: frozenset({torch.int64, torch.float64}),
    torch.float16: frozenset({torch.float32, torch.float64, torch.complex64, torch.complex128}),
    torch.bfloat16: frozenset({torch.float32, torch.float64, torch.complex64, torch.complex128}),
    torch.float32: frozenset({torch.float64, torch.complex64, torch.complex128}),
    torch.float64: frozenset({torch.complex128}),
    torch.complex64: frozenset({torch.complex128}),
}
for _f8 in _F8:
    _EXACT[_f8] = _REAL_FLOATS
if _U16 is not None and _U32 is not None:
    _EXACT[_U16] = frozenset({_U32, torch.int32, torch.int64, torch.float32, torch.float64})
    _EXACT[_U32] = frozenset({torch.int64, torch.float64})

_allow_lossy: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "dist_checkpointing_allow_lossy", default=False
)


def is_exact_conversion(stored: torch.dtype, requested: torch.dtype) -> bool:
    """Whether every value of dtype `stored` converts to `requested` without change."""
    return stored == requested or requested in _EXACT.get(stored, frozenset())


@contextlib.contextmanager
def lossy_conversion_allowed(allow: bool) -> Iterator[None]:
    """Within the block (this thread), lossy conversions on load are allowed when `allow`."""
    token = _allow_lossy.set(allow or _allow_lossy.get())
    try:
        yield
    finally:
        _allow_lossy.reset(token)


def check_dtype_conversion(
    key: str, stored: torch.dtype, requested: torch.dtype, allow_lossy: bool = False
) -> bool:
    """Checks loading `key`, stored as `stored`, into a `requested` tensor: False when
    exact for every value of `stored` or lossy and allowed (by `allow_lossy` or the
    load-wide opt-in, with a warning): a plain copy; True when the load must go value by
    value (`copy_exact`)."""
    if is_exact_conversion(stored, requested):
        return False
    if allow_lossy or _allow_lossy.get():
        logger.warning(
            "%r is stored as %s and loaded as %s: lossy conversion (allowed by "
            "allow_lossy_dtype_conversion)",
            key,
            stored,
            requested,
        )
        return False
    return True


def copy_exact(key: str, dest: torch.Tensor, src: torch.Tensor, offset: Sequence[int]) -> None:
    """`dest.copy_(src)` (same shape) into another dtype, checked slice by slice (no second
    full copy).

    Raises:
        LossyDtypeConversionError: a value changes; names `key`, the first such value and
            its global index (`src` starts at global `offset`).
    """
    dest.copy_(src)
    flat_src = src.reshape(1) if src.dim() == 0 else src
    flat_dest = dest.reshape(1) if dest.dim() == 0 else dest
    step = max(1, (1 << 20) // max(1, flat_src[0].numel())) if len(flat_src) else 1
    for i in range(0, len(flat_src), step):  # about 1M values at a time
        s, d = flat_src[i : i + step], flat_dest[i : i + step]
        back = d.to(src.dtype)
        # the round trip catches rounding (2**24 + 1 -> float32), the comparison in the
        # common dtype catches wrapping (int8 -1 -> uint8 255 -> int8 -1); a NaN stays NaN
        changed = ((back != s) | (d != s)) & ~(s.isnan() & back.isnan())
        if not bool(changed.any()):
            continue
        j = int(changed.reshape(-1).nonzero()[0])
        at = torch.unravel_index(torch.tensor(i * s[0].numel() + j), tuple(src.shape))
        index = tuple(int(x) + o for x, o in zip(at, offset))
        raise LossyDtypeConversionError(
            f"{key!r} is stored as {src.dtype} and requested as {dest.dtype}: the value "
            f"{s.reshape(-1)[j].item()} at index {index} would become "
            f"{d.reshape(-1)[j].item()}. Request {src.dtype} (or a dtype that holds every "
            "value) and convert yourself, or pass allow_lossy_dtype_conversion=True to load() "
            "(or to TorchDistLoadShardedStrategy) to convert anyway"
        )
