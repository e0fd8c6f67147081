"""`describe` one checkpoint directory (no process group); `list_checkpoints` is in `listing`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, Optional

from ..core import CONFIG_FNAME, maybe_load_config
from ..errors import CheckpointingException, NotACheckpointError
from ..manager.layout import parse_step
from . import _info, _storage
from ._info import CheckpointInfo, ChecksumCoverage, PathArg, TensorInfo
from ._local_info import fill_local, local_parts, local_tier, tier_step
from ._storage import read_local_part
from .listing import list_checkpoints

__all__ = ["TensorInfo", "ChecksumCoverage", "CheckpointInfo", "describe", "list_checkpoints"]


def describe(path: PathArg, deep: bool = True, step: Optional[int] = None) -> CheckpointInfo:
    """Describes a checkpoint directory. Not collective; reads no tensor data.

    Args:
        path: the checkpoint directory, or a manager's local tier (`<local_root>/<session_id>`).
        deep: also read common values, small objects and local parts (False: for listings).
        step: which iteration of a local tier (default: the newest complete one).

    Returns:
        A `CheckpointInfo`; an incomplete or damaged checkpoint has `complete=False` and its
        `problem` (not raised).

    Raises:
        NotACheckpointError: `path` is no directory, holds no checkpoint files, or `step` is
            given for anything but a local tier holding it.
    """
    ckpt = Path(path)
    _info.check_dir(ckpt)
    has_dcp = _info.is_file(ckpt / _storage.DCP_METADATA_FNAME)
    info = CheckpointInfo(str(ckpt), "unusable", False, parse_step(ckpt.name), None, 0, "")
    try:
        config = maybe_load_config(ckpt)
    except CheckpointingException as e:
        info.size, info.date = _info.disk_size(ckpt), _info.date_of(ckpt)
        info.problem = f"damaged {CONFIG_FNAME}: {e}"
        return info
    tier = local_tier(ckpt) if config is None else {}
    if tier:
        info = tier_step(ckpt, tier, step)
        if info.complete:
            parts = local_parts(ckpt, info.step)
            _fill_or_explain(info, lambda: fill_local(info, parts, read_local_part, deep))
        return info
    if step is not None:
        raise NotACheckpointError(f"{ckpt}: step={step} selects an iteration of a local tier")
    if config is None and not _info.is_stock_dcp(ckpt):
        if not _info.has_checkpoint_files(ckpt) and info.step is None:
            found = [Path(i.path).relative_to(ckpt) for i in list_checkpoints(ckpt)]
            raise NotACheckpointError(
                f"{ckpt}: not a checkpoint but a directory of {len(found)} checkpoint(s) (e.g. "
                f"{found[0]}); list them with `dist-ckpt ls {ckpt}`"
                if found
                else f"{ckpt}: not a checkpoint (no checkpoint files in it or below)"
            )
        return _info.incomplete(ckpt, info.step)
    info.size = _info.disk_size(ckpt)
    if config is None:
        info.kind, info.backend = "dcp", "dcp"
        info.date = _info.date_of(ckpt / _storage.DCP_METADATA_FNAME)
    else:
        info.kind = config.sharded_backend
        info.backend = f"{config.sharded_backend} v{config.sharded_backend_version}"
        info.date = _info.date_of(ckpt / CONFIG_FNAME)
    if info.kind == "local":
        parts = local_parts(ckpt)
        _fill_or_explain(info, lambda: fill_local(info, parts, read_local_part, deep))
    elif has_dcp:
        _fill_or_explain(info, lambda: _describe_dcp(ckpt, info, deep))
    elif config is not None and config.sharded_backend not in _info.TOOLS_READ:
        info.complete = True  # committed; its contents are its backend's to read
        b, v = config.sharded_backend, config.sharded_backend_version
        info.note = _info.unreadable_backend(b, v, "ls and inspect")
    else:
        info.problem = f"backend {info.backend} has no {_storage.DCP_METADATA_FNAME}"
    return info


def _fill_or_explain(info: CheckpointInfo, fill: Callable[[], None]) -> None:
    """Runs `fill`: complete unless it raises (then `problem` says why)."""
    try:
        fill()
        info.complete = True
    except CheckpointingException as e:
        info.complete, info.problem = False, str(e)


def _describe_dcp(ckpt: Path, info: CheckpointInfo, deep: bool) -> None:
    checksums = _storage.maybe_checksums(ckpt)
    metadata = _storage.read_dcp_metadata(ckpt, checksums)

    def read(key: str, storage: Any) -> str:
        try:
            return _info.short_repr(_storage.read_object(ckpt, metadata, key, checksums))
        except CheckpointingException as e:
            return f"<unreadable: {e}>"

    def common() -> Dict[Any, Any]:
        from ..serialization import load_common_state_dict

        return load_common_state_dict(ckpt)

    covered = None if checksums is None else lambda f, o: o in (checksums.item_sums(f) or {})
    files = sorted(checksums.files) if checksums is not None else []
    common_read = common if deep and _info.is_file(ckpt / _storage.COMMON_FNAME) else None
    has_common = _info.is_file(ckpt / _storage.COMMON_FNAME)
    _info.fill_dcp(info, metadata, covered, files, read if deep else None, common_read, has_common)
