"""The 'torch_dist' backend, version 1 (PyTorch DCP's on-disk format): its public import path.

The implementation lives in the `torch_dist` package (see its docstring for who does what);
this module keeps the names users import from `dist_checkpointing.strategies.torch`, the
names of `torch_dist.__all__` (the one list of them).
"""

from . import torch_dist as _torch_dist
from .torch_dist import *  # noqa: F403  (the names of torch_dist.__all__)

__all__ = list(_torch_dist.__all__)
