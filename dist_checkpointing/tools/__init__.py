"""What the `dist-ckpt` command does, as functions for scripts (no process group needed).

- `list_checkpoints(root)` and `describe(path)`: what is there (`dist-ckpt ls` / `inspect`);
- `verify_checkpoint(path)`: read every byte, check every checksum (`dist-ckpt verify`);
- `convert_checkpoint(src, out, to=...)`: full tensors as safetensors or torch files;
- `diff_checkpoints(a, b)`: keys, shapes, dtypes and values that differ.

Names are imported on first use, so the torch-free fast path of `inspect` stays torch-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict

_EXPORTS: Dict[str, str] = {
    "CheckpointInfo": "inspect",
    "describe": "inspect",
    "list_checkpoints": "inspect",
    "VerifyReport": "verify",
    "verify_checkpoint": "verify",
    "ConvertResult": "convert",
    "convert_checkpoint": "convert",
    "DiffReport": "diff",
    "diff_checkpoints": "diff",
}

__all__ = [
    "CheckpointInfo",
    "describe",
    "list_checkpoints",
    "VerifyReport",
    "verify_checkpoint",
    "ConvertResult",
    "convert_checkpoint",
    "DiffReport",
    "diff_checkpoints",
]

if TYPE_CHECKING:
    from .convert import ConvertResult, convert_checkpoint
    from .diff import DiffReport, diff_checkpoints
    from .inspect import CheckpointInfo, describe, list_checkpoints
    from .verify import VerifyReport, verify_checkpoint


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
