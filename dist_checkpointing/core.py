"""`metadata.json`: the commit marker of a checkpoint, naming the strategies that read it.

A directory is a complete checkpoint exactly when it holds a valid `metadata.json`, or when
it is a checkpoint written by stock PyTorch DCP (`torch.distributed.checkpoint.save`): DCP
writes its `.metadata` last, and none of the files our saves write are there.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Union

from .errors import CheckpointCorruptedError, CheckpointingException
from .storage import objstore
from .storage.fileio import atomic_write, read_capped

__all__ = [
    "CONFIG_FNAME",
    "CheckpointingConfig",
    "CheckpointingException",
    "STOCK_DCP_CONFIG",
    "check_is_distributed_checkpoint",
    "is_stock_dcp_checkpoint",
    "maybe_load_config",
    "save_config",
]

logger = logging.getLogger(__name__)

CONFIG_FNAME = "metadata.json"
#: DCP's metadata file, written last by `torch.distributed.checkpoint.save`
DCP_METADATA_FNAME = ".metadata"
#: files our saves write before their commit: with any of them, a directory holding a
#: `.metadata` but no `metadata.json` is a save of ours that did not finish, not a DCP one
_OUR_FILES = (CONFIG_FNAME, "common.pt", "checksums.json", ".metadata.index", "claim.json")
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


#: How a stock DCP checkpoint is read: tensors by the torch_dist loader (DCP's format), the
#: non-tensor values (DCP's byte items) by the ('dcp', 1) common strategy.
STOCK_DCP_CONFIG = CheckpointingConfig("torch_dist", 1, "dcp", 1)


#: how a pickled DCP `Metadata` starts: a pickle protocol mark, then (within its first
#: bytes) the module and name of its class
_DCP_PICKLE_HEAD = 256
_DCP_METADATA_CLASS = (b"torch.distributed.checkpoint.metadata", b"Metadata")


def _head(path: Path, n: int) -> bytes:
    if objstore.split(path) is not None:
        return objstore.read_object(path, n - 1) or b""
    with open(path, "rb") as f:
        return f.read(n)


def is_stock_dcp_checkpoint(checkpoint_dir: PathArg) -> bool:
    """Whether `checkpoint_dir` is a checkpoint written by `torch.distributed.checkpoint.save`:
    it holds DCP's `.metadata` (which DCP writes last, by a rename), starting as a pickled
    DCP `Metadata` does, and none of the files our saves write. The rest of `.metadata` is
    checked when it is read (damage raises `CheckpointCorruptedError` then)."""
    ckpt = Path(checkpoint_dir)
    try:
        if not objstore.is_file(ckpt / DCP_METADATA_FNAME):
            return False
        if any(objstore.exists(ckpt / name) for name in _OUR_FILES):
            return False
        head = _head(ckpt / DCP_METADATA_FNAME, _DCP_PICKLE_HEAD)
        return head[:1] == b"\x80" and all(part in head for part in _DCP_METADATA_CLASS)
    except (OSError, CheckpointingException) as e:
        logger.debug("%s: cannot tell whether it is a DCP checkpoint: %s", checkpoint_dir, e)
        return False


def check_is_distributed_checkpoint(checkpoint_dir: PathArg) -> bool:
    """Whether `checkpoint_dir` holds a complete checkpoint: a valid `metadata.json`, or a
    checkpoint written by stock PyTorch DCP (`is_stock_dcp_checkpoint`).

    Never raises for a missing, partial or corrupted directory: it returns False.
    """
    try:
        if maybe_load_config(checkpoint_dir) is not None:
            return True
    except CheckpointingException as e:
        logger.debug("%s is not a valid checkpoint: %s", checkpoint_dir, e)
        return False
    return is_stock_dcp_checkpoint(checkpoint_dir)


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
