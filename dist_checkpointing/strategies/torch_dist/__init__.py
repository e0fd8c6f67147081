"""The 'torch_dist' backend, version 1: sharded tensors in PyTorch DCP's on-disk format.

Who does what:
    plan: what to write and read, names.
    zipformat: the torch.save-compatible zip layout of a tensor item (only here).
    metadata_file: DCP's `.metadata` and its load index, written atomically, read safely;
        `remove_sharded_tensors`.
    writer: data files laid out and written (streamed or from staged images).
    reader, chunk_reader: stored chunks read once each, straight into destinations, verified.
    save: the save strategy (sync writes, async staging).
    finalize: each rank's compact report; rank 0 builds and writes `.metadata` from them.
    load: the load strategy (resharding reads).
File I/O goes through the shared I/O layer, `dist_checkpointing.storage`.
"""

from ..base import StrategyAction, register_default_strategy
from .load import TorchDistLoadShardedStrategy
from .plan import BACKEND, SUPPORTED_VERSIONS
from .save import TorchDistSaveShardedStrategy

__all__ = [
    "BACKEND",
    "SUPPORTED_VERSIONS",
    "TorchDistSaveShardedStrategy",
    "TorchDistLoadShardedStrategy",
    "register_default_torch_strategies",
]


def register_default_torch_strategies() -> None:
    """Registers ('torch_dist', 1) for SAVE_SHARDED and LOAD_SHARDED."""
    register_default_strategy(
        StrategyAction.LOAD_SHARDED, BACKEND, 1, TorchDistLoadShardedStrategy()
    )
    register_default_strategy(
        StrategyAction.SAVE_SHARDED, BACKEND, 1, TorchDistSaveShardedStrategy(BACKEND, 1)
    )
