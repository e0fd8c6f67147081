"""Helpers that split sharded state dicts by leaf kind and rename sharded keys, with
megatron-core's names and signatures (`megatron.core.dist_checkpointing.utils`)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from ._types import ShardedStateDict, StateDict
from .dict_utils import dict_list_map_inplace, extract_matching_values
from .errors import CheckpointingException
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)

__all__ = [
    "zip_strict",
    "extract_sharded_tensors",
    "extract_sharded_tensors_and_factories",
    "extract_sharded_tensors_or_nonpersistent",
    "extract_sharded_base",
    "extract_nonpersistent",
    "add_prefix_for_sharding",
    "replace_prefix_for_sharding",
    "apply_prefix_mapping",
]

#: The leaves whose key the renaming helpers rewrite.
_KEYED = (ShardedTensor, ShardedTensorFactory, ShardedObject)


def zip_strict(*args: Iterable[Any]) -> Iterable[Tuple[Any, ...]]:
    """`zip` that raises `CheckpointingException` on iterables of different lengths."""
    lists: List[List[Any]] = [list(a) for a in args]
    lengths = [len(a) for a in lists]
    if len(set(lengths)) > 1:
        raise CheckpointingException(f"zip_strict got iterables of different lengths: {lengths}")
    return zip(*lists)


def _extractor(
    name: str, kinds: Tuple[type, ...], what: str
) -> Callable[[ShardedStateDict], Tuple[ShardedStateDict, StateDict]]:
    """Builds megatron's `extract_*` helper `name`: splits off the leaves of `kinds`."""

    def extract(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
        return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, kinds))

    extract.__name__ = extract.__qualname__ = name
    extract.__module__ = __name__
    extract.__doc__ = f"Splits a nested dict/list (unchanged) into ({what} leaves, the rest)."
    return extract


# megatron-core's names; one implementation, the kinds of leaf each one splits off
extract_sharded_tensors = _extractor("extract_sharded_tensors", (ShardedTensor,), "ShardedTensor")
extract_sharded_tensors_and_factories = _extractor(
    "extract_sharded_tensors_and_factories",
    (ShardedTensor, ShardedTensorFactory),
    "ShardedTensor and ShardedTensorFactory",
)
extract_sharded_tensors_or_nonpersistent = _extractor(
    "extract_sharded_tensors_or_nonpersistent",
    (ShardedTensor, ShardedTensorFactory, LocalNonpersistentObject),
    "ShardedTensor, ShardedTensorFactory and LocalNonpersistentObject",
)
extract_sharded_base = _extractor(
    "extract_sharded_base", (ShardedBase,), "sharded (any `ShardedBase`: tensor, object, factory)"
)
extract_nonpersistent = _extractor(
    "extract_nonpersistent", (LocalNonpersistentObject,), "LocalNonpersistentObject"
)


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepends `prefix` as is (e.g. `"decoder."`) to the key of every sharded leaf, in place."""

    def add(leaf: Any) -> Any:
        if isinstance(leaf, ShardedBase):
            leaf.key = f"{prefix}{leaf.key}"
        return leaf

    dict_list_map_inplace(add, sharded_state_dict)


def replace_prefix_for_sharding(
    sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str
) -> None:
    """Replaces `old_prefix` by `new_prefix` in the key of every keyed sharded leaf, in place.

    Raises:
        CheckpointingException: naming the first key without `old_prefix` (keys renamed
            before it stay renamed, as in megatron-core).
    """

    def replace(leaf: Any) -> Any:
        if isinstance(leaf, _KEYED):
            if not leaf.key.startswith(old_prefix):
                raise CheckpointingException(
                    f"Sharded key {leaf.key!r} does not start with prefix {old_prefix!r}"
                )
            leaf.key = new_prefix + leaf.key[len(old_prefix) :]
        return leaf

    dict_list_map_inplace(replace, sharded_state_dict)


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: Dict[str, str]) -> None:
    """Renames, in place, each keyed sharded leaf whose key starts with an old prefix of
    `prefix_map` (old -> new; the first match in the dict's order), leaving others alone."""

    def remap(leaf: Any) -> Any:
        if isinstance(leaf, _KEYED):
            old: Optional[str] = next((p for p in prefix_map if leaf.key.startswith(p)), None)
            if old is not None:
                leaf.key = prefix_map[old] + leaf.key[len(old) :]
        return leaf

    dict_list_map_inplace(remap, sharded_state_dict)
