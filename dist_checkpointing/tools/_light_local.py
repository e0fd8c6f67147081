"""`describe` of ('local', 1) and ('local', 2) checkpoints without torch: every checksum of a
part's image (`local/_image.py`) is checked, its header read with `_light`'s unpickler.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

from xxhash import xxh3_64_intdigest as _xxh3

from ..errors import NotACheckpointError
from ._info import CheckpointInfo, LocalPart, fill_local
from ._light import Unsupported, _DType, _read, _Stub, _stub, _torch_payload

__all__ = ["describe_local_light"]

_FOOTER = struct.Struct("<8sQQQQQ")  # as local/_image.py
_MAGIC = b"DCLCKPT1"
_HEADER_FORMAT = 1
_MAX_PART = 1 << 30  # larger parts: the full reader (this one reads whole files)


class _TensorAware(_Stub):
    """MCoreTensorAwareStateDict (version 2) or BasicTensorAwareStateDict (version 1)."""


_ShardedTensor = _stub("ShardedTensor")


class _ShardedObject(_Stub):
    data: Any  # set by unpickling, like every field of a stand-in


_CLASSES: Dict[Tuple[str, str], Any] = {
    ("dist_checkpointing.tensor_aware_state_dict", "MCoreTensorAwareStateDict"): _TensorAware,
    ("dist_checkpointing.local.basic_state_dict", "BasicTensorAwareStateDict"): _TensorAware,
    ("dist_checkpointing.local.basic_state_dict", "TensorPlaceholder"): _stub("TensorPlaceholder"),
    ("dist_checkpointing.mapping", "ShardedTensor"): _ShardedTensor,
    ("dist_checkpointing.mapping", "ShardedObject"): _ShardedObject,
    ("builtins", "slice"): slice,  # flattened_range of flat shards
}


def _leaves(x: Any) -> Iterator[Any]:
    """Leaves of nested dicts and lists in order, as `dict_utils.nested_values`."""
    items = x.values() if isinstance(x, dict) else x
    for v in items:
        if isinstance(v, (dict, list)):
            yield from _leaves(v)
        else:
            yield v


def _read_part(path: Path) -> Any:
    """The verified hollow state of one part (the header's `state`)."""
    raw = memoryview(_read(path, _MAX_PART))
    if len(raw) < _FOOTER.size:
        raise Unsupported(f"{path}: too short")
    magic, h_off, h_len, count, h_sum, t_sum = _FOOTER.unpack(raw[-_FOOTER.size :])
    table = h_off + h_len
    if magic != _MAGIC or table + 8 * count + _FOOTER.size != len(raw):
        raise Unsupported(f"{path}: bad footer")
    if _xxh3(raw[h_off:table]) != h_sum or _xxh3(raw[table : table + 8 * count]) != t_sum:
        raise Unsupported(f"{path}: header or checksum table mismatch")
    header = _torch_payload(bytes(raw[h_off:table]), _CLASSES)
    if not isinstance(header, dict) or header.get("format") != _HEADER_FORMAT:
        raise Unsupported(f"{path}: header format")
    entries = header.get("tensors")
    if not isinstance(entries, list) or len(entries) != count:
        raise Unsupported(f"{path}: tensor table")
    sums = struct.unpack(f"<{count}Q", raw[table : table + 8 * count])
    for (off, n, *_), expected in zip(entries, sums):
        if not (isinstance(off, int) and isinstance(n, int) and 0 <= off and off + n <= h_off):
            raise Unsupported(f"{path}: tensor byte range")
        if _xxh3(raw[off : off + n]) != expected:
            raise Unsupported(f"{path}: tensor checksum mismatch")
    state = header.get("state")
    if not isinstance(state, _TensorAware):
        raise Unsupported(f"{path}: not a tensor-aware state")
    return state


def _unique_key(sh: Any) -> str:
    """As `ShardedObject.unique_key`."""
    offset = ".".join(map(str, sh.global_offset))
    shape = ".".join(map(str, sh.global_shape))
    return f"{sh.key}/shard_{offset}_{shape}"


def _entry(slot: str, shape: Any, dtype: Any) -> Tuple[Tuple[int, ...], str, int]:
    if not isinstance(dtype, _DType):
        raise Unsupported(f"dtype of {slot!r}")
    return tuple(shape), str(dtype), dtype.itemsize


def _rank_state(part: LocalPart) -> Dict[str, Any]:
    """A part's state in the shape `fill_local` reads."""
    state = _read_part(part.path)
    if hasattr(state, "sharded_state_dict"):  # version 2
        leaves = list(_leaves(state.sharded_state_dict))
        every = [x for x in leaves if isinstance(x, _ShardedTensor)]
        sharded = {}
        for sh in (every[i] for i in state._stored or []):
            slot = f"{sh.key} {tuple(sh.global_offset)}"
            sharded[slot] = _entry(slot, sh.global_shape, sh.dtype)
        objects = {_unique_key(x): x.data for x in leaves if isinstance(x, _ShardedObject)}
        return {"world_size": None, "common": state.common, "sharded": sharded, "objects": objects}
    sd = state.state_dict  # version 1: data are placeholders
    if not isinstance(sd, dict) or not isinstance(sd.get("sharded"), dict):
        raise Unsupported("not a ('local', 1) rank state")
    sharded = {
        slot: _entry(slot, e["global_shape"], e["data"].dtype) for slot, e in sd["sharded"].items()
    }
    return {**sd, "sharded": sharded}


def describe_local_light(info: CheckpointInfo, deep: bool, parts: List[LocalPart]) -> None:
    """Fills `info` from the committed `parts` of a local checkpoint (or a tier's step)."""
    try:
        fill_local(info, parts, _rank_state, deep)
    except NotACheckpointError as e:  # no parts: the full reader names the problem
        raise Unsupported(str(e)) from e
    except (AttributeError, TypeError, KeyError, ValueError, IndexError) as e:
        raise Unsupported(f"unexpected local part ({type(e).__name__})") from e
