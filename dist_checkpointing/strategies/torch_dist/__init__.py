"""The 'torch_dist' backend, version 1: sharded tensors in PyTorch DCP's on-disk format.

`plan` decides what to write and read; `zipformat` is a tensor item's zip layout;
`metadata_file` reads and writes `.metadata` and its load index; `writer`, `reader` and
`chunk_reader` move the bytes (through `dist_checkpointing.storage`), `verify` checks them;
`save`, `finalize` and `load` are the strategies; `legacy_flat` reads megatron's flat layout.
"""

from ..base import StrategyAction, register_default_strategy
from .dcp_common import DCP_COMMON_BACKEND, DcpCommonLoadStrategy
from .load import TorchDistLoadShardedStrategy
from .plan import BACKEND, SUPPORTED_VERSIONS
from .save import TorchDistSaveShardedStrategy

__all__ = [
    "BACKEND",
    "SUPPORTED_VERSIONS",
    "TorchDistSaveShardedStrategy",
    "TorchDistLoadShardedStrategy",
    "DcpCommonLoadStrategy",
    "register_default_torch_strategies",
]


def register_default_torch_strategies() -> None:
    """Registers ('torch_dist', 1) for SAVE_SHARDED and LOAD_SHARDED, and ('dcp', 1) for
    LOAD_COMMON (the non-tensor values of a stock DCP checkpoint)."""
    register_default_strategy(
        StrategyAction.LOAD_SHARDED, BACKEND, 1, TorchDistLoadShardedStrategy()
    )
    register_default_strategy(
        StrategyAction.SAVE_SHARDED, BACKEND, 1, TorchDistSaveShardedStrategy(BACKEND, 1)
    )
    register_default_strategy(
        StrategyAction.LOAD_COMMON, DCP_COMMON_BACKEND, 1, DcpCommonLoadStrategy()
    )
