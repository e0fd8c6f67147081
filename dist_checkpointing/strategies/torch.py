"""The 'torch_dist' backend, version 1 (PyTorch DCP's on-disk format): its public import path.

The implementation lives in the `torch_dist` package (see its docstring for who does what);
this module keeps the names users import from `dist_checkpointing.strategies.torch`.
"""

from .torch_dist import (
    BACKEND,
    SUPPORTED_VERSIONS,
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    register_default_torch_strategies,
)

__all__ = [
    "BACKEND",
    "SUPPORTED_VERSIONS",
    "TorchDistSaveShardedStrategy",
    "TorchDistLoadShardedStrategy",
    "register_default_torch_strategies",
]
