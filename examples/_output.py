"""Where the examples write: the directory given on the command line, or a temporary one."""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist


def output_dir(name: str) -> Path:
    """Collective: `sys.argv[1]` when given (kept), else a new temporary directory that rank 0
    creates, announces and removes at exit (one machine: the examples run on one)."""
    if len(sys.argv) > 1:
        return Path(sys.argv[1])
    made = [tempfile.mkdtemp(prefix=f"dist_ckpt_{name}_") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(made)
    if dist.get_rank() == 0:
        print(f"writing under {made[0]} (temporary, removed at exit; pass DIR to keep the files)")
        atexit.register(shutil.rmtree, made[0], True)
    return Path(made[0])
