"""`torch.load` with the package's safety rule: no arbitrary unpickling unless opted in."""

from __future__ import annotations

import io
import os
import pickle
import struct
from typing import Any, BinaryIO, Union

import torch

from .errors import CheckpointCorruptedError, UnsafeCheckpointError

__all__ = ["torch_load", "UNSAFE_LOAD_HINT"]

UNSAFE_LOAD_HINT = (
    "Only tensors and allowlisted types load by default. For a trusted checkpoint, allowlist "
    "the class with torch.serialization.add_safe_globals([...]) or opt in to full unpickling "
    "with weights_only=False on the load strategy (e.g. TorchCommonLoadStrategy(weights_only=False))."
)


def torch_load(
    source: Union[str, os.PathLike[str], BinaryIO, io.BytesIO], what: str, weights_only: bool = True
) -> Any:
    """Loads a `torch.save` payload onto the CPU, translating failures.

    Args:
        source: a path or a binary stream.
        what: names the payload in error messages (path, key).
        weights_only: False allows arbitrary unpickling (trusted checkpoints only).

    Returns:
        The loaded object.

    Raises:
        UnsafeCheckpointError: the payload holds objects outside the safe allowlist.
        CheckpointCorruptedError: the payload is missing, truncated or malformed.
    """
    try:
        return torch.load(source, map_location="cpu", weights_only=weights_only)
    except FileNotFoundError as e:
        raise CheckpointCorruptedError(f"{what}: file not found") from e
    except pickle.UnpicklingError as e:
        if weights_only and "Weights only load failed" in str(e):
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise UnsafeCheckpointError(
                f"{what}: refused to unpickle ({first}). {UNSAFE_LOAD_HINT}"
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
