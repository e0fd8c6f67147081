"""The checkpoint manager: when to save, how many to keep, which checkpoint to load."""

from .checkpoint_manager import CheckpointManager, CheckpointManagerOptions, RestoreInfo

__all__ = ["CheckpointManager", "CheckpointManagerOptions", "RestoreInfo"]
