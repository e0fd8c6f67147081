"""The I/O layer shared by the torch_dist backend and local checkpoints.

Core-level infrastructure: it knows files, bytes and host buffers, nothing of sharded state
dicts or strategies (it never imports `mapping`, `serialization` or `strategies`).

Modules:
    direct: O_DIRECT with buffered fallback (one registry of refusing directories),
        positional reads (`read_region`, `read_file`) and writes (`FileWriter`).
    buffers: aligned, pooled host buffers (bounce buffers, chunk pairs, `ImagePool`;
        pinned for CUDA sources).
    pinned: page-locking host buffers in place.
    fileio: atomic replace and fsync helpers.
    faults: the documented, test-facing fault seam consulted by every read and write.
    segments: writing a file from byte segments (`ChunkStream` through aligned buffers,
        `BufferedStream` from the bytes' own memory); `StreamedFile` for chunks as they arrive.
    probe: the read path (page cache or O_DIRECT) chosen by measurement per file system.
    records: measured choices remembered on the node across processes (a day, one boot).
    write_probe: the same for a synchronous save's writes (O_DIRECT or page cache + fsync).
    inflight: several read requests of one region in flight, completions reported in order.
    mapped: part of a region read through a mapping of the page cache (no copy of the rest).
    threads: save rules from the machine (files per rank, write path by rule), for
        torch_dist and local saves.
"""

from . import faults, mapped
from .buffers import ALIGN, ChunkBuffers, ImagePool, host_buffer
from .direct import (
    FileWriter,
    direct_allowed,
    pwrite_all,
    read_file,
    read_region,
    refuse_direct,
    reset_direct_fallbacks,
)
from .fileio import atomic_write, fsync_dir, read_capped
from .probe import cached, forget_probes, prefer_direct_reads
from .segments import StreamedFile, write_segments

__all__ = [
    "ALIGN",
    "ChunkBuffers",
    "FileWriter",
    "ImagePool",
    "StreamedFile",
    "atomic_write",
    "cached",
    "direct_allowed",
    "faults",
    "mapped",
    "forget_probes",
    "fsync_dir",
    "host_buffer",
    "prefer_direct_reads",
    "pwrite_all",
    "read_capped",
    "read_file",
    "read_region",
    "refuse_direct",
    "reset_direct_fallbacks",
    "write_segments",
]
