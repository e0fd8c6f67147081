"""The tools' only reads below the public API (DCP metadata, raw items, local images), so a
change of the backends' private modules touches only this module."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from .._claim import SAVE_ID_KEY
from .._safe_load import torch_load
from ..errors import CheckpointCorruptedError, CheckpointingException
from ..integrity import Checksums
from ..integrity import read_checksums as maybe_checksums
from ..storage import objstore
from ..strategies.torch_dist.metadata_file import (
    DCP_METADATA_FNAME,
    INDEX_FNAME,
    open_for_load,
    plain_value_keys,
)
from ..strategies.torch_dist.metadata_file import read_metadata as read_dcp_metadata
from ..strategies.torch_dist.plan import TensorRequest, plan_tensor_reads
from ..strategies.torch_dist.reader import read_byte_items, read_tensor_items
from ._info import unwrap_object
from ._local_info import LocalPart

__all__ = [
    "DCP_METADATA_FNAME",
    "INDEX_FNAME",
    "check_index",
    "COMMON_FNAME",
    "StoredItem",
    "read_dcp_metadata",
    "maybe_checksums",
    "tensor_entries",
    "object_keys",
    "stored_items",
    "read_full_tensor",
    "read_object",
    "read_local_part",
]

COMMON_FNAME = "common.pt"


@dataclass(frozen=True)
class StoredItem:
    """Where one stored chunk or object lives: key, file, byte range."""

    key: str
    offsets: Tuple[int, ...]
    file: str
    offset: int
    length: int


def _listed(metadata: Metadata, ckpt: Optional[Path]) -> List[Tuple[str, Any]]:
    plain = plain_value_keys(ckpt, metadata) if ckpt is not None else set()
    return [(k, v) for k, v in metadata.state_dict_metadata.items() if k not in plain]


def tensor_entries(
    metadata: Metadata, ckpt: Optional[Path] = None
) -> Dict[str, TensorStorageMetadata]:
    """`{key: metadata}` of the stored tensors (with `ckpt`: without the plain values of its
    common state that our saves also record for DCP readers)."""
    return {k: v for k, v in _listed(metadata, ckpt) if isinstance(v, TensorStorageMetadata)}


def object_keys(metadata: Metadata, ckpt: Optional[Path] = None) -> List[str]:
    """Keys of the stored byte entries (ShardedObjects, megatron's common state; with
    `ckpt`, as `tensor_entries`)."""
    return sorted(k for k, v in _listed(metadata, ckpt) if isinstance(v, BytesStorageMetadata))


def stored_items(metadata: Metadata) -> Iterator[StoredItem]:
    """Every stored item (tensor chunk or object) with its file and byte range."""
    for index, info in metadata.storage_data.items():
        offsets = tuple(index.offset) if index.offset is not None else ()
        file = str(info.relative_path)
        yield StoredItem(index.fqn, offsets, file, int(info.offset), int(info.length))


def _said_of(md: Metadata, key: str) -> Tuple[Any, ...]:
    """What `md` says of `key`: its kind, dtype and shape, and each stored chunk's box and
    location (`.metadata` and its index must say the same)."""
    entry: Any = md.state_dict_metadata.get(key)
    tensor = isinstance(entry, TensorStorageMetadata)
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks] if tensor else [None]
    where = []
    for box in boxes:
        info = md.storage_data.get(MetadataIndex(key, box[0] if box else None))
        where.append(info and (str(info.relative_path), info.offset, info.length))
    head = (entry.properties.dtype, tuple(entry.size)) if tensor else ()
    return type(entry), head, boxes, where


def check_index(checkpoint_dir: Path, metadata: Metadata) -> None:
    """The load's checks of the load index (`open_for_load`, every key), and that each
    entry says what `.metadata` (`metadata`) says: `verify` judges the file loads plan from.

    Raises:
        CheckpointCorruptedError: the index is malformed, points outside the checkpoint, or
            differs from `.metadata` (naming the key).
    """
    path = Path(checkpoint_dir) / INDEX_FNAME
    if not objstore.exists(path):
        return
    indexed = open_for_load(Path(checkpoint_dir), list(metadata.state_dict_metadata))
    for key in indexed.state_dict_metadata:
        if _said_of(indexed, key) != _said_of(metadata, key):
            raise CheckpointCorruptedError(
                f"{path}: the entry of {key!r} differs from {DCP_METADATA_FNAME}'s (damaged or "
                "edited)"
            )


def read_full_tensor(
    ckpt: Path,
    metadata: Metadata,
    key: str,
    checksums: Optional[Checksums] = None,
    index: Tuple[int, ...] = (),
) -> torch.Tensor:
    """Reads one whole tensor (with `index`, `tensor[index]`) chunk by chunk, verified."""
    stored = metadata.state_dict_metadata.get(key)
    if not isinstance(stored, TensorStorageMetadata):
        raise CheckpointingException(f"{ckpt}: no tensor {key!r}")
    shape, k = tuple(stored.size), len(index)
    out = torch.empty(shape[k:], dtype=stored.properties.dtype)
    offsets = (*index, *(0,) * (len(shape) - k))
    reads = plan_tensor_reads(TensorRequest(key, 0, offsets, (1,) * k + shape[k:]), stored)

    def resolve(r: Any) -> torch.Tensor:
        view = out.view((1,) * k + out.shape)
        for dim, (o, n) in enumerate(zip(r.dest_offsets, r.lengths)):
            view = view.narrow(dim, o, n)
        return view

    read_tensor_items(ckpt, metadata, reads, resolve, 1, checksums)
    return out


def read_object(
    ckpt: Path, metadata: Metadata, key: str, checksums: Optional[Checksums] = None
) -> Any:
    """Reads one stored byte entry, verified, and unpickles it safely (`weights_only`)."""
    (raw,) = read_byte_items(ckpt, metadata, [MetadataIndex(key)], checksums)
    return unwrap_object(key, torch_load(io.BytesIO(raw), f"{key!r} in {ckpt}"))


def read_local_part(part: LocalPart) -> Dict[str, Any]:
    """The verified rank state of a local part, in the shape `_local_info.fill_local` reads."""
    from ..dict_utils import nested_values
    from ..local._image import decode_image, read_image
    from ..local.base_state_dict import TensorAwareStateDict
    from ..mapping import ShardedObject, ShardedTensor
    from ..tensor_aware_state_dict import MCoreTensorAwareStateDict

    try:
        image = read_image(str(part.path))
    except OSError as e:
        raise CheckpointCorruptedError(f"{part.path}: cannot be read: {e}") from e
    _, state = decode_image(image, str(part.path))
    if isinstance(state, MCoreTensorAwareStateDict):
        tensors: Dict[str, Tuple[Any, torch.Tensor]] = {}
        objects: Dict[str, Any] = {}
        for sh in nested_values(state.sharded_state_dict):
            if isinstance(sh, ShardedTensor) and sh.data is not None:
                tensors[f"{sh.key} {tuple(sh.global_offset)}"] = (sh.global_shape, sh.data)
            elif isinstance(sh, ShardedObject):
                objects[sh.unique_key] = sh.data
        common = dict(state.common) if isinstance(state.common, dict) else {}
        save_id = common.pop(SAVE_ID_KEY, None)  # recorded by the save, not the user's
        sd: Dict[str, Any] = {"world_size": None, "common": common, "objects": objects}
        sd["save_id"] = save_id
    elif _is_local_backend_state(state):
        sd = getattr(state, "state_dict")  # noqa: B009  (checked there; not in the interface)
        tensors = {slot: (e["global_shape"], e["data"]) for slot, e in sd["sharded"].items()}
    elif isinstance(state, TensorAwareStateDict):
        # a user's state (BasicTensorAwareStateDict, ...): intact (its image verified) but
        # without a global layout; its tensors are listed with each rank's own shape
        data = list(state.tensors)
        names = list(state.tensor_names() or [])
        names += [f"tensor {i}" for i in range(len(names), len(data))]
        tensors = {f"{n} (rank {part.owner})": (tuple(t.shape), t) for n, t in zip(names, data)}
        sd = {"world_size": None, "common": {}, "objects": {}, "state_class": type(state).__name__}
    else:
        raise CheckpointCorruptedError(
            f"{part.path}: holds a {type(state).__name__}, not a TensorAwareStateDict"
        )
    sharded = {
        slot: (tuple(shape), str(t.dtype), t.element_size()) for slot, (shape, t) in tensors.items()
    }
    return {**sd, "sharded": sharded}


def _is_local_backend_state(state: Any) -> bool:
    """Whether a local part holds the rank state of a ('local', 1) or ('local', 2) save."""
    sd = getattr(state, "state_dict", None)
    if not isinstance(sd, dict) or not isinstance(sd.get("sharded"), dict):
        return False
    return all(
        isinstance(e, dict) and {"global_shape", "data"} <= e.keys() for e in sd["sharded"].values()
    )
