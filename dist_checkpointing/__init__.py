"""dist_checkpointing: fast, safe, reshardable checkpoints of sharded PyTorch training state.

The public API mirrors megatron-core's `dist_checkpointing`: build a sharded state dict of
`ShardedTensor`s / `ShardedObject`s and plain values, then `save` and `load` it on every
rank. Loading may use a different sharding than saving.
"""

from ._dist import get_collective_timeout, set_collective_timeout
from .core import check_is_distributed_checkpoint
from .errors import CheckpointingException
from .manager import CheckpointManager, CheckpointManagerOptions
from .mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor, ShardedTensorFactory
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

__version__ = "0.1.0"

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
