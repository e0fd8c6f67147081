"""The reviewed allowlist of non-tensor types that safe loads accept by default.

Real training state holds more than tensors: megatron-core keeps `args` (an
`argparse.Namespace`) in the common state, stores extra state as `io.BytesIO`, and saves
the RNG states of `random`, numpy and torch. `torch.load(weights_only=True)` refuses most of
these, so a checkpoint of an ordinary job would not load without opting in to full
unpickling, which runs any code a pickle names.

Each entry below was reviewed on its own: what the weights-only unpickler does with it
(`GLOBAL` looks it up, `REDUCE` calls it, `NEWOBJ` calls its `__new__`, `BUILD` calls its
`__setstate__` or updates its `__dict__`) and why none of that can run code of the
pickle's choosing. Every argument such a call receives was itself built by the same
restricted unpickler, so it is a primitive, a tensor, or another allowlisted type. Where a
type would be unsafe with some arguments (numpy's object arrays hold arbitrary Python
objects; an ndarray subclass runs its `__array_finalize__`), the entry is a checking
function registered under the type's pickled name, which refuses those arguments.

Not listed here, because they already load under `weights_only=True`: tensors
(`torch.get_rng_state()`), tuples, lists, dicts, ints, floats, strings, bytes, None
(`random.getstate()`), `collections.OrderedDict`, `torch.dtype`, `torch.Size`.

`ensure_registered()` adds the entries to `torch.serialization`'s process-wide allowlist
(missing ones only, on every safe load, so a user's `clear_safe_globals()` does not break
our loads). More types: `torch.serialization.add_safe_globals([...])`.
"""

from __future__ import annotations

import argparse
import io
import pathlib
import pickle
import signal
import types
from typing import Any, Callable, List, Tuple, Union

import torch

__all__ = ["default_safe_globals", "ensure_registered"]

SafeGlobal = Union[Callable[..., Any], Tuple[Callable[..., Any], str]]

# numpy dtype kinds never accepted: 'O' holds Python object pointers (an array of them
# is a container of arbitrary objects), 'V' (structured/void) can embed 'O' fields
_REFUSED_KINDS = frozenset("OV")
# every numpy dtype character whose kind is accepted (bool, ints, floats, complex, bytes,
# str, datetime, timedelta)
_ACCEPTED_DTYPE_CHARS = "?bBhHiIlLqQefdgFDGSUMm"


def _refuse(what: str) -> pickle.UnpicklingError:
    # raised inside torch's unpickler, which reports it as a refused weights-only load
    return pickle.UnpicklingError(f"refused {what} (not in dist_checkpointing's safe allowlist)")


def _numpy_entries() -> List[SafeGlobal]:
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # numpy 2 moved numpy.core to numpy._core
    multiarray = core.multiarray

    def checked_dtype(obj: Any, align: bool = False, copy: bool = False) -> Any:
        # numpy pickles a dtype as numpy.dtype('<char><size>', align, copy) plus a BUILD
        # with byte order (and, for 'V' only, fields); only strings of accepted kinds pass,
        # so no object dtype can be made (fields on non-'V' dtypes are ignored by numpy)
        if not isinstance(obj, str):
            raise _refuse(f"numpy.dtype({type(obj).__name__})")
        dtype = np.dtype(obj, bool(align), bool(copy))
        if dtype.kind in _REFUSED_KINDS or dtype.hasobject:
            raise _refuse(f"numpy dtype {obj!r} (object or structured)")
        return dtype

    def checked_reconstruct(subtype: Any, shape: Any, dtype: Any) -> Any:
        # C function that makes an empty array of `subtype`; BUILD then fills it with
        # ndarray.__setstate__ (C: copies raw bytes whose dtype went through checked_dtype).
        # Only ndarray itself: a subclass would run its Python __array_finalize__
        if subtype is not np.ndarray:
            raise _refuse(f"numpy array of type {getattr(subtype, '__name__', subtype)!r}")
        return multiarray._reconstruct(subtype, shape, dtype)

    def checked_scalar(dtype: Any, obj: Any = b"") -> Any:
        # C function that reads a scalar of `dtype` from raw bytes (from an object only for
        # object dtypes, which checked_dtype never makes)
        if not isinstance(dtype, np.dtype) or dtype.hasobject or not isinstance(obj, bytes):
            raise _refuse("numpy scalar that is not raw bytes of a plain dtype")
        return multiarray.scalar(dtype, obj)

    entries: List[SafeGlobal] = []
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):  # numpy 1 and 2 names
        entries.append((checked_reconstruct, f"{module}._reconstruct"))
        entries.append((checked_scalar, f"{module}.scalar"))
    entries.append((checked_dtype, "numpy.dtype"))
    # ndarray: GLOBAL (the subtype argument above) and BUILD (ndarray.__setstate__, C code
    # copying bytes into the array); NEWOBJ calls ndarray.__new__ (C) with restricted args
    entries.append(np.ndarray)
    # the concrete dtype classes: BUILD on a dtype checks its type is allowlisted, then
    # calls the C dtype.__setstate__ (byte order, and fields only for 'V', refused above)
    entries += [type(np.dtype(c)) for c in _ACCEPTED_DTYPE_CHARS]
    return entries


def default_safe_globals() -> List[SafeGlobal]:
    """The reviewed entries, in `torch.serialization.add_safe_globals` form.

    Returns:
        Types, and `(checking function, pickled name)` pairs for types accepted only with
        some arguments.
    """
    return [
        # NEWOBJ: BytesIO.__new__ (C); BUILD: BytesIO.__setstate__ (C), which copies a
        # bytes-like value, sets the position and updates the instance __dict__ with
        # already-unpickled values. No Python code runs.
        io.BytesIO,
        # NEWOBJ: object.__new__; BUILD: __dict__.update with already-unpickled values
        # (Namespace defines no __setstate__). Megatron keeps `args` in the common state.
        argparse.Namespace,
        # REDUCE: SimpleNamespace() (C); BUILD: __dict__.update, as above
        types.SimpleNamespace,
        # REDUCE: PosixPath(*parts), pure string handling; nothing touches the file system
        pathlib.PosixPath,
        # REDUCE: Signals(number), an enum value lookup (megatron's args.exit_signal)
        signal.Signals,
        *_numpy_entries(),
    ]


_entries: List[SafeGlobal] = []


def ensure_registered() -> None:
    """Adds the reviewed entries missing from torch's process-wide allowlist.

    Cheap (a set difference), called before every safe load: user code may have called
    `torch.serialization.clear_safe_globals()` since the last one.
    """
    if not _entries:
        _entries.extend(default_safe_globals())
    present = set(torch.serialization.get_safe_globals())
    missing = [e for e in _entries if e not in present]
    if missing:
        torch.serialization.add_safe_globals(missing)
