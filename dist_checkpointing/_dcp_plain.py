"""Plain (non-sharded) values where stock PyTorch DCP looks for them.

`torch.distributed.checkpoint.save` stores every leaf of a state dict under its flat name
(`_fqn`): tensors as tensor items, anything else as a byte item holding `torch.save(value)`,
and records in `.metadata.planner_data` the path each flat name came from. Our checkpoints
keep the common state in `common.pt` (megatron-core reads it there) and, so that stock
`dcp.load` restores it too, the `torch_dist` backend also records each of its leaves as such
an item (`plain_items`). Reading a stock DCP checkpoint goes the other way: its byte items
are the common state (`unflatten`).

Trade-off taken: the common state is serialized twice (it is small next to the shards), and
a flat name shared by a plain value and a sharded key is refused rather than stored twice.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Tuple, Union

import torch

from ._fqn import fqn_of, iter_fqn_leaves
from .errors import CheckpointingException
from .mapping import ShardedObject, ShardedTensor

__all__ = [
    "PLAIN_ITEMS_KEY",
    "PlainItem",
    "plain_items",
    "check_no_collision",
    "unflatten",
]

#: the key under which rank 0 hands its plain items to the sharded save strategy, beside
#: the sharded state (not a valid state-dict key a user would choose)
PLAIN_ITEMS_KEY = "\x00dcp plain values"

DcpPath = Tuple[Union[str, int], ...]


@dataclass(frozen=True)
class PlainItem:
    """One plain value of the common state as DCP stores it.

    Attributes:
        fqn: its flat name (the key in `.metadata`).
        path: the path DCP records for it in `planner_data` (mapping keys as `str`, list
            positions as `int`, as `dcp.save` records them).
        data: the tensor (a tensor item) or `torch.save(value)` bytes (a byte item).
    """

    fqn: str
    path: DcpPath
    data: Union[torch.Tensor, bytes]


def _dcp_path(root: Mapping, path: Tuple[Any, ...]) -> DcpPath:
    """`path` as DCP records it: a step into a mapping as `str(key)`, into a list as `int`."""
    out: List[Union[str, int]] = []
    node: Any = root
    for step in path:
        out.append(str(step) if isinstance(node, Mapping) else int(step))
        node = node[step]
    return tuple(out)


def _serialize(value: Any) -> bytes:
    """A byte item's payload, as DCP writes it: `torch.save(value)` into a buffer."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def plain_items(common_state: Mapping) -> List[PlainItem]:
    """The DCP items of every leaf of `common_state`, in DCP's traversal order.

    Raises:
        CheckpointingException: two leaves share a flat name (e.g. keys `'a.b'` and
            `'a' -> 'b'`; DCP refuses such a state as well), naming it.
    """
    items: List[PlainItem] = []
    seen: Dict[str, DcpPath] = {}
    for path, value in iter_fqn_leaves(common_state):
        fqn = fqn_of(path)
        dcp_path = _dcp_path(common_state, path)
        if fqn in seen:
            raise CheckpointingException(
                f"Two plain values of the common state have the flat name {fqn!r} (paths "
                f"{seen[fqn]} and {dcp_path}): DCP stores each value under its flat name, so "
                "rename one of them"
            )
        seen[fqn] = dcp_path
        if type(value) in (torch.Tensor, torch.nn.Parameter):
            data: Union[torch.Tensor, bytes] = value.detach()
        else:
            data = _serialize(value)
        items.append(PlainItem(fqn, dcp_path, data))
    return items


def check_no_collision(items: Iterable[PlainItem], sharded_leaves: Iterable[Any]) -> None:
    """Raises if a plain item's flat name is also the key of a sharded leaf.

    Raises:
        CheckpointingException: naming the key.
    """
    keys = set()
    for sh in sharded_leaves:
        if isinstance(sh, ShardedTensor):
            keys.add(sh.key)
        elif isinstance(sh, ShardedObject):
            keys.add(sh.unique_key)
    for item in items:
        if item.fqn in keys:
            raise CheckpointingException(
                f"The plain value at {item.path} of the common state has the flat name "
                f"{item.fqn!r}, which is also the key of a sharded tensor or object: DCP "
                "readers find both under that one name. Rename the key or move the value"
            )


def _set_path(root: Dict[Any, Any], path: DcpPath, value: Any) -> None:
    """Puts `value` at `path` under `root`, creating dicts (and lists for `int` steps)."""
    node: Any = root
    for i, step in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list):
            if not isinstance(step, int) or step < 0:
                raise CheckpointingException(f"planner path {path}: {step!r} is not a position")
            node.extend([None] * (step + 1 - len(node)))
            if last:
                node[step] = value
            elif node[step] is None:
                node[step] = [] if isinstance(path[i + 1], int) else {}
        elif isinstance(node, dict):
            if last:
                node[step] = value
            elif step not in node:
                node[step] = [] if isinstance(path[i + 1], int) else {}
        else:
            raise CheckpointingException(f"planner path {path} crosses a value at {step!r}")
        if not last:
            node = node[step]


def unflatten(values: Mapping[str, Any], planner_data: Any) -> Dict[Any, Any]:
    """The nested state of `{flat name: value}`, following `planner_data` (DCP's
    `{flat name: path}`) where it names a path; other values stay under their flat name.

    Raises:
        CheckpointingException: a malformed path (crossing another value).
    """
    mapping = planner_data if isinstance(planner_data, Mapping) else {}
    out: Dict[Any, Any] = {}
    for fqn, value in values.items():
        path = mapping.get(fqn)
        if (
            isinstance(path, (tuple, list))
            and path
            and all(isinstance(p, (str, int)) for p in path)
        ):
            _set_path(out, tuple(path), value)
        else:
            out[fqn] = value
    return out
