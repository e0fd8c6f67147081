"""Turning keys into paths safely: no key may read or write outside a checkpoint dir."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import CheckpointingException

__all__ = ["check_key_is_safe_relative_path", "safe_join"]


def check_key_is_safe_relative_path(key: str, what: str = "key") -> None:
    """Raises `CheckpointingException` unless `key` (named `what` in messages) is a safe
    relative path: non-empty, not absolute, no NUL or backslash, no empty/`.`/`..` part."""
    if not isinstance(key, str) or not key:
        raise CheckpointingException(f"Invalid {what} {key!r}: must be a non-empty string")
    if "\x00" in key or "\\" in key:
        raise CheckpointingException(f"Invalid {what} {key!r}: NUL and backslash are not allowed")
    if key.startswith("/") or os.path.isabs(key):
        raise CheckpointingException(f"Invalid {what} {key!r}: absolute paths are not allowed")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise CheckpointingException(
                f"Invalid {what} {key!r}: path components may not be empty, '.' or '..'"
            )


def safe_join(root: str | os.PathLike[str], key: str, suffix: str = "") -> Path:
    """Joins `key + suffix` under `root`; raises `CheckpointingException` if unsafe."""
    check_key_is_safe_relative_path(key)
    root_path = Path(root)
    path = root_path.joinpath(*key.split("/"))
    if suffix:
        path = path.with_name(path.name + suffix)
    resolved_root = root_path.resolve()
    if resolved_root not in path.resolve().parents:
        raise CheckpointingException(f"Key {key!r} resolves outside checkpoint dir {root}")
    return path
