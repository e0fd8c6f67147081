"""`metadata.json`: the commit marker of a checkpoint, naming the strategies that read it.

A directory is a complete checkpoint exactly when it holds a valid `metadata.json`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Union

from .errors import CheckpointCorruptedError, CheckpointingException
from .storage.fileio import atomic_write, read_capped

__all__ = [
    "CONFIG_FNAME",
    "CheckpointingConfig",
    "CheckpointingException",
    "check_is_distributed_checkpoint",
    "maybe_load_config",
    "save_config",
]

logger = logging.getLogger(__name__)

CONFIG_FNAME = "metadata.json"
_MAX_CONFIG_BYTES = 1 << 20
PathArg = Union[str, "os.PathLike[str]"]


@dataclass
class CheckpointingConfig:
    """Contents of `metadata.json`: the `(backend, version)` of the sharded part (e.g.
    'torch_dist') and of the common part (e.g. 'torch') that wrote, and can read, a checkpoint.

    Raises:
        CheckpointCorruptedError: when a field has the wrong type or value.
    """

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: str = "torch"
    common_backend_version: int = 1

    def __post_init__(self) -> None:
        for name in ("sharded_backend", "common_backend"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise CheckpointCorruptedError(f"{name} must be a non-empty string: {value!r}")
        for name in ("sharded_backend_version", "common_backend_version"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointCorruptedError(f"{name} must be a positive int: {value!r}")

    @classmethod
    def from_dict(cls, data: Any, source: str = CONFIG_FNAME) -> CheckpointingConfig:
        """Builds a config from parsed JSON, ignoring unknown fields (newer writers).

        Raises:
            CheckpointCorruptedError: `data` is not an object, or a field is missing or bad.
        """
        if not isinstance(data, dict):
            raise CheckpointCorruptedError(
                f"{source}: expected a JSON object, got {type(data).__name__}"
            )
        if "sharded_backend" not in data:
            raise CheckpointCorruptedError(f"{source}: missing field 'sharded_backend'")
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        try:
            return cls(**known)
        except CheckpointCorruptedError as e:
            raise CheckpointCorruptedError(f"{source}: {e}") from e


def maybe_load_config(checkpoint_dir: PathArg) -> Optional[CheckpointingConfig]:
    """Reads `metadata.json` of a checkpoint (None when there is none).

    Raises:
        CheckpointCorruptedError: if `metadata.json` exists but is not a valid config.
    """
    path = Path(checkpoint_dir) / CONFIG_FNAME
    raw = read_capped(path, _MAX_CONFIG_BYTES)
    if raw is None:
        return None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointCorruptedError(f"{path} is not valid JSON: {e}") from e
    return CheckpointingConfig.from_dict(data, str(path))


def check_is_distributed_checkpoint(checkpoint_dir: PathArg) -> bool:
    """Whether `checkpoint_dir` holds a complete checkpoint (a valid `metadata.json`).

    Never raises for a missing, partial or corrupted directory: it returns False.
    """
    try:
        return maybe_load_config(checkpoint_dir) is not None
    except CheckpointingException as e:
        logger.debug("%s is not a valid checkpoint: %s", checkpoint_dir, e)
        return False


def save_config(config: CheckpointingConfig, checkpoint_dir: PathArg) -> None:
    """Writes `metadata.json` atomically (temp file, fsync, rename, fsync of the directory).

    This is the commit of a checkpoint: call it only once all data is durable. It first
    seals the checkpoint's `checksums.json`, when it has one, binding these exact bytes and a
    new save id (`seal`): the file keeps its four fields, which megatron-core reads.
    """
    from .seal import seal_record  # (seal builds on this module)

    payload = json.dumps(asdict(config), sort_keys=True).encode("utf-8")
    seal_record(checkpoint_dir, payload)
    atomic_write(Path(checkpoint_dir) / CONFIG_FNAME, lambda f: f.write(payload))
