"""`convert_checkpoint`: the full (unsharded) tensors of a DCP-format checkpoint, as
Hugging Face safetensors shards or one `torch.save` file. Not collective; no process group.

Sources: `torch_dist` checkpoints (ours, megatron-core 0.16-0.19) and stock PyTorch DCP
checkpoints. Only tensors are converted (objects and common state are not tensors).

Memory bound: the largest tensor, plus (when that tensor was stored in pieces that are not
contiguous blocks of it, e.g. column shards) its largest stored piece, plus fixed I/O
buffers (about 16 MiB): tensors are read one at a time, each assembled from its stored
chunks and written out before the next is read; output files are laid out from the
metadata alone, so nothing else is held.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from ..core import maybe_load_config
from ..errors import CheckpointExistsError, CheckpointingException, NotACheckpointError
from . import _storage
from ._formats import TorchZipWriter, safetensors_header, tensor_bytes

__all__ = ["ConvertResult", "convert_checkpoint", "parse_size", "SAFETENSORS_INDEX"]

PathArg = Union[str, "os.PathLike[str]"]
SAFETENSORS_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})


@dataclass
class ConvertResult:
    """What `convert_checkpoint` wrote: files (in order), tensor count and data bytes."""

    files: List[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0


def parse_size(text: Union[str, int]) -> int:
    """`"5GB"`, `"500MiB"`, `"1000"` -> bytes (decimal and binary units, case-insensitive).

    Raises:
        CheckpointingException: not a positive size.
    """
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise CheckpointingException(f"invalid size {text!r} (e.g. 5GB, 500MiB, 1000000)")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise CheckpointingException(f"size must be positive, got {text!r}")
    return value


def _source(ckpt: Path) -> Tuple[Any, Any]:
    """Metadata and checksums of a convertible checkpoint."""
    if not ckpt.is_dir():
        raise NotACheckpointError(
            f"{ckpt}: " + ("not a directory" if ckpt.exists() else "no such file or directory")
        )
    config = maybe_load_config(ckpt)
    if config is not None and config.sharded_backend != "torch_dist":
        raise CheckpointingException(
            f"{ckpt}: backend {config.sharded_backend!r}; convert reads torch_dist and DCP "
            "checkpoints (save with ('torch_dist', 1) to convert)"
        )
    if config is None and not _storage.is_stock_dcp(ckpt):
        raise NotACheckpointError(f"{ckpt}: not a complete checkpoint (no metadata.json)")
    checksums = _storage.maybe_checksums(ckpt)
    return _storage.read_dcp_metadata(ckpt, checksums), checksums


def _progress(total: int, enabled: Optional[bool]) -> Any:
    from tqdm import tqdm

    show = sys.stderr.isatty() if enabled is None else enabled
    return tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=not show)


def _shards(
    entries: List[Tuple[str, torch.dtype, Tuple[int, ...]]], limit: int
) -> List[List[Tuple[str, torch.dtype, Tuple[int, ...]]]]:
    """Packs entries in order into shards of at most `limit` bytes (a bigger tensor alone)."""
    shards: List[List[Tuple[str, torch.dtype, Tuple[int, ...]]]] = [[]]
    size = 0
    for e in entries:
        nbytes = _nbytes(e)
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes
    return shards if shards[0] else []


def _nbytes(entry: Tuple[str, torch.dtype, Tuple[int, ...]]) -> int:
    n = entry[1].itemsize
    for s in entry[2]:
        n *= s
    return n


def convert_checkpoint(
    src: PathArg,
    out: PathArg,
    to: str = "safetensors",
    *,
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
    progress: Optional[bool] = None,
) -> ConvertResult:
    """Writes the full tensors of a `torch_dist` or stock DCP checkpoint to another format.

    Args:
        src: the checkpoint directory.
        out: for 'safetensors', a directory that receives `model-0000i-of-0000N.safetensors`
            and `model.safetensors.index.json` (`weight_map`: key -> file); for 'torch', the
            file to write (`torch.load(out)` gives `{key: tensor}`).
        to: 'safetensors' or 'torch'.
        max_shard_size: bytes (or e.g. "5GB") per safetensors file; a larger tensor gets a
            file of its own.
        progress: show a tqdm bar; default: when stderr is a terminal.

    Returns:
        The files written and the tensors and bytes converted.

    Raises:
        NotACheckpointError: `src` is missing or not a complete checkpoint.
        CheckpointExistsError: the output already exists.
        CheckpointCorruptedError: a damaged chunk (checked against `checksums.json`).
        CheckpointingException: another backend, an unknown format or a dtype the format
            cannot store.
    """
    ckpt, dest = Path(src), Path(out)
    if to not in ("safetensors", "torch"):
        raise CheckpointingException(f"unknown output format {to!r} (safetensors or torch)")
    limit = parse_size(max_shard_size)
    metadata, checksums = _source(ckpt)
    entries = [
        (key, md.properties.dtype, tuple(int(s) for s in md.size))
        for key, md in sorted(_storage.tensor_entries(metadata).items())
    ]
    result = ConvertResult(tensors=len(entries), bytes=sum(_nbytes(e) for e in entries))
    bar = _progress(result.bytes, progress)
    try:
        if to == "torch":
            _write_torch(ckpt, metadata, checksums, entries, dest, bar)
            result.files.append(str(dest))
        else:
            result.files = _write_safetensors(ckpt, metadata, checksums, entries, dest, limit, bar)
    finally:
        bar.close()
    return result


def _write_torch(
    ckpt: Path, metadata: Any, checksums: Any, entries: List[Any], dest: Path, bar: Any
) -> None:
    if dest.exists():
        raise CheckpointExistsError(f"{dest} already exists; choose another output path")
    tmp = dest.with_name(dest.name + ".partial")
    try:
        with open(tmp, "wb") as f:
            writer = TorchZipWriter(f, entries)
            for i, (key, _, _) in enumerate(entries):
                tensor = _storage.read_full_tensor(ckpt, metadata, key, checksums)
                writer.write(i, tensor)
                bar.update(tensor.nbytes)
                del tensor
            writer.close()
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _write_safetensors(
    ckpt: Path,
    metadata: Any,
    checksums: Any,
    entries: List[Any],
    dest: Path,
    limit: int,
    bar: Any,
) -> List[str]:
    if (dest / SAFETENSORS_INDEX).exists() or any(dest.glob("model-*.safetensors")):
        raise CheckpointExistsError(
            f"{dest} already holds safetensors files; choose another directory"
        )
    dest.mkdir(parents=True, exist_ok=True)
    shards = _shards(entries, limit)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: Dict[str, str] = {}
    written = []
    try:
        for name, shard in zip(names, shards):
            path = dest / name
            written.append(path)
            with open(path, "wb") as f:
                f.write(safetensors_header(shard))
                for key, _, _ in shard:
                    tensor = _storage.read_full_tensor(ckpt, metadata, key, checksums)
                    f.write(tensor_bytes(tensor))
                    bar.update(tensor.nbytes)
                    weight_map[key] = name
                    del tensor
        index = {
            "metadata": {"total_size": sum(_nbytes(e) for e in entries)},
            "weight_map": weight_map,
        }
        (dest / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    except BaseException:
        for path in written:  # no half-written set of files looks complete
            path.unlink(missing_ok=True)
        raise
    return [str(dest / n) for n in names] + [str(dest / SAFETENSORS_INDEX)]
