"""Flattened names of state-dict leaves, spelled as PyTorch DCP spells them.

DCP stores every leaf of a nested state dict under one flat name: the keys of its path
joined by '.'. Mappings are always descended; a list is descended only when it holds a
tensor or a container that does (so `param_groups[0]["params"]`, a list of names, is one
leaf); tuples and other values are leaves. Leaves we name (DTensors, plain values recorded
for stock DCP readers) use the same names, so a checkpoint we write and one `dcp.save`
writes agree on where each value lives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator, Tuple, Union

import torch

__all__ = ["PathItem", "fqn_of", "iter_fqn_leaves"]

#: one step of a path: a mapping key (as the mapping holds it) or a list index
PathItem = Union[str, int, Any]


def _is_terminal(value: Any) -> bool:
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, (Mapping, list)) and not _is_terminal(entry):
            return False
        if isinstance(entry, torch.Tensor):
            return False
    return True


def fqn_of(path: Tuple[PathItem, ...]) -> str:
    """The flat name of the leaf at `path` (its steps joined by '.')."""
    return ".".join(map(str, path))


def iter_fqn_leaves(state_dict: Mapping) -> Iterator[Tuple[Tuple[PathItem, ...], Any]]:
    """Yields `(path, leaf)` for every leaf of `state_dict` in DCP's traversal order.

    Paths hold the mapping keys as the mappings hold them (so they can be followed back)
    and list positions as ints; `fqn_of(path)` is the flat name. An empty mapping yields
    nothing, as in DCP.
    """

    def walk(path: Tuple[PathItem, ...], value: Any) -> Iterator[Tuple[Tuple[PathItem, ...], Any]]:
        if isinstance(value, Mapping):
            for k, v in value.items():
                yield from walk((*path, k), v)
        elif _is_terminal(value):
            yield path, value
        else:
            for i, v in enumerate(value):
                yield from walk((*path, i), v)

    for key, value in state_dict.items():
        yield from walk((key,), value)
