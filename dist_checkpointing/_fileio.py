"""Kept for imports of the old path: durable file writes live in `storage.fileio`."""

from .storage.fileio import atomic_write, fsync_dir, read_capped

__all__ = ["atomic_write", "fsync_dir", "read_capped"]
