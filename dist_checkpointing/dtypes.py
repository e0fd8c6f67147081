"""Which dtype conversions a load may make silently: exact ones (every stored value kept,
e.g. float16 -> float32); lossy ones raise `LossyDtypeConversionError` unless opted in with
`allow_lossy_dtype_conversion=True` (on `load` or `TorchDistLoadShardedStrategy`).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Dict, FrozenSet, Iterator

import torch

from .errors import LossyDtypeConversionError

__all__ = ["is_exact_conversion", "check_dtype_conversion", "lossy_conversion_allowed"]

_F8 = [
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
]
_FLOAT_EXACT_FROM_F8 = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_U16, _U32 = getattr(torch, "uint16", None), getattr(torch, "uint32", None)

#: stored dtype -> requested dtypes that hold every stored value exactly
_EXACT: Dict[torch.dtype, FrozenSet[torch.dtype]] = {
    torch.bool: frozenset(
        {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
        | {torch.float16, torch.bfloat16, torch.float32, torch.float64}
    ),
    torch.uint8: frozenset(
        {torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16}
        | {torch.float32, torch.float64}
    ),
    torch.int8: frozenset(
        {torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16}
        | {torch.float32, torch.float64}
    ),
    torch.int16: frozenset({torch.int32, torch.int64, torch.float32, torch.float64}),
    torch.int32: frozenset({torch.int64, torch.float64}),
    torch.float16: frozenset({torch.float32, torch.float64, torch.complex64, torch.complex128}),
    torch.bfloat16: frozenset({torch.float32, torch.float64, torch.complex64, torch.complex128}),
    torch.float32: frozenset({torch.float64, torch.complex64, torch.complex128}),
    torch.float64: frozenset({torch.complex128}),
    torch.complex64: frozenset({torch.complex128}),
}
for _f8 in _F8:
    _EXACT[_f8] = frozenset(_FLOAT_EXACT_FROM_F8)
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
    exact, True when lossy and allowed (by `allow_lossy` or the load-wide opt-in), else
    raises `LossyDtypeConversionError`."""
    if is_exact_conversion(stored, requested):
        return False
    if allow_lossy or _allow_lossy.get():
        return True
    raise LossyDtypeConversionError(
        f"{key!r} is stored as {stored} and requested as {requested}: converting would lose "
        f"values. Request {stored} (or a dtype that holds it exactly) and convert yourself, "
        "or pass allow_lossy_dtype_conversion=True to load() (or to "
        "TorchDistLoadShardedStrategy) to convert anyway"
    )
