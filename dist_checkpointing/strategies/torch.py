"""The public import path of the 'torch_dist' backend (implemented in `torch_dist`)."""

from . import torch_dist as _torch_dist
from .torch_dist import *  # noqa: F403  (the names of torch_dist.__all__)

__all__ = list(_torch_dist.__all__)
