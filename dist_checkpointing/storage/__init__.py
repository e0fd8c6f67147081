"""The I/O layer shared by the torch_dist backend and local checkpoints (private).

It knows files, bytes and host buffers, nothing of sharded state dicts or strategies (it
never imports `mapping`, `serialization` or `strategies`). Its interface:

    direct: `FileWriter` (O_DIRECT, buffered where refused: one registry of refusing
        directories), `read_region` and `read_file` (through the page cache).
    segments: files written from byte segments (`write_segments`, `StreamedFile`).
    buffers: aligned, pooled host buffers, page-locked for CUDA sources.
    fileio: atomic replace, capped reads and fsync helpers (`atomic_write`, `read_capped`).
    faults: the fault-injection seam every read and write consults (tests).
"""

from . import faults, objstore
from .buffers import ALIGN, ChunkBuffers, ImagePool
from .direct import FileWriter, read_file, read_region, reset_direct_fallbacks
from .fileio import fsync_dir
from .segments import StreamedFile, write_segments

__all__ = [
    "ALIGN",
    "ChunkBuffers",
    "FileWriter",
    "ImagePool",
    "StreamedFile",
    "faults",
    "objstore",
    "fsync_dir",
    "read_file",
    "read_region",
    "reset_direct_fallbacks",
    "write_segments",
]
