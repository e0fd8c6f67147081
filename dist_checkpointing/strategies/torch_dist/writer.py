"""The torch_dist writer: each data file is laid out ahead of time (`plan_file`: zip records
around each tensor's raw bytes, serialized bytes per object), then written in large
requests (O_DIRECT where allowed) from a staged image (async save) or streamed through two
aligned chunk buffers (sync save), each item's xxh3-64 computed as its bytes are written
and stored beside the file (`integrity.write_item_sums`)."""

from __future__ import annotations

import functools
import io
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ...integrity import BlockSums, ItemSum, checksum, write_item_sums
from ...storage import ALIGN, FileWriter, fsync_dir, objstore
from ...storage.buffers import aligned
from ...storage.segments import ChunkStream, write_chunks
from .plan import WriteEntry
from .verify import flat_bytes
from .zipformat import zip_item_layout

__all__ = [
    "PlannedItem",
    "FilePlan",
    "plan_file",
    "write_streamed",
    "write_image",
    "write_files",
    "stage_image",
]

#: `(item offset, digests)` of one written item
ItemChecksum = Tuple[int, ItemSum]


@dataclass
class PlannedItem:
    """One item of a data file: where it goes and what surrounds its data."""

    item: WriteItem
    offset: int
    length: int
    head: bytes = b""
    tail: bytes = b""
    data_nbytes: int = 0  # raw tensor bytes between head and tail (0 for byte items)
    payload: Optional[bytes] = None  # the whole item, for byte items and torch.save fallbacks


@dataclass
class FilePlan:
    """The layout of one data file."""

    name: str
    items: List[PlannedItem]
    size: int

    @property
    def signature(self) -> Tuple[Any, ...]:
        """Equal for files whose images can share a buffer."""
        return (self.size, tuple((p.offset, p.length, p.data_nbytes) for p in self.items))


#: tensors at least this large get their data on a 4096-byte file offset: part of the file
#: layout (docs/formats.md), kept though no reader uses O_DIRECT any more, so files stay
#: byte-identical; smaller ones on 64 bytes, as torch.save does (less padding)
DIRECT_MIN = 1 << 20


@functools.lru_cache(maxsize=4096)
def _layout(dtype: torch.dtype, shape: Tuple[int, ...], offset: int) -> Any:
    nbytes = math.prod(shape) * dtype.itemsize
    return zip_item_layout(dtype, shape, offset, ALIGN if nbytes >= DIRECT_MIN else 64)


def _payload(data: Any) -> bytes:
    """An item's bytes where not laid out around raw data: an object's, a tensor's torch.save."""
    if not isinstance(data, torch.Tensor):
        return bytes(data)
    buf = io.BytesIO()
    torch.save(data.detach().cpu().contiguous().clone(), buf)
    return buf.getvalue()


def plan_file(name: str, entries: Sequence[WriteEntry]) -> FilePlan:
    """Lays out a data file (no data is copied, except for rare torch.save fallbacks)."""
    items, offset = [], 0
    for e in entries:
        t, layout = e.data, None
        if isinstance(t, torch.Tensor):
            layout = _layout(t.dtype, tuple(t.shape), offset % ALIGN)
        if layout is None:  # an object, or a tensor without a storage class or over 4 GiB
            payload = _payload(t)
            items.append(PlannedItem(e.item, offset, len(payload), payload=payload))
        else:
            items.append(
                PlannedItem(
                    e.item, offset, layout.nbytes, layout.head, layout.tail, layout.data_nbytes
                )
            )
        offset += items[-1].length
    return FilePlan(name, items, offset)


def _on_device(src: Any) -> bool:
    """Whether `src` is a tensor outside host memory (copied a chunk at a time)."""
    return isinstance(src, torch.Tensor) and src.device.type != "cpu"


def _device_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _results(plan: FilePlan) -> List[WriteResult]:
    return [
        WriteResult(p.item.index, p.length, _StorageInfo(plan.name, p.offset, p.length))
        for p in plan.items
    ]


def _open(path: Path, size: int, direct: bool, **kw: Any) -> Any:
    """A `FileWriter`, or for an object path its multipart upload (same interface)."""
    cls = FileWriter if objstore.split(path) is None else objstore.ObjectWriter
    return cls(path, size, direct, **kw)


def write_streamed(
    directory: Path,
    plan: FilePlan,
    sources: Sequence[Any],
    checksums: bool,
    direct: bool = True,
    progress: Optional[Callable[[int], None]] = None,
) -> List[WriteResult]:
    """Writes a file from the tensors themselves (sync save) through two chunk buffers, one
    filled (CUDA tensors copied straight, pinned) and checksummed while the other is written.

    Args:
        sources: per item of `plan`, its tensor (None for byte items).
        checksums: compute each item's xxh3-64 (written to the file's sidecar).
        progress: called with the bytes of each chunk handed to the disk.
    """
    on_device = any(_on_device(src) for src in sources)
    out = _open(directory / plan.name, plan.size, direct, preallocate=direct)
    stream = ChunkStream(out, pin=on_device, progress=progress)
    sums: List[ItemChecksum] = []
    put = stream.put
    try:
        for p, src in zip(plan.items, sources):
            if p.payload is not None:
                put(np.frombuffer(p.payload, dtype=np.uint8))
                if checksums:
                    sums.append((p.offset, ItemSum(p.length, checksum(p.payload))))
            else:
                device = _on_device(src) and src.is_contiguous()  # else through a host copy
                data = _device_bytes(src) if device else flat_bytes(src.detach().cpu().contiguous())
                blocks = BlockSums() if checksums else None
                put(np.frombuffer(p.head, dtype=np.uint8))
                put(data, blocks.update if blocks is not None else None)
                put(np.frombuffer(p.tail, dtype=np.uint8))
                if blocks is not None:
                    sums.append((p.offset, blocks.item_sum(p.length, p.head, p.tail)))
        stream.finish()
        out.finish()
    except BaseException:
        stream.close()
        out.abort()
        raise
    stream.close()
    if checksums:
        write_item_sums(directory, plan.name, sums)
    return _results(plan)


def stage_image(plan: FilePlan, sources: Sequence[Any], buf: torch.Tensor) -> None:
    """Copies every item's bytes into the file image `buf` (device copies non-blocking: the
    caller synchronizes)."""
    flat = buf.numpy()
    for p, src in zip(plan.items, sources):
        if p.payload is not None:
            flat[p.offset : p.offset + p.length] = np.frombuffer(p.payload, dtype=np.uint8)
            continue
        head_end = p.offset + len(p.head)
        flat[p.offset : head_end] = np.frombuffer(p.head, dtype=np.uint8)
        if p.data_nbytes:
            dst = buf[head_end : head_end + p.data_nbytes].view(src.dtype).view(src.shape)
            dst.copy_(src, non_blocking=src.is_cuda)
        tail_start = head_end + p.data_nbytes
        flat[tail_start : tail_start + len(p.tail)] = np.frombuffer(p.tail, dtype=np.uint8)
    flat[plan.size : aligned(plan.size)] = 0  # the padding of the last request


def _image_sums(plan: FilePlan, flat: np.ndarray) -> List[ItemChecksum]:
    sums: List[ItemChecksum] = []
    for p in plan.items:
        item = flat[p.offset : p.offset + p.length]
        if p.payload is not None:
            sums.append((p.offset, ItemSum(p.length, checksum(item))))
            continue
        d0, d1 = len(p.head), len(p.head) + p.data_nbytes
        blocks = BlockSums()
        blocks.update(item[d0:d1])
        framed = blocks.item_sum(p.length, item[:d0].tobytes(), item[d1:].tobytes())
        sums.append((p.offset, framed))
    return sums


def write_image(
    directory: Path, plan: FilePlan, buf: torch.Tensor, checksums: bool, direct: bool = True
) -> List[WriteResult]:
    """Writes a staged file image (async save's background writer), hashing it while a
    helper thread writes it (the digests go to the file's sidecar)."""
    flat = buf.numpy()
    out = _open(directory / plan.name, plan.size, direct)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dc-write-io")
    try:
        writes = pool.submit(write_chunks, out, flat[: aligned(plan.size)], 0)
        try:
            sums = _image_sums(plan, flat) if checksums else []
        finally:
            writes.exception()  # the writes are done (or failed) before finish or abort
        writes.result()
        out.finish()
    except BaseException:
        out.abort()
        raise
    finally:
        pool.shutdown(wait=True)
    if checksums:
        write_item_sums(directory, plan.name, sums)
    return _results(plan)


def write_files(
    directory: Path,
    jobs: Sequence[Tuple[FilePlan, Sequence[Any], Optional[torch.Tensor]]],
    thread_count: int,
    checksums: bool,
    direct: bool = True,
    progress: Optional[Callable[[int], None]] = None,
) -> List[WriteResult]:
    """Writes files, up to `thread_count` at once (a thread each); fsyncs the directory.

    Args:
        jobs: per file, its plan, its item sources, and its staged image (or None to stream).
        progress: called with the bytes of each chunk of a streamed write.
    """
    if not jobs:
        return []

    def one(job: Tuple[FilePlan, Sequence[Any], Optional[torch.Tensor]]) -> Any:
        plan, sources, image = job
        if image is not None:
            return write_image(directory, plan, image, checksums, direct)
        return write_streamed(directory, plan, sources, checksums, direct, progress)

    workers = max(1, min(thread_count, len(jobs)))
    if workers == 1:
        outs = [one(j) for j in jobs]
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dc-write") as pool:
            outs = list(pool.map(one, jobs))
    fsync_dir(directory)
    return [r for rs in outs for r in rs]
