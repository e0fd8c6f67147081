"""`torch.load` with the package's safety rule: no arbitrary unpickling unless opted in."""

from __future__ import annotations

import io
import os
import pickle
import struct
from typing import Any, BinaryIO, Union

import torch

from ._safe_globals import ensure_registered
from .errors import CheckpointCorruptedError, UnsafeCheckpointError

__all__ = ["torch_load", "UNSAFE_LOAD_HINT"]

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
