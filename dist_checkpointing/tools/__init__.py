"""What the `dist-ckpt` command does, as functions for scripts (no process group needed).

- `list_checkpoints(root)` and `describe(path)`: what is there (`dist-ckpt ls` / `inspect`);
- `verify_checkpoint(path)`: read every byte, check every checksum (`dist-ckpt verify`);
- `convert_checkpoint(src, out, to=...)`: full tensors as safetensors or torch files;
- `diff_checkpoints(a, b)`: keys, shapes, dtypes and values that differ.
"""

from .convert import ConvertResult, convert_checkpoint
from .diff import DiffReport, diff_checkpoints
from .inspect import CheckpointInfo, describe, list_checkpoints
from .verify import VerifyReport, verify_checkpoint

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
