"""The checkpoint manager: when to save, how many to keep, which checkpoint to load.

See `CheckpointManager`; `layout` names the files under its root.
"""

from .checkpoint_manager import CheckpointManager, CheckpointManagerOptions, RestoreInfo

__all__ = ["CheckpointManager", "CheckpointManagerOptions", "RestoreInfo"]
