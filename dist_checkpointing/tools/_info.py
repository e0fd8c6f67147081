"""What `describe` reports, and the helpers both of its readers share; torch-free (see `_light`).
Local checkpoints (the local manager's parts) are `_local_info`'s."""

from __future__ import annotations

import json
import math
import os
import re
import reprlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

from ..errors import NotACheckpointError

__all__ = [
    "PathArg",
    "TensorInfo",
    "ChecksumCoverage",
    "CheckpointInfo",
    "check_dir",
    "exists",
    "is_file",
    "names",
    "short_repr",
    "unwrap_object",
    "disk_size",
    "date_of",
    "has_checkpoint_files",
    "is_stock_dcp",
    "incomplete",
    "fill_dcp",
    "TOOLS_READ",
    "unreadable_backend",
]

PathArg = Union[str, "os.PathLike[str]"]
#: the sharded backends whose contents the tools read (besides stock DCP checkpoints)
TOOLS_READ = ("torch_dist", "local")
_SMALL_OBJECT = 64 << 10  # stored objects up to this size are read to show their value
_SHARDED_OBJECT = re.compile(r"/shard_\d+(_\d+)*$")
_repr = reprlib.Repr()
_repr.maxstring = 40
_repr.maxother = 40
_repr.maxdict = _repr.maxlist = _repr.maxtuple = 4


def unreadable_backend(backend: str, version: int, verb: str) -> str:
    """What a tool (`verb`) says of a committed checkpoint of a backend it does not read."""
    reads = "read" if " and " in verb else "reads"
    local = ", and local ones" if verb in ("ls and inspect", "verify") else ""
    return (
        f"a checkpoint of backend {backend!r} v{version} (committed: it has metadata.json); "
        f"{verb} {reads} torch_dist and stock DCP checkpoints{local}: dist_checkpointing.load "
        f"reads this one in a process that registers ({backend!r}, {version}) with "
        "strategies.base.register_default_strategy"
    )


@dataclass
class TensorInfo:
    """One stored tensor: global shape, dtype, bytes and number of stored shards."""

    key: str
    shape: List[int]
    dtype: str
    nbytes: int
    shards: int


@dataclass
class ChecksumCoverage:
    """How much of a checkpoint `checksums.json` covers (items and bytes)."""

    present: bool
    items: int = 0
    items_covered: int = 0
    bytes: int = 0
    bytes_covered: int = 0
    files_covered: List[str] = field(default_factory=list)


@dataclass
class CheckpointInfo:
    """What `describe` found in a checkpoint directory.

    Attributes:
        path, size: the directory, and its bytes on disk.
        kind: the backend named by `metadata.json` ('torch_dist', 'local'), 'dcp',
            'incomplete' (no commit record) or 'unusable' (a damaged commit record).
        complete: whether it is committed (loadable).
        step: from an `iter_NNNNNNN` directory name (a local tier: the iteration), else None.
        backend: `sharded_backend v<version>` (or 'dcp' / None).
        date: mtime of the commit record (or the directory), ISO 8601 UTC.
        tensors: stored tensors.
        objects: stored objects and common values: key -> short repr ('' when not read).
        checksums: checksum coverage (local parts: by their own checksums).
        world_size: ranks that wrote it, when known.
        problem: why it is incomplete or unreadable, else ''.
        latest: whether the root's `latest` record names it.
        parity: for a local checkpoint with parity records (`ParityReplicationStrategy`):
            its groups and which parts are present, rebuildable and lost, as seen here.
        note: what reads it, when the tools show it only in part (a backend they do not
            read, a user's `TensorAwareStateDict`), else ''.
    """

    path: str
    kind: str
    complete: bool
    step: Optional[int]
    backend: Optional[str]
    size: int
    date: str
    tensors: List[TensorInfo] = field(default_factory=list)
    objects: Dict[str, str] = field(default_factory=dict)
    checksums: Optional[ChecksumCoverage] = None
    world_size: Optional[int] = None
    problem: str = ""
    latest: bool = False
    parity: str = ""
    note: str = ""

    @property
    def tensor_bytes(self) -> int:
        """Bytes of all stored tensors (global shapes)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def state(self) -> str:
        """'complete', 'incomplete' (not committed: a save unfinished or running) or 'unusable'
        (committed but damaged or unreadable)."""
        if self.complete:
            return "complete"
        return "incomplete" if self.kind == "incomplete" else "unusable"


def _remote(path: Any) -> Any:
    """`storage.objstore` for an object path (imported only then: `ls` stays light), else None."""
    if re.match(r"[A-Za-z][\w+.-]+:(/|$)", os.fspath(path)) is None:
        return None
    from ..storage import objstore

    return objstore if objstore.split(path) else None


def exists(path: Path) -> bool:
    """Whether a file or directory (an object or prefix) is at `path`."""
    fs = _remote(path)
    return bool(fs.exists(path)) if fs is not None else path.exists()


def is_file(path: Path) -> bool:
    """Whether a file (an object) is at `path`."""
    fs = _remote(path)
    return bool(fs.is_file(path)) if fs is not None else path.is_file()


def names(path: Path) -> List[str]:
    """The sorted names directly under a directory (a prefix)."""
    fs = _remote(path)
    return list(fs.listdir(path)) if fs is not None else sorted(os.listdir(path))


def check_dir(path: Path) -> None:
    """Raises `NotACheckpointError` unless `path` is a directory (a prefix with objects)."""
    fs = _remote(path)
    if fs is not None and not fs.is_dir(path):
        raise NotACheckpointError(f"{path}: no objects under this prefix")
    if fs is None and not path.is_dir():
        what = "not a directory" if path.exists() else "no such file or directory"
        raise NotACheckpointError(f"{path}: {what}")


def unwrap_object(key: str, value: Any) -> Any:
    """A stored value as saved: ShardedObjects are stored as one-element lists."""
    if _SHARDED_OBJECT.search(key) and isinstance(value, list) and len(value) == 1:
        return value[0]
    return value


def short_repr(value: Any) -> str:
    """A one-line repr of at most ~60 characters; tensors as `tensor(shape, dtype)`."""
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return f"tensor({tuple(shape)}, {value.dtype})"
    return _repr.repr(value)


def disk_size(path: Path) -> int:
    if _remote(path) is not None:
        return int(_remote(path).stat(path)[0])
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:  # removed while we walk
                pass
    return total


def date_of(path: Path) -> str:
    try:
        fs = _remote(path)
        stamp = fs.stat(path)[1] if fs is not None else path.stat().st_mtime
    except OSError:
        return ""
    return datetime.fromtimestamp(stamp, timezone.utc).isoformat(timespec="seconds")


#: what saves write (`claim.json` first of all: `_claim.CLAIM_FNAME`)
_CKPT_FILES = ("metadata.json", ".metadata", "common.pt", "checksums.json", "claim.json")


def has_checkpoint_files(path: Path) -> bool:
    """Whether directory `path` holds files that a save writes (committed or not)."""
    return any(n in _CKPT_FILES or n.endswith(".distcp") for n in names(path))


def is_stock_dcp(ckpt: Path) -> bool:
    """Whether `.metadata` alone of `_CKPT_FILES` is there: a PyTorch DCP checkpoint, not ours."""
    return is_file(ckpt / ".metadata") and not any(
        exists(ckpt / n) for n in _CKPT_FILES if n != ".metadata"
    )


def incomplete(ckpt: Path, step: Optional[int]) -> CheckpointInfo:
    """A directory with checkpoint files (or an `iter_` name) but no commit record."""
    n = len(names(ckpt))
    info = CheckpointInfo(str(ckpt), "incomplete", False, step, None, disk_size(ckpt), "")
    info.date = date_of(ckpt / ".metadata") or date_of(ckpt)
    present = f" ({n} file(s) present)" if n else " (empty directory)"
    info.problem = f"no metadata.json (the commit record): a save that did not finish{present}"
    info.problem += _claim_note(ckpt)
    return info


def _claim_note(ckpt: Path) -> str:
    """Who claimed an incomplete checkpoint ('' when it has no readable claim)."""
    fs, path = _remote(ckpt), ckpt / "claim.json"
    try:
        raw = fs.read_object(path, 4096) if fs is not None else path.read_bytes()[:4096]
        c = json.loads(raw)
        who = f"pid {int(c['pid'])} on host {str(c['host'])!r} since {c['time']}"
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return (
        f"; claimed by {who} (token {c['token']}): a save still writing it, or one that "
        "died or lost a rank (then remove the directory)"
    )


def fill_dcp(
    info: CheckpointInfo,
    metadata: Any,
    covered: Optional[Callable[[str, int], bool]],
    files_covered: List[str],
    read_object: Optional[Callable[[str, Any], str]],
    common: Optional[Callable[[], Dict[Any, Any]]],
    has_common_file: bool = False,
) -> None:
    """Fills `info` from DCP metadata (torch's, or `_light`'s stand-ins) for both readers.

    Callbacks, None when not applicable: `covered(file, offset)`: whether checksums cover an
    item; `read_object(key, storage)`: a small object's short repr; `common()`: common state.
    `has_common_file`: the checkpoint has a `common.pt`, so the plain values our saves also
    record for DCP readers (the keys of `planner_data`) are common state, not listed twice.
    """
    planner = getattr(metadata, "planner_data", None)
    plain = set(planner) if has_common_file and isinstance(planner, dict) else set()
    coverage = ChecksumCoverage(covered is not None, files_covered=files_covered)
    shards: Dict[str, int] = {}
    where: Dict[str, Any] = {}
    for index, storage in metadata.storage_data.items():
        shards[index.fqn] = shards.get(index.fqn, 0) + 1
        where[index.fqn] = storage
        coverage.items += 1
        coverage.bytes += int(storage.length)
        if covered is not None and covered(str(storage.relative_path), int(storage.offset)):
            coverage.items_covered += 1
            coverage.bytes_covered += int(storage.length)
    info.checksums = coverage
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if key in plain:
            continue
        if type(md).__name__ == "BytesStorageMetadata":
            storage = where.get(key)
            small = (0 if storage is None else int(storage.length)) <= _SMALL_OBJECT
            info.objects[key] = read_object(key, storage) if read_object and small else ""
            continue
        shape, dtype = [int(s) for s in md.size], md.properties.dtype
        nbytes = math.prod(shape) * dtype.itemsize
        info.tensors.append(TensorInfo(key, shape, str(dtype), nbytes, shards.get(key, 0)))
    for key, value in sorted((common() if common else {}).items(), key=lambda kv: str(kv[0])):
        info.objects[str(key)] = short_repr(value)
