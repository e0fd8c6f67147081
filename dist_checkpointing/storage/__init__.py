"""The private I/O layer of the torch_dist backend and local checkpoints.

Files, bytes and host buffers only (it never imports `mapping`, `serialization` or
`strategies`): `direct` (file writes and reads), `segments` (files written from segments),
`buffers` (pooled host buffers), `fileio` (atomic and capped files), `objstore` and `msc`
(object stores), `faults` (the fault-injection seam every read and write consults).
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
