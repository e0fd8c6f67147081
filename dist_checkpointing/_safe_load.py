"""`torch.load` with the package's safety rule: no arbitrary unpickling unless opted in.

Training state holds more than tensors (megatron's `args` Namespace, `io.BytesIO` extra
state, numpy RNG state), which `torch.load(weights_only=True)` refuses, so safe loads also
accept a reviewed allowlist. Each entry was reviewed for what the weights-only unpickler
does with it (GLOBAL, REDUCE, NEWOBJ, BUILD): none runs code of the pickle's choosing, since
every argument comes from the same restricted unpickler. Types unsafe with some arguments
(numpy object arrays, ndarray subclasses) are registered as checking functions under their
pickled names.
"""

from __future__ import annotations

import argparse
import enum
import functools
import io
import os
import pathlib
import pickle
import signal
import struct
import types
from typing import Any, BinaryIO, Callable, Iterable, List, Tuple, Union

import torch

from .errors import CheckpointCorruptedError, UnsafeCheckpointError

__all__ = [
    "torch_load",
    "UNSAFE_LOAD_HINT",
    "default_safe_globals",
    "ensure_registered",
    "enum_member_getter",
]

SafeGlobal = Union[Callable[..., Any], Tuple[Any, str]]

# never accepted: 'O' holds Python object pointers, 'V' (structured) can embed 'O' fields
_REFUSED_KINDS = frozenset("OV")
# bool, ints, floats, complex, bytes, str, datetime, timedelta
_ACCEPTED_DTYPE_CHARS = "?bBhHiIlLqQefdgFDGSUMm"


def _refuse(what: str) -> pickle.UnpicklingError:
    # raised inside torch's unpickler, which reports it as a refused weights-only load
    return pickle.UnpicklingError(f"refused {what} (not in dist_checkpointing's safe allowlist)")


def enum_member_getter(allowed: Iterable[Any]) -> Callable[[Any, Any], Any]:
    """What a restricted unpickler gives for `builtins.getattr`: only members of the enums
    among `allowed`, by name.

    Python 3.12 (and some 3.11 releases) pickle an Enum member as `getattr(EnumClass, name)`
    instead of `EnumClass(value)`, so DCP's `.metadata` written there holds `builtins.getattr`;
    an unrestricted `getattr` would reach any attribute of an allowed class.
    """
    enums = {c for c in allowed if isinstance(c, type) and issubclass(c, enum.Enum)}

    def member(cls: Any, name: Any) -> Any:
        if cls in enums and isinstance(name, str) and name in cls.__members__:
            return cls[name]
        raise UnsafeCheckpointError(
            f"refusing to unpickle getattr({getattr(cls, '__name__', type(cls).__name__)}, "
            f"{name!r}): only members of allowed enums"
        )

    return member


def _numpy_entries() -> List[SafeGlobal]:
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # numpy 2 moved numpy.core to numpy._core
    multiarray = core.multiarray

    def checked_dtype(obj: Any, align: bool = False, copy: bool = False) -> Any:
        # a dtype pickles as numpy.dtype('<char><size>', align, copy): only accepted kinds
        # pass, so no object dtype can be made
        if not isinstance(obj, str):
            raise _refuse(f"numpy.dtype({type(obj).__name__})")
        dtype = np.dtype(obj, bool(align), bool(copy))
        if dtype.kind in _REFUSED_KINDS or dtype.hasobject:
            raise _refuse(f"numpy dtype {obj!r} (object or structured)")
        return dtype

    def checked_reconstruct(subtype: Any, shape: Any, dtype: Any) -> Any:
        # only ndarray itself: a subclass would run its Python __array_finalize__
        if subtype is not np.ndarray:
            raise _refuse(f"numpy array of type {getattr(subtype, '__name__', subtype)!r}")
        return multiarray._reconstruct(subtype, shape, dtype)

    def checked_scalar(dtype: Any, obj: Any = b"") -> Any:
        # raw bytes only (an object argument is for object dtypes, never made here)
        if not isinstance(dtype, np.dtype) or dtype.hasobject or not isinstance(obj, bytes):
            raise _refuse("numpy scalar that is not raw bytes of a plain dtype")
        return multiarray.scalar(dtype, obj)

    entries: List[SafeGlobal] = []
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):  # numpy 1 and 2 names
        entries.append((checked_reconstruct, f"{module}._reconstruct"))
        entries.append((checked_scalar, f"{module}.scalar"))
    entries.append((checked_dtype, "numpy.dtype"))
    # ndarray's __new__ and __setstate__ are C code copying bytes
    entries.append(np.ndarray)
    # dtype classes: BUILD calls the C dtype.__setstate__ (fields only for 'V', refused)
    entries += [type(np.dtype(c)) for c in _ACCEPTED_DTYPE_CHARS]
    return entries


def _allowed_enum_member(cls: Any, name: Any) -> Any:
    allowed = [g for g in torch.serialization.get_safe_globals() if not isinstance(g, tuple)]
    try:
        return enum_member_getter(allowed)(cls, name)
    except UnsafeCheckpointError as e:
        raise _refuse(str(e).replace("refusing to unpickle ", "")) from None


@functools.cache  # the same entries each time: the allowlist compares them by identity
def default_safe_globals() -> List[SafeGlobal]:
    """The reviewed entries, in `torch.serialization.add_safe_globals` form."""
    return [
        # __new__ and __setstate__ are C, with already-unpickled values: no Python code runs
        io.BytesIO,
        # object.__new__ and __dict__.update (megatron keeps `args` in the common state)
        argparse.Namespace,
        # REDUCE: SimpleNamespace() (C); BUILD: __dict__.update, as above
        types.SimpleNamespace,
        # REDUCE: PosixPath(*parts), pure string handling; nothing touches the file system
        pathlib.PosixPath,
        # REDUCE: Signals(number), an enum value lookup (megatron's args.exit_signal)
        signal.Signals,
        # GLOBAL signal.SIGTERM: how Python 3.11.2 pickles a member of this global enum
        *[(member, f"signal.{member.name}") for member in signal.Signals],
        # REDUCE: getattr(EnumClass, name), as Python 3.12 pickles an Enum member: only
        # members of enums on torch's allowlist (e.g. Signals above), by name
        (_allowed_enum_member, "builtins.getattr"),
        *_numpy_entries(),
    ]


def ensure_registered() -> None:
    """Adds the reviewed entries missing from torch's allowlist (before every safe load, in
    case user code called `torch.serialization.clear_safe_globals()`)."""
    present = set(torch.serialization.get_safe_globals())
    missing = [e for e in default_safe_globals() if e not in present]
    if missing:
        torch.serialization.add_safe_globals(missing)


UNSAFE_LOAD_HINT = (
    "Only tensors, plain Python values and the reviewed types of dist_checkpointing's safe "
    "allowlist (io.BytesIO, argparse.Namespace, numpy arrays, dtypes and scalars, ...) load "
    "by default. For a trusted checkpoint, allowlist "
    "the class with torch.serialization.add_safe_globals([...]) or opt in to full unpickling "
    "with weights_only=False on the load strategy (e.g. TorchCommonLoadStrategy(weights_only=False))."
)


def _refusal_reason(message: str) -> str:
    """The line of torch's long weights-only message that says what was refused."""
    if "WeightsUnpickler error:" in message:
        rest = message.split("WeightsUnpickler error:", 1)[1].strip()
        if rest:
            return rest.split("\n\n", 1)[0].strip()
    lines = message.strip().splitlines()
    return lines[0] if lines else ""


def torch_load(
    source: Union[str, os.PathLike[str], BinaryIO, io.BytesIO], what: str, weights_only: bool = True
) -> Any:
    """Loads a `torch.save` payload (named `what`) onto the CPU; raises `UnsafeCheckpointError`
    outside the allowlist (unless not `weights_only`), else `CheckpointCorruptedError`."""
    if weights_only:
        ensure_registered()
    try:
        return torch.load(source, map_location="cpu", weights_only=weights_only)
    except FileNotFoundError as e:
        raise CheckpointCorruptedError(f"{what}: file not found") from e
    except pickle.UnpicklingError as e:
        if weights_only and "Weights only load failed" in str(e):
            raise UnsafeCheckpointError(
                f"{what}: refused to unpickle ({_refusal_reason(str(e))}). {UNSAFE_LOAD_HINT}"
            ) from e
        raise CheckpointCorruptedError(f"{what}: malformed pickle: {e}") from e
    except (
        RuntimeError,
        struct.error,  # legacy (non-zip) format: a few bytes that are not a header
        EOFError,
        ValueError,
        OSError,
        AttributeError,
        ImportError,
        TypeError,
        KeyError,
        IndexError,
    ) as e:
        raise CheckpointCorruptedError(f"{what}: cannot be loaded ({type(e).__name__}: {e})") from e
