"""`describe` one checkpoint directory and `list_checkpoints` under a root (no process group).

Recognised kinds:
- `torch_dist` (ours or megatron-core's): `metadata.json` + DCP's `.metadata` and data files;
- `dcp`: a stock PyTorch DCP checkpoint (`.metadata`, no `metadata.json`);
- `local`: a ('local', 1) checkpoint (`<dir>/<rank>/iter_..._local.pt` parts);
- `incomplete`: a directory with checkpoint files but no commit record (a crashed save).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List

from ..core import CONFIG_FNAME, maybe_load_config
from ..errors import CheckpointingException, NotACheckpointError
from ..integrity import CHECKSUMS_FNAME
from ..manager.layout import parse_step, read_latest
from ..storage import objstore
from . import _storage
from ._info import (
    SMALL_OBJECT,
    CheckpointInfo,
    ChecksumCoverage,
    LocalPart,
    PathArg,
    TensorInfo,
    check_dir,
    date_of,
    disk_size,
    fill_local,
    local_parts,
    short_repr,
)

__all__ = ["TensorInfo", "ChecksumCoverage", "CheckpointInfo", "describe", "list_checkpoints"]


def describe(path: PathArg, deep: bool = True) -> CheckpointInfo:
    """Describes a checkpoint directory. Not collective; reads metadata only (no tensor data).

    Args:
        path: the checkpoint directory.
        deep: also read common values and small objects (short reprs) and local parts;
            False reads only the commit record and the tensor metadata (for listings).

    Returns:
        A `CheckpointInfo`; an incomplete or damaged checkpoint is described with
        `complete=False` and its `problem`, not raised.

    Raises:
        NotACheckpointError: `path` does not exist or is not a directory.
    """
    ckpt = Path(path)
    if not objstore.exists(ckpt):
        raise NotACheckpointError(f"{ckpt}: no such file or directory")
    if not objstore.is_dir(ckpt):
        raise NotACheckpointError(f"{ckpt}: not a directory (a checkpoint is a directory)")
    has_dcp = objstore.is_file(ckpt / _storage.DCP_METADATA_FNAME)
    ours = any(objstore.exists(ckpt / n) for n in (_storage.COMMON_FNAME, CHECKSUMS_FNAME))
    info = CheckpointInfo(
        str(ckpt), "incomplete", False, parse_step(ckpt.name), None, disk_size(ckpt), ""
    )
    try:
        config = maybe_load_config(ckpt)
    except CheckpointingException as e:
        info.problem = f"damaged {CONFIG_FNAME}: {e}"
        info.date = date_of(ckpt)
        return info
    if config is None:
        info.date = date_of(ckpt / _storage.DCP_METADATA_FNAME if has_dcp else ckpt)
        if not has_dcp or ours:  # stock DCP writes neither common.pt nor checksums.json
            children = [p for p in _subdirs(ckpt) if _looks_like_checkpoint(p)]
            if children:
                raise NotACheckpointError(
                    f"{ckpt}: not a checkpoint but a directory of {len(children)} checkpoint(s) "
                    f"(e.g. {children[-1].name}); list them with `dist-ckpt ls {ckpt}`"
                )
            files = len(objstore.listdir(ckpt))
            info.problem = f"no {CONFIG_FNAME} (the commit record): a save that did not finish" + (
                f" ({files} file(s) present)" if files else " (empty directory)"
            )
            return info
        info.kind, info.backend = "dcp", "dcp"
    else:
        info.kind = config.sharded_backend
        info.backend = f"{config.sharded_backend} v{config.sharded_backend_version}"
        info.date = date_of(ckpt / CONFIG_FNAME)
    try:
        if info.kind == "local":
            _describe_local(ckpt, info, deep)
        elif has_dcp:
            _describe_dcp(ckpt, info, deep)
        else:
            info.problem = f"backend {info.backend} has no {_storage.DCP_METADATA_FNAME}"
            return info
    except CheckpointingException as e:
        info.problem = str(e)
        return info
    info.complete = True
    return info


def _describe_dcp(ckpt: Path, info: CheckpointInfo, deep: bool) -> None:
    checksums = _storage.maybe_checksums(ckpt)
    metadata = _storage.read_dcp_metadata(ckpt, checksums)
    shards: Dict[str, int] = {}
    sizes: Dict[str, int] = {}
    coverage = ChecksumCoverage(present=checksums is not None)
    for item in _storage.stored_items(metadata):
        shards[item.key] = shards.get(item.key, 0) + 1
        sizes[item.key] = item.length
        coverage.items += 1
        coverage.bytes += item.length
        if checksums is not None and item.offset in (checksums.item_sums(item.file) or {}):
            coverage.items_covered += 1
            coverage.bytes_covered += item.length
    if checksums is not None:
        coverage.files_covered = sorted(checksums.files)
    info.checksums = coverage
    for key, md in sorted(_storage.tensor_entries(metadata).items()):
        shape = [int(s) for s in md.size]
        dtype = md.properties.dtype
        nbytes = math.prod(shape) * dtype.itemsize
        info.tensors.append(TensorInfo(key, shape, str(dtype), nbytes, shards.get(key, 0)))
    for key in _storage.object_keys(metadata):
        value = ""
        if deep and sizes.get(key, 0) <= SMALL_OBJECT:
            try:
                value = short_repr(_storage.read_object(ckpt, metadata, key, checksums))
            except CheckpointingException as e:
                value = f"<unreadable: {e}>"
        info.objects[key] = value
    if deep and objstore.is_file(ckpt / _storage.COMMON_FNAME):
        from ..serialization import load_common_state_dict

        for key, value in sorted(load_common_state_dict(ckpt).items(), key=lambda kv: str(kv[0])):
            info.objects[str(key)] = short_repr(value)


def _describe_local(ckpt: Path, info: CheckpointInfo, deep: bool) -> None:
    parts = local_parts(ckpt)
    if not parts:
        raise NotACheckpointError(f"{ckpt}: a local checkpoint without any part")
    fill_local(info, parts, _local_rank_state, deep)


def _local_rank_state(part: LocalPart) -> Dict[str, Any]:
    sd = _storage.read_local_part(part)
    sharded = {
        slot: (entry["global_shape"], str(entry["data"].dtype), entry["data"].element_size())
        for slot, entry in sd["sharded"].items()
    }
    return {**sd, "sharded": sharded}


def _looks_like_checkpoint(path: Path) -> bool:
    if parse_step(path.name) is not None:
        return True
    return any(objstore.exists(path / n) for n in (CONFIG_FNAME, _storage.DCP_METADATA_FNAME))


def _subdirs(path: Path) -> List[Path]:
    return [path / n for n in objstore.listdir(path) if objstore.is_dir(path / n)]


def list_checkpoints(root: PathArg) -> List[CheckpointInfo]:
    """The checkpoints directly under `root` (complete or not), newest first (by step, then
    date); the one named by the root's `latest` record has `latest=True`.

    Raises:
        NotACheckpointError: `root` does not exist or is not a directory.
    """
    base = Path(root)
    check_dir(base)
    latest = read_latest(base)
    found = [describe(p, deep=False) for p in _subdirs(base) if _looks_like_checkpoint(p)]
    for info in found:
        info.latest = latest is not None and info.step == latest
    found.sort(key=lambda i: (i.step if i.step is not None else -1, i.date), reverse=True)
    return found
