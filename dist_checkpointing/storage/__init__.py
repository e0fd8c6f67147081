"""The I/O layer shared by the torch_dist backend and local checkpoints (private).

It knows files, bytes and host buffers, nothing of sharded state dicts or strategies (it
never imports `mapping`, `serialization` or `strategies`). Its interface:

    direct: `FileWriter` (O_DIRECT, buffered where refused: one registry of refusing
        directories), `read_region` and `read_file` (through the page cache).
    segments: files written from byte segments (`write_segments`, `StreamedFile`).
    buffers: aligned, pooled host buffers, page-locked for CUDA sources.
    fileio: atomic replace and fsync helpers.
    faults: the fault-injection seam every read and write consults (tests).
"""

from . import faults, objstore
from .buffers import ALIGN, ChunkBuffers, ImagePool
from .direct import FileWriter, pwrite_all, read_file, read_region, reset_direct_fallbacks
from .fileio import atomic_write, fsync_dir, read_capped
from .segments import StreamedFile, write_segments

__all__ = [
    "ALIGN",
    "ChunkBuffers",
    "FileWriter",
    "ImagePool",
    "StreamedFile",
    "atomic_write",
    "faults",
    "objstore",
    "fsync_dir",
    "pwrite_all",
    "read_capped",
    "read_file",
    "read_region",
    "reset_direct_fallbacks",
    "write_segments",
]
