"""What the `dist-ckpt` command does, as functions for scripts (no process group needed).

- `list_checkpoints(root)` and `describe(path)`: what is there (`dist-ckpt ls` / `inspect`);
- `verify_checkpoint(path)`: read every byte, check every checksum (`dist-ckpt verify`);
- `convert_checkpoint(src, out, to=...)`: full tensors as safetensors or torch files;
- `diff_checkpoints(a, b)`: keys, shapes, dtypes and values that differ;
- `export_hf(ckpt, out)` / `import_hf(hf_dir, ckpt, tp=...)`: megatron-core GPTModel
  checkpoints to and from HuggingFace Llama / Mixtral (`dist-ckpt export-hf` / `import-hf`).

Names are imported on first use, so the torch-free paths of `ls` and `inspect` stay torch-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict

_EXPORTS: Dict[str, str] = {
    **dict.fromkeys(("CheckpointInfo", "describe"), "inspect"),
    "list_checkpoints": "listing",
    **dict.fromkeys(("VerifyReport", "verify_checkpoint"), "verify"),
    **dict.fromkeys(("ConvertResult", "convert_checkpoint"), "convert"),
    **dict.fromkeys(("DiffReport", "diff_checkpoints"), "diff"),
    **dict.fromkeys(("export_hf", "import_hf"), "hf"),
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from .convert import ConvertResult, convert_checkpoint  # noqa: F401  (in __all__)
    from .diff import DiffReport, diff_checkpoints  # noqa: F401  (in __all__)
    from .hf import export_hf, import_hf  # noqa: F401  (in __all__)
    from .inspect import CheckpointInfo, describe  # noqa: F401  (in __all__)
    from .listing import list_checkpoints  # noqa: F401  (in __all__)
    from .verify import VerifyReport, verify_checkpoint  # noqa: F401  (in __all__)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
