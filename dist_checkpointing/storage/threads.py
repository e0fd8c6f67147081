"""How many files (one writer thread each) a rank's synchronous save writes: one rule for
the torch_dist and local backends, from what the machine has.

    cores per local rank  = the cores this process may run on, divided by the ranks on this
                            node (LOCAL_WORLD_SIZE, else the CUDA device count when the
                            sources are on CUDA, else the world size), unless the process
                            is already bound to a subset of the cores (then that subset);
                            a container's CPU quota (cgroup v2 `cpu.max`) caps the cores
    files per rank        = 1                                   if cores per local rank < 4
                          = min(4, cores per local rank // 2)   for CUDA sources
                          = min(4, cores per local rank // 4)   for CPU sources

Why: every file is a thread that copies and writes; CUDA sources get more because one
thread waits on the device-to-host copies, not the disk.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .. import _dist

__all__ = ["cores_per_local_rank", "default_file_count", "local_ranks"]

_MAX_FILES = 4


def local_ranks(cuda_sources: bool) -> int:
    """Ranks on this node (see the module docstring)."""
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    if cuda_sources and torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return min(torch.cuda.device_count(), _dist.get_world_size())
    return _dist.get_world_size()


def _cpu_quota(path: str = "/sys/fs/cgroup/cpu.max") -> Optional[float]:
    """Cores allowed by the cgroup v2 CPU quota ("max" or unreadable: None)."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else max(1.0, int(quota) / int(period))
    except (OSError, ValueError):
        return None


def cores_per_local_rank(
    cuda_sources: bool, cpu_count: Optional[int] = None, quota: Optional[float] = None
) -> float:
    """Cores available to this rank (see the module docstring).

    Args:
        cpu_count: the machine's cores (default: `os.cpu_count()`).
        quota: the container's CPU quota in cores (default: read from the cgroup).
    """
    total = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    try:
        mine = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        mine = total
    limit = quota if quota is not None else _cpu_quota()
    if mine < total:  # bound to its own cores by the launcher
        return float(min(mine, limit)) if limit else float(mine)
    if limit is not None and limit < total:  # the container's share of the node
        total = int(limit)
    return total / max(1, local_ranks(cuda_sources))


def default_file_count(cuda_sources: bool, cores: Optional[float] = None) -> int:
    """Files per rank for a sync save (the rule in the module docstring); `cores`: cores
    per local rank (default: `cores_per_local_rank`)."""
    c = cores_per_local_rank(cuda_sources) if cores is None else cores
    if c < 4:
        return 1
    return max(1, min(_MAX_FILES, int(c // (2 if cuda_sources else 4))))
