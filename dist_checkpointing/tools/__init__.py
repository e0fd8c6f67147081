"""The `dist-ckpt` verbs as functions for scripts (no process group needed): `list_checkpoints`
(`ls`), `describe` (`inspect`), `verify_checkpoint`, `convert_checkpoint` (safetensors or torch
files), `diff_checkpoints`, and `export_hf` / `import_hf` (megatron-core GPTModel to and from
HuggingFace Llama / Mixtral). Imported on first use, so `ls` and `inspect` stay torch-free.
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
