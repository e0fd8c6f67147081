"""dist_checkpointing: fast, safe, reshardable checkpoints of sharded PyTorch training state.

The public API mirrors megatron-core's `dist_checkpointing`. Names are imported on first
use (PEP 562), so `import dist_checkpointing` alone does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict, List

__version__ = "0.1.0"

_EXPORTS: Dict[str, str] = {
    "save": "serialization",
    "load": "serialization",
    "load_common_state_dict": "serialization",
    "load_tensors_metadata": "serialization",
    "load_sharded_metadata": "serialization",
    "load_plain_tensors": "serialization",
    "load_content_metadata": "serialization",
    "remove_sharded_tensors": "serialization",
    "check_is_distributed_checkpoint": "core",
    "ShardedTensor": "mapping",
    "ShardedObject": "mapping",
    "ShardedTensorFactory": "mapping",
    "LocalNonpersistentObject": "mapping",
    "StrictHandling": "validation",
    "CheckpointingException": "errors",
    "CheckpointManager": "manager",
    "CheckpointManagerOptions": "manager",
    "set_collective_timeout": "_dist",
    "get_collective_timeout": "_dist",
}

__all__ = [
    "save",
    "load",
    "load_common_state_dict",
    "load_tensors_metadata",
    "load_sharded_metadata",
    "load_plain_tensors",
    "load_content_metadata",
    "remove_sharded_tensors",
    "check_is_distributed_checkpoint",
    "ShardedTensor",
    "ShardedObject",
    "ShardedTensorFactory",
    "LocalNonpersistentObject",
    "StrictHandling",
    "CheckpointingException",
    "CheckpointManager",
    "CheckpointManagerOptions",
    "set_collective_timeout",
    "get_collective_timeout",
]

if TYPE_CHECKING:
    from ._dist import get_collective_timeout, set_collective_timeout
    from .core import check_is_distributed_checkpoint
    from .errors import CheckpointingException
    from .manager import CheckpointManager, CheckpointManagerOptions
    from .mapping import (
        LocalNonpersistentObject,
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )
    from .serialization import (
        load,
        load_common_state_dict,
        load_content_metadata,
        load_plain_tensors,
        load_sharded_metadata,
        load_tensors_metadata,
        remove_sharded_tensors,
        save,
    )
    from .validation import StrictHandling


def __getattr__(name: str) -> Any:
    """Imports a public name's module on first access (and submodules by name)."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_EXPORTS))
