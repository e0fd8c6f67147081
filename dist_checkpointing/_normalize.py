"""The one door: every kind of leaf a user hands to `save` or `load` becomes ours here.

`for_save` and `for_load` take the caller's tree (not modified: containers are copied) and
return one whose sharded leaves are only this package's classes:
- objects with DCP's `Stateful` protocol (`state_dict()` / `load_state_dict()`) are replaced
  by their state dict (on load, `restore_statefuls` hands them what was loaded);
- `DTensor`s become factories of ShardedTensors named by their DCP flat name (`dtensor`);
- megatron-core's objects are converted (`megatron_compat`), flat shards expanded (`_flat`),
  quantized tensor subclasses split into inner tensors (`quantized`);
- a leaf that still cannot be placed (a tensor subclass we do not know, a DTensor inside a
  tuple) raises a `CheckpointingException` naming it. The callers agree on that error across
  ranks before any collective, so it is raised on every rank instead of hanging one.

Also here: the pieces of the plain-value rules (digests of plain tensors compared across
ranks, requested plain values checked and filled after a load).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable, Collection, Dict, Iterator, List, Optional, Set, Tuple

import torch

from ._dist import get_rank
from ._flat import expand_flat_shards
from ._fqn import fqn_of, iter_fqn_leaves
from .dict_utils import extract_matching_values
from .dtensor import dtensor_factory, fill_from_full, is_dtensor
from .errors import CheckpointingException
from .mapping import LocalNonpersistentObject, ShardedBase, ShardedTensor
from .megatron_compat import convert_sharded_state_dict
from .quantized import expand_quantized

__all__ = [
    "Path",
    "for_load",
    "for_save",
    "missing_plain_keys",
    "fill_plain",
    "plain_tensor_digests",
    "restore_statefuls",
    "TensorDigest",
]

logger = logging.getLogger(__name__)

Path = Tuple[Any, ...]
#: Stateful objects found in a request, by the path their state dict took
Statefuls = List[Tuple[Path, Any]]


def _copy_containers(tree: Any) -> Any:
    """Copies the dict/list containers (not the leaves), dropping empty ones as the
    pipeline always has (a rank without pieces of a list must not store an empty one)."""
    if isinstance(tree, (dict, list)):
        return extract_matching_values(tree, lambda _: True)[0]
    return tree


def _is_stateful(x: Any) -> bool:
    """DCP's `Stateful` protocol: callable `state_dict` and `load_state_dict` (tensors and
    our own leaves are never taken for one)."""
    if isinstance(x, (torch.Tensor, ShardedBase, LocalNonpersistentObject, dict, list, type)):
        return False
    return callable(getattr(x, "state_dict", None)) and callable(
        getattr(x, "load_state_dict", None)
    )


def _expand_statefuls(tree: Any, path: Path, found: Statefuls) -> Any:
    """Replaces Stateful objects by copies of their state dicts, recording them in `found`."""
    if _is_stateful(tree):
        found.append((path, tree))
        return _expand_statefuls(_copy_containers(tree.state_dict()), path, found)
    if isinstance(tree, dict):
        for k, v in tree.items():
            tree[k] = _expand_statefuls(v, (*path, k), found)
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            tree[i] = _expand_statefuls(v, (*path, i), found)
    return tree


def _set(tree: Any, path: Path, value: Any) -> None:
    for step in path[:-1]:
        tree = tree[step]
    tree[path[-1]] = value


def _get(tree: Any, path: Path) -> Any:
    for step in path:
        tree = tree[step]
    return tree


def _dtensors_to_factories(tree: Any, common: Optional[Any] = None) -> None:
    """Replaces each DTensor (at a position DCP names) by a factory of its pieces, or by a
    non-persistent value on ranks outside its mesh. With `common` (a checkpoint's loaded
    common state), a DTensor in a dict whose place there holds a plain tensor is filled from
    it, put in its place in `common` and left out of the request."""
    root = tree if isinstance(tree, dict) else dict(enumerate(tree))
    found = [(p, v) for p, v in iter_fqn_leaves(root) if is_dtensor(v)]
    for path, dt in found:
        parent = _get(tree, path[:-1])
        stored = _get(common, path) if common is not None and _present(common, path) else None
        if isinstance(parent, dict) and isinstance(stored, torch.Tensor) and not is_dtensor(stored):
            fill_from_full(fqn_of(path), dt, stored)
            _set(common, path, dt)
            del parent[path[-1]]
            continue
        if isinstance(parent, list) and any(_plain_entry(v) for v in parent):
            raise CheckpointingException(
                f"The list at {fqn_of(path[:-1])!r} holds DTensors and plain values: the plain "
                "values would be stored without their positions. Put the DTensors and the "
                "plain values in separate lists, or in a dict"
            )
        factory = dtensor_factory(fqn_of(path), dt)
        _set(tree, path, factory if factory is not None else LocalNonpersistentObject(dt))


def _plain_entry(value: Any) -> bool:
    """Whether a list entry would go to the common state (not sharded, not a container)."""
    return not (is_dtensor(value) or isinstance(value, (ShardedBase, dict, list)))


def _leaves_with_paths(tree: Any, path: Path = (), tuples: bool = True) -> Iterator[Any]:
    """`(path, leaf)` of every leaf of nested dicts and lists, and with `tuples` of tuples
    (saved whole, so nothing unplaceable may hide in them either)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves_with_paths(v, (*path, k), tuples)
    elif isinstance(tree, list) or (tuples and isinstance(tree, tuple)):
        for i, v in enumerate(tree):
            yield from _leaves_with_paths(v, (*path, i), tuples)
    else:
        yield path, tree


def _check_placeable(tree: Any) -> None:
    """Raises on a tensor subclass left among the plain values (it cannot be placed)."""
    for path, leaf in _leaves_with_paths(tree):
        if not isinstance(leaf, torch.Tensor) or type(leaf) in (torch.Tensor, torch.nn.Parameter):
            continue
        where = fqn_of(path) or "<root>"
        kind = f"{type(leaf).__module__}.{type(leaf).__qualname__}"
        if is_dtensor(leaf):
            hint = "DTensors are placed in dicts and lists only: put it in a list or dict"
        else:
            hint = (
                "it would be pickled as common state and compared across ranks with its own "
                "operators: wrap its local data in a ShardedTensor (quantized subclasses are "
                "supported there), convert it to a plain tensor, or wrap it in "
                "LocalNonpersistentObject to leave it out"
            )
        raise CheckpointingException(f"Cannot place {where!r}, a {kind} tensor subclass: {hint}")


def _normalize(tree: Any, statefuls: Statefuls, common: Optional[Any] = None) -> Any:
    sd = _expand_statefuls(_copy_containers(tree), (), statefuls)
    if isinstance(sd, (dict, list)):
        _dtensors_to_factories(sd, common)
    return expand_flat_shards(convert_sharded_state_dict(sd))


def for_save(tree: Any) -> Any:
    """The door for a state to save: a copy of `tree` in this package's leaves only.

    Raises:
        CheckpointingException: a leaf that cannot be placed, named (see the module doc).
    """
    sd = _normalize(tree, [])
    expand_quantized(sd)
    if isinstance(sd, (dict, list)):
        _check_placeable(extract_matching_values(sd, lambda x: isinstance(x, ShardedBase))[1])
    return sd


def for_load(
    tree: Any,
    stored: Optional[Dict[str, Any]],
    common: Optional[Any] = None,
    stored_tensor_keys: Optional[Callable[[], Collection[str]]] = None,
) -> Tuple[Any, Statefuls, Optional[CheckpointingException]]:
    """The door for a load request: `(copy of tree in our leaves, Stateful objects found,
    error)`; the error (a leaf that cannot be placed) is returned, to be agreed on. With
    `common` (the checkpoint's common state), DTensors stored as plain tensors are filled
    from them there (see `_dtensors_to_factories`), and a plain tensor the common state lacks
    is read whole from the tensor the checkpoint stores under its flat name, if
    `stored_tensor_keys()` (called only then) names one: stock DCP stores plain tensors, such
    as Adam's `step`, as tensor items."""
    statefuls: Statefuls = []
    try:
        sd = _normalize(tree, statefuls, common)
    except CheckpointingException as e:
        return {}, statefuls, e
    if common is not None and stored_tensor_keys is not None and isinstance(sd, dict):
        _plain_tensors_from_items(sd, common, stored_tensor_keys)
    try:
        expand_quantized(sd, stored)
        if isinstance(sd, (dict, list)):
            plain = extract_matching_values(
                sd, lambda x: isinstance(x, (ShardedBase, LocalNonpersistentObject))
            )[1]
            _check_placeable(plain)
    except CheckpointingException as e:
        return sd, statefuls, e
    return sd, statefuls, None


def _plain_tensors_from_items(
    sd: Dict[Any, Any], common: Any, stored_tensor_keys: Callable[[], Collection[str]]
) -> None:
    """Requests each plain tensor of `sd` that `common` lacks as the whole stored tensor of
    its flat name, filled in place (see `for_load`)."""
    keys: Optional[Collection[str]] = None
    for path, leaf in list(iter_fqn_leaves(sd)):
        if not isinstance(leaf, torch.Tensor) or is_dtensor(leaf) or _present(common, path):
            continue
        if keys is None:
            keys = set(stored_tensor_keys())
        name = fqn_of(path)
        if name in keys:
            _set(sd, path, ShardedTensor.from_rank_offsets(name, leaf, replica_id=get_rank()))


def restore_statefuls(result: Any, statefuls: Statefuls) -> None:
    """Hands each Stateful object of a load request its loaded state dict
    (`load_state_dict`) and puts the object back in its place in `result`, innermost
    first."""
    for path, obj in reversed(statefuls):
        # absent only when its state dict was empty: a missing key raised before this
        loaded = (_get(result, path) if _present(result, path) else {}) if path else result
        obj.load_state_dict(loaded)
        if path:
            _set(result, path, obj)


def _present(tree: Any, path: Path) -> bool:
    for step in path:
        if isinstance(tree, dict) and step in tree:
            tree = tree[step]
        elif isinstance(tree, list) and isinstance(step, int) and 0 <= step < len(tree):
            tree = tree[step]
        else:
            return False
    return True


def missing_plain_keys(requested: Any, result: Any) -> Set[str]:
    """Flat names of the plain values in `requested` that `result` does not hold."""
    if not isinstance(requested, (dict, list)):
        return set()
    return {
        fqn_of(path)
        for path, _ in _leaves_with_paths(requested, tuples=False)
        if not _present(result, path)
    }


def fill_plain(requested: Any, result: Any) -> None:
    """Copies each loaded plain tensor into the request's tensor at the same place when
    dtype and shape agree (as DCP loads in place) and puts the request's tensor in `result`."""
    if not isinstance(requested, (dict, list)):
        return
    for path, want in _leaves_with_paths(requested, tuples=False):
        if type(want) not in (torch.Tensor, torch.nn.Parameter) or not _present(result, path):
            continue
        got = _get(result, path)
        if not isinstance(got, torch.Tensor) or got is want:
            continue
        if got.dtype == want.dtype and got.shape == want.shape:
            with torch.no_grad():
                want.detach().copy_(got)
            _set(result, path, want)


def _digest(t: torch.Tensor) -> str:
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    h = hashlib.blake2b(flat.numpy().tobytes(), digest_size=16).hexdigest()
    return f"tensor {t.dtype} {tuple(t.shape)} {h}"


def plain_tensor_digests(tree: Any) -> Any:
    """A copy of plain-value tree `tree` with every tensor replaced by a digest string of
    its dtype, shape and bytes (a plain CPU copy): comparable across ranks without running
    any tensor operation that could be a collective."""
    if isinstance(tree, dict):
        return {k: plain_tensor_digests(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [plain_tensor_digests(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(plain_tensor_digests(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        return TensorDigest(_digest(tree))
    return tree


class TensorDigest(str):
    """A digest standing for a tensor (so differences can name tensors)."""
