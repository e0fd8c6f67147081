"""Helpers that walk, split, merge and compare nested dict/list trees (no sharding here)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Iterator, List, Tuple, Type, TypeVar, Union

import torch

__all__ = [
    "extract_matching_values",
    "diff",
    "nested_values",
    "nested_items_iter",
    "dict_list_map_inplace",
    "dict_list_map_outplace",
    "merge",
    "map_reduce",
]

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")
KeyPath = Tuple[Union[str, int], ...]


def extract_matching_values(
    x: Any, predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> Tuple[Any, Any]:
    """Splits a nested dict or list (else ValueError) into the leaves that match `predicate`
    and those that don't.

    Returns:
        (matching, non_matching) trees with the structure of `x` (empty sub-containers go to
        non_matching); `return_lists_as_dicts` keeps list positions as `{index: value}` dicts
        instead of compacted lists.
    """
    if not isinstance(x, (dict, list)):
        raise ValueError(f"Expected a dict or a list, got {type(x).__name__}")
    items: Iterable[Tuple[Any, Any]] = x.items() if isinstance(x, dict) else enumerate(x)
    matching: List[Tuple[Any, Any]] = []
    non_matching: List[Tuple[Any, Any]] = []
    for k, v in items:
        if isinstance(v, (dict, list)):
            sub_match, sub_rest = extract_matching_values(v, predicate, return_lists_as_dicts)
            if sub_match:
                matching.append((k, sub_match))
            if sub_rest or not v:
                non_matching.append((k, sub_rest))
        elif predicate(v):
            matching.append((k, v))
        else:
            non_matching.append((k, v))
    if isinstance(x, dict) or return_lists_as_dicts:
        return dict(matching), dict(non_matching)
    return [v for _, v in matching], [v for _, v in non_matching]


def diff(x1: Any, x2: Any, prefix: KeyPath = ()) -> Tuple[List[KeyPath], List[KeyPath], List[Any]]:
    """Compares two nested trees.

    Returns:
        (only_left, only_right, mismatch): key paths present only in `x1`, only in `x2`, and
        `(path, type_x1, type_x2)` entries for leaves whose values differ. Tensors are
        compared by value.
    """
    only_left: List[KeyPath] = []
    only_right: List[KeyPath] = []
    mismatch: List[Any] = []
    children: List[Tuple[Any, Any, Any]] = []
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        only_right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        children = [(k, x1[k], x2[k]) for k in x1.keys() & x2.keys()]
    elif isinstance(x1, list) and isinstance(x2, list):
        only_left = [prefix + (i,) for i in range(len(x2), len(x1))]
        only_right = [prefix + (i,) for i in range(len(x1), len(x2))]
        children = [(i, v1, v2) for i, (v1, v2) in enumerate(zip(x1, x2))]
    else:
        if isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor):
            same_kind = x1.shape == x2.shape and x1.dtype == x2.dtype
            equal = same_kind and bool(torch.equal(x1.cpu(), x2.cpu()))
        elif isinstance(x1, torch.Tensor) or isinstance(x2, torch.Tensor):
            equal = False
        else:
            try:
                equal = bool(x1 == x2)
            except Exception:  # objects whose __eq__ is not a plain bool (e.g. arrays)
                equal = False
        if not equal:
            mismatch.append((prefix, type(x1), type(x2)))
    for k, v1, v2 in children:
        left, right, mis = diff(v1, v2, prefix + (k,))
        only_left += left
        only_right += right
        mismatch += mis
    return only_left, only_right, mismatch


def nested_items_iter(x: Any) -> Iterator[Tuple[Any, Any]]:
    """Yields `(key, leaf)` for every leaf of a nested dict/list (key = innermost key)."""
    items: Iterable[Tuple[Any, Any]] = x.items() if isinstance(x, dict) else enumerate(x)
    for k, v in items:
        if isinstance(v, (dict, list)):
            yield from nested_items_iter(v)
        else:
            yield k, v


def nested_values(x: Any) -> Iterator[Any]:
    """Yields every leaf of a nested dict/list, depth first, in insertion order."""
    return (v for _, v in nested_items_iter(x))


def dict_list_map_inplace(f: Callable[[Any], Any], x: Any) -> Any:
    """Replaces every leaf `v` of a nested dict/list with `f(v)` in place; returns `x` (or
    `f(x)` when `x` is a leaf)."""
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = dict_list_map_inplace(f, v)
    elif isinstance(x, list):
        x[:] = [dict_list_map_inplace(f, v) for v in x]
    else:
        return f(x)
    return x


def dict_list_map_outplace(f: Callable[[Any], Any], x: Any) -> Any:
    """Returns a new tree with every leaf `v` replaced by `f(v)`; `x` is left unchanged."""
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


def merge(x1: Any, x2: Any, key: KeyPath = ()) -> Any:
    """Merges `x2` into `x1` in place and returns `x1`: dicts key by key, equal-length lists
    element by element, a dict with int keys into a list by index.

    Raises:
        ValueError: on lists of different lengths or two leaves at the same key path.
    """
    for k, v2 in _merge_pairs(x1, x2, key, ValueError):
        if isinstance(x1, dict) and k not in x1:
            x1[k] = v2
        else:
            x1[k] = merge(x1[k], v2, key + (k,))
    return x1


def _merge_pairs(
    x1: Any, x2: Any, key: KeyPath, error: Type[Exception]
) -> Iterator[Tuple[Any, Any]]:
    """Yields the `(key, value)` pairs of `x2` to merge into `x1`: by key into a dict, by
    index into a list (from an equal-length list or int-keyed dict); else raises `error`."""
    if isinstance(x1, dict) and isinstance(x2, dict):
        yield from x2.items()
        return
    if not isinstance(x1, list) or not isinstance(x2, (dict, list)):
        raise error(
            f"Conflicting values at key path {key}: {type(x1).__name__} and {type(x2).__name__}"
        )
    if isinstance(x2, list) and len(x1) != len(x2):
        raise error(f"Cannot merge lists of lengths {len(x1)} and {len(x2)} at key path {key}")
    for k, v2 in x2.items() if isinstance(x2, dict) else enumerate(x2):
        if not isinstance(k, int) or not 0 <= k < len(x1):
            raise error(f"Cannot merge dict key {k!r} into a list at key path {key}")
        yield k, v2


def map_reduce(
    xs: Iterable[T],
    key_fn: Callable[[T], K] = lambda x: x,  # type: ignore[assignment,return-value]
    value_fn: Callable[[T], V] = lambda x: x,  # type: ignore[assignment,return-value]
    reduce_fn: Callable[[List[V]], Any] = lambda x: x,
) -> Dict[K, Any]:
    """Returns `{key_fn(x): reduce_fn([value_fn(x) for x in group])}`, keys in first-seen order."""
    groups: Dict[K, List[V]] = {}
    for x in xs:
        groups.setdefault(key_fn(x), []).append(value_fn(x))
    return {k: reduce_fn(v) for k, v in groups.items()}
