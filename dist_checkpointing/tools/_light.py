"""`describe` without importing torch (`dist-ckpt inspect`, `ls`): an unpickler maps allowlisted
torch classes to stand-ins; anything else raises `Unsupported` (the caller uses the full reader).
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import xxhash

from ..errors import NotACheckpointError
from . import _info
from ._info import CheckpointInfo, PathArg
from ._local_info import LocalPart, fill_local, local_parts, local_tier, tier_step

__all__ = ["Unsupported", "describe_light"]

_STEP_DIR = re.compile(r"iter_(\d{7,})")  # as manager.layout.parse_step
_MAX_METADATA = 64 << 20
_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4,
    "uint64": 8, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}  # fmt: skip
_STORAGE_DTYPE = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}  # fmt: skip


class Unsupported(Exception):
    """This checkpoint needs the full reader (torch): not an error by itself."""


class _DType:
    def __init__(self, name: str) -> None:
        self.name, self.itemsize = name, _ITEMSIZE[name]

    def __str__(self) -> str:
        return f"torch.{self.name}"


class _Stub:
    """Stands in for an allowlisted class: keeps constructor args and pickled state."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            self.__dict__.update(state[0] or {})
            self.__dict__.update(state[1])
        elif isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state


def _stub(name: str) -> type:
    return type(name, (_Stub,), {})


class _TensorProperties(_Stub):
    @property
    def dtype(self) -> _DType:
        dtype = self.state[0]  # pickled as (dtype, layout, requires_grad, memory_format, ...)
        if not isinstance(dtype, _DType):
            raise Unsupported(f"dtype {dtype!r}")
        return dtype


def _enum(value: Any) -> Any:
    """Stands in for DCP's enums: the member's value (its name when pickled by name)."""
    return value


def _enum_by_name(cls: Any, name: Any) -> Any:
    """`builtins.getattr` as Python 3.12 pickles an Enum member: `getattr(EnumClass, name)`."""
    if cls is _enum and isinstance(name, str):
        return name
    raise Unsupported(f"getattr({cls!r}, {name!r})")


_DCP = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"
_Classes = Dict[Tuple[str, str], Any]
_DCP_NAMES = (
    "Metadata TensorStorageMetadata BytesStorageMetadata ChunkStorageMetadata MetadataIndex "
    "StorageMeta"
)
# megatron-core pickles its global save plan (plain dataclasses and enums) beside it
_PLANNER_NAMES = "SavePlan WriteItem TensorWriteData BytesIOWriteData LoadPlan ReadItem"
_TORCH_NAMES = "strided sparse_coo contiguous_format channels_last preserve_format"
_METADATA_CLASSES: _Classes = {
    **{(_DCP, n): _stub(n) for n in _DCP_NAMES.split()},
    (_DCP, "TensorProperties"): _TensorProperties,
    **{(_PLANNER, n): _stub(n) for n in _PLANNER_NAMES.split()},
    **{(_PLANNER, n): _enum for n in ("WriteItemType", "LoadItemType")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _stub("_StorageInfo"),
    **{("pathlib", n): lambda *parts: "/".join(parts) for n in ("PurePosixPath", "PosixPath")},
    ("pathlib", "WindowsPath"): lambda *parts: "/".join(parts),
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    **{("torch", n): n for n in _TORCH_NAMES.split()},
    (_DCP, "_MEM_FORMAT_ENCODING"): _enum,
    ("builtins", "getattr"): _enum_by_name,
    ("torch.serialization", "_get_layout"): lambda name: name,
    ("torch", "Size"): lambda dims=(): tuple(dims),
    ("collections", "OrderedDict"): dict,
}


_TensorStub = collections.namedtuple("_TensorStub", "shape dtype")


def _rebuild_tensor(storage: Any, offset: int, size: Any, *rest: Any) -> _TensorStub:
    return _TensorStub(tuple(size), storage)


class _Unpickler(pickle.Unpickler):
    """Maps allowlisted globals to stand-ins; anything else needs the full reader."""

    def __init__(self, data: bytes, tensors: bool) -> None:
        super().__init__(io.BytesIO(data))
        self._tensors = tensors

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _ITEMSIZE:
            return _DType(name)
        found = _METADATA_CLASSES.get((module, name))
        if found is not None:
            return found
        if self._tensors and module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if self._tensors and module == "torch" and name in _STORAGE_DTYPE:
            return _DType(_STORAGE_DTYPE[name])
        raise Unsupported(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if self._tensors and isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
            dtype = pid[1]
            if isinstance(dtype, _DType):
                return dtype
        raise Unsupported(f"persistent id {pid!r}")


def _unpickle(data: bytes, tensors: bool) -> Any:
    try:
        return _Unpickler(data, tensors).load()
    except Unsupported:
        raise
    except Exception as e:  # damaged bytes: let the full reader name the problem
        raise Unsupported(f"cannot parse ({type(e).__name__})") from e


def _torch_payload(data: bytes) -> Any:
    """The object of a `torch.save` zip (tensors as stand-ins)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            name = next(n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
            return _unpickle(z.read(name), True)
    except (zipfile.BadZipFile, StopIteration, KeyError, OSError) as e:
        raise Unsupported(f"not a torch.save zip ({type(e).__name__})") from e


def _read(path: Path, limit: int) -> bytes:
    """A whole file; one of more than `limit` bytes is left to the full reader (unread)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > limit:
                raise Unsupported(f"{path} is large")
            return f.read()
    except OSError as e:
        raise Unsupported(str(e)) from e


def _json(path: Path) -> Any:
    try:
        return json.loads(_read(path, 1 << 20 if path.name == "metadata.json" else 1 << 30))
    except ValueError as e:
        raise Unsupported(f"{path}: not JSON") from e


def _matches(recorded: Any, data: bytes) -> bool:
    """Whether `recorded` is the hex xxh3-64 of `data` (False for anything else)."""
    try:
        return int(recorded, 16) == xxhash.xxh3_64_intdigest(data)
    except (TypeError, ValueError):
        return False


def _checksums(path: Path) -> Any:
    """`checksums.json` or a data file's sidecar (see `integrity`), checked."""
    if not path.exists():
        return None
    body = _json(path)
    if not isinstance(body, dict) or not isinstance(body.get("digest"), str):
        raise Unsupported("checksums.json damaged")
    digest = body.pop("digest")
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    if (
        not _matches(digest, canonical)
        or not isinstance(body.setdefault("ranges", {}), dict)
        or body.get("format") not in (1, 2)
    ):
        raise Unsupported(f"{path.name} damaged or of another format")
    return body


def _ranges(ckpt: Path, sums: Any, name: str) -> Any:
    """The item checksums of data file `name`: in `checksums.json` or its sidecar."""
    if sums["format"] == 2 and name not in sums["ranges"]:
        side = _checksums(ckpt / f"{name}.sums")
        if side is None or side["format"] != 1:
            raise Unsupported(f"{name}.sums missing or damaged")
        sums["ranges"][name] = side["ranges"].get(name, {})
    return sums["ranges"].get(name, {})


def _config(ckpt: Path) -> Any:
    path = ckpt / "metadata.json"
    if not path.exists():
        return None
    body = _json(path)
    if not isinstance(body, dict):
        raise Unsupported("metadata.json is not an object")
    backend, version = body.get("sharded_backend"), body.get("sharded_backend_version", 1)
    if not isinstance(version, int) or isinstance(version, bool):
        raise Unsupported(f"backend version {version!r}")
    if backend != "torch_dist" and (backend, version) not in (("local", 1), ("local", 2)):
        raise Unsupported(f"backend {backend!r}")
    return body


def _local_shallow(info: CheckpointInfo, deep: bool, parts: List[LocalPart]) -> None:
    """Fills `info` from which parts of a local checkpoint exist (reading them is the full
    reader's work: one decoder of the local format)."""
    if deep:
        raise Unsupported("reading local parts")
    try:
        fill_local(info, parts, lambda part: {}, deep=False)
    except NotACheckpointError as e:  # no parts: the full reader names the problem
        raise Unsupported(str(e)) from e


def describe_light(path: PathArg, deep: bool = True, step: Optional[int] = None) -> CheckpointInfo:
    """`tools.inspect.describe` of complete `torch_dist`, stock DCP and local checkpoints and
    local tiers; raises `Unsupported` for anything else (then use the full reader)."""
    if re.match(r"[A-Za-z][\w+.-]+:(/|$)", str(path)):  # an object store: the full reader
        raise Unsupported("not a local path")
    ckpt = Path(path)
    config = _config(ckpt) if ckpt.is_dir() else None
    m = _STEP_DIR.fullmatch(ckpt.name)
    if config is None and (tier := local_tier(ckpt)):  # a checkpoint manager's local tier
        info = tier_step(ckpt, tier, step)
        if info.complete:
            _local_shallow(info, deep, local_parts(ckpt, info.step))
        return info
    if step is not None:
        raise Unsupported("a step outside a local tier")
    step = int(m.group(1)) if m else None
    if config is not None and config["sharded_backend"] == "local":
        backend = f"local v{config.get('sharded_backend_version', 1)}"
        date = _info.date_of(ckpt / "metadata.json")
        info = CheckpointInfo(str(ckpt), "local", True, step, backend, _info.disk_size(ckpt), date)
        _local_shallow(info, deep, local_parts(ckpt))
        return info
    if not (ckpt / ".metadata").is_file():
        raise Unsupported("no .metadata")
    if config is None and not _info.is_stock_dcp(ckpt):
        raise Unsupported("incomplete")
    sums = _checksums(ckpt / "checksums.json") if config is not None else None
    kind = "torch_dist" if config else "dcp"
    backend = f"torch_dist v{config.get('sharded_backend_version', 1)}" if config else "dcp"
    date = _info.date_of(ckpt / ("metadata.json" if config else ".metadata"))
    info = CheckpointInfo(str(ckpt), kind, True, step, backend, _info.disk_size(ckpt), date)
    raw = _read(ckpt / ".metadata", _MAX_METADATA)
    if sums is not None:
        recorded = sums.get("files", {}).get(".metadata")
        if not _matches(recorded, raw):
            raise Unsupported(".metadata does not match its checksum")
    metadata = _unpickle(raw, tensors=False)
    covered = None if sums is None else lambda f, o: str(o) in _ranges(ckpt, sums, f)
    files = sorted(sums.get("files", {})) if sums is not None else []

    def read(key: str, storage: Any) -> str:
        if storage is None:
            return ""
        rel = str(storage.relative_path)
        if "/" in rel or rel in ("", ".", ".."):
            raise Unsupported("odd storage path")
        try:
            with open(ckpt / rel, "rb") as f:
                f.seek(int(storage.offset))
                data = f.read(int(storage.length))
        except OSError as e:
            raise Unsupported(str(e)) from e
        if sums is not None:  # show only verified values
            entry = _ranges(ckpt, sums, rel).get(str(storage.offset))
            if not isinstance(entry, list) or len(entry) != 2:
                raise Unsupported(f"no whole-item checksum for {key!r}")
            if not _matches(entry[1], data):
                raise Unsupported(f"{key!r} does not match its checksum")
        return _info.short_repr(_info.unwrap_object(key, _torch_payload(data)))

    def common() -> Dict[Any, Any]:
        common = _torch_payload(_read(ckpt / "common.pt", 1 << 30))
        if not isinstance(common, dict):
            raise Unsupported("common.pt is not a dict")
        return common

    common_read = common if deep and (ckpt / "common.pt").is_file() else None
    try:
        has_common = (ckpt / "common.pt").is_file()
        _info.fill_dcp(
            info, metadata, covered, files, read if deep else None, common_read, has_common
        )
    except (AttributeError, TypeError, KeyError, ValueError) as e:
        raise Unsupported(f"unexpected metadata ({type(e).__name__})") from e
    return info
