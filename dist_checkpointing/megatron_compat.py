"""Megatron-Core interoperability: entry points convert megatron-core's (0.14-0.19) mapping
objects to ours (`convert_sharded_state_dict`, recognising them without importing megatron),
and `install()` makes `megatron.core.dist_checkpointing` resolve to this package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from typing import Any, Callable, List, Optional, Sequence

import torch

from .errors import CheckpointingException, UnsupportedShardedObjectError
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)

__all__ = [
    "MEGATRON_PACKAGE",
    "UnsupportedShardedObjectError",
    "is_megatron_object",
    "looks_sharded",
    "convert_object",
    "convert_sharded_state_dict",
    "install",
    "uninstall",
    "is_installed",
]

logger = logging.getLogger(__name__)

#: The module path that `install()` redirects to this package.
MEGATRON_PACKAGE = "megatron.core.dist_checkpointing"
_OUR_PACKAGE = __name__.rsplit(".", 1)[0]

#: Fields each megatron class must have for us to convert it (0.14-0.19 all have these).
_FIELDS = {
    "ShardedTensor": (
        *("key", "data", "dtype", "local_shape", "global_shape", "global_offset"),
        *("axis_fragmentations", "replica_id", "prepend_axis_num", "allow_shape_mismatch"),
    ),
    "ShardedObject": ("key", "data", "global_shape", "global_offset", "replica_id"),
    "ShardedTensorFactory": ("key", "data", "build_fn", "merge_fn", "replica_id"),
    "LocalNonpersistentObject": ("obj",),
}
#: Attribute sets that mark an object as a sharded leaf of some library (duck typing).
_SHARDED_SIGNATURES = (
    ("key", "replica_id", "global_shape"),
    ("key", "replica_id", "build_fn"),
    ("key", "global_offset", "global_shape"),
)
_OURS = (ShardedBase, LocalNonpersistentObject)


def is_megatron_object(obj: Any) -> bool:
    """Whether `obj` is an instance of a class defined in megatron-core's dist_checkpointing."""
    return _target(getattr(type(obj), "__module__", "") or "") is not None


def looks_sharded(obj: Any) -> bool:
    """Whether `obj` is, or looks like, a sharded leaf (ours, megatron's or a look-alike)."""
    if isinstance(obj, _OURS) or is_megatron_object(obj):
        return True
    if isinstance(obj, (torch.Tensor, str, bytes, int, float, bool, dict, list, tuple)):
        return False
    return any(all(hasattr(obj, a) for a in sig) for sig in _SHARDED_SIGNATURES)


def _unsupported(obj: Any, where: str, why: str) -> UnsupportedShardedObjectError:
    return UnsupportedShardedObjectError(
        f"{where}: {type(obj).__module__}.{type(obj).__qualname__} looks like a sharded "
        f"object but cannot be handled ({why}); it is not saved as common state, because "
        "that would pickle a tensor shard"
    )


def _build_fn_converting(build_fn: Callable[..., Any], key: str) -> Callable[..., Any]:
    def build(*args: Any) -> Any:
        return convert_sharded_state_dict(build_fn(*args), (f"<built by factory {key!r}>",))

    return build


def _unprepended(obj: Any) -> Any:
    """`obj.data` without the size-1 prepended axes that megatron's own save reshapes it to
    in place (a view, so loads still land in the caller's tensor)."""
    data, local = obj.data, tuple(obj.local_shape)
    prepended = (1,) * int(obj.prepend_axis_num) + local
    if isinstance(data, torch.Tensor) and obj.prepend_axis_num and tuple(data.shape) == prepended:
        return data.view(local)
    return data


def convert_object(obj: Any, where: str = "state dict leaf") -> Any:
    """Converts one megatron-core mapping object into ours sharing its data (others are
    returned unchanged); `where` (the leaf's key path) and the key go in messages.

    Raises:
        UnsupportedShardedObjectError: a megatron object of an unknown class or missing fields.
    """
    if not is_megatron_object(obj):
        return obj
    name = type(obj).__name__
    fields = _FIELDS.get(name)
    if fields is None:
        raise _unsupported(obj, where, f"unknown megatron-core class {name}")
    missing = [f for f in fields if not hasattr(obj, f)]
    if missing:
        raise _unsupported(obj, where, f"missing fields {missing}")
    if name == "LocalNonpersistentObject":
        return LocalNonpersistentObject(obj.obj)
    key = obj.key
    where = f"{where} (key {key!r})"
    flattened_range = getattr(obj, "flattened_range", None)  # megatron <= 0.13 flat shards
    try:
        if name == "ShardedTensor":
            fragm = None if obj.axis_fragmentations is None else tuple(obj.axis_fragmentations)
            shape = tuple(obj.local_shape), tuple(obj.global_shape), tuple(obj.global_offset), fragm
            meta = (obj.replica_id, obj.prepend_axis_num, obj.allow_shape_mismatch, flattened_range)
            return ShardedTensor(key, _unprepended(obj), obj.dtype, *shape, *meta)
        if name == "ShardedObject":
            return ShardedObject(
                key, obj.data, tuple(obj.global_shape), tuple(obj.global_offset), obj.replica_id
            )
        return ShardedTensorFactory(
            key, obj.data, _build_fn_converting(obj.build_fn, key), obj.merge_fn, obj.replica_id
        )
    except CheckpointingException as e:
        raise CheckpointingException(f"{where}: invalid megatron-core {name}: {e}") from e


def _has_sharded(x: Any) -> bool:
    if isinstance(x, (dict, list, tuple)):
        return any(_has_sharded(v) for v in (x.values() if isinstance(x, dict) else x))
    return looks_sharded(x)


def convert_sharded_state_dict(sharded_state_dict: Any, path: Sequence[Any] = ()) -> Any:
    """Replaces every megatron-core mapping object in a tree by ours, IN PLACE (entry points
    call it on a shallow copy of the caller's tree).

    Returns the tree (or converted leaf); `path` is its key path, for messages.

    Raises:
        UnsupportedShardedObjectError: a leaf looks sharded but cannot be handled.
        CheckpointingException: a megatron object whose metadata is invalid.
    """
    x, path = sharded_state_dict, tuple(path)
    if isinstance(x, (dict, list)):
        for k, v in x.items() if isinstance(x, dict) else enumerate(x):
            x[k] = convert_sharded_state_dict(v, path + (k,))
        return x
    where = "/".join(map(str, path)) or "<root>"
    if isinstance(x, tuple):
        # tuples are saved whole as common state: nothing sharded may hide in them
        for i, v in enumerate(x):
            if _has_sharded(v):
                raise _unsupported(v, f"{where}[{i}]", "sharded leaves inside a tuple")
        return x
    if isinstance(x, _OURS):
        return x
    if is_megatron_object(x):
        return convert_object(x, where)
    if looks_sharded(x):
        why = "not a ShardedTensor/ShardedObject/factory of ours or of megatron-core 0.14-0.19"
        raise _unsupported(x, where, why)
    return x


def _target(fullname: str) -> Optional[str]:
    """Our module for `fullname` if it is megatron's package or one of its submodules."""
    if fullname == MEGATRON_PACKAGE or fullname.startswith(MEGATRON_PACKAGE + "."):
        return _OUR_PACKAGE + fullname[len(MEGATRON_PACKAGE) :]
    return None


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads `megatron.core.dist_checkpointing[.X]` as `dist_checkpointing[.X]`."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Any = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        ours = _target(fullname)
        if ours is None or importlib.util.find_spec(ours) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        # a placeholder: the import system stamps the alias spec on it, not on our module
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        # the import system returns whatever sys.modules holds under the name afterwards
        sys.modules[module.__name__] = importlib.import_module(str(_target(module.__name__)))


_finder: Optional[_AliasFinder] = None


def is_installed() -> bool:
    """Whether `install()` is in effect."""
    return _finder is not None and _finder in sys.meta_path


def install() -> None:
    """Makes `megatron.core.dist_checkpointing` and its submodules resolve to this package.

    Call it before anything imports `megatron.core` (which must be installed). A submodule
    we lack (e.g. `strategies.zarr`) then raises ModuleNotFoundError. Idempotent.

    Raises:
        CheckpointingException: megatron-core's own dist_checkpointing is already imported
            (mixing the two is refused; its objects are still accepted by save/load).
    """
    global _finder
    if is_installed():
        return
    already = sorted(
        name
        for name, mod in list(sys.modules.items())
        if _target(name) is not None
        and mod is not None
        and not getattr(mod, "__name__", "").startswith(_OUR_PACKAGE)
    )
    if already:
        raise CheckpointingException(
            f"megatron-core's own {MEGATRON_PACKAGE} is already imported ({already[:3]}...): "
            "call dist_checkpointing.megatron_compat.install() before importing megatron.core, "
            "or pass megatron's objects to dist_checkpointing.save/load directly"
        )
    _finder = _AliasFinder()
    sys.meta_path.insert(0, _finder)
    logger.info("%s now resolves to %s", MEGATRON_PACKAGE, _OUR_PACKAGE)


def uninstall() -> List[str]:
    """Undoes `install()`: removes the finder and the aliased modules from `sys.modules`,
    returning their names."""
    global _finder
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None
    removed = [
        name
        for name, mod in list(sys.modules.items())
        if _target(name) is not None and getattr(mod, "__name__", "").startswith(_OUR_PACKAGE)
    ]
    for name in removed:
        del sys.modules[name]
    return removed
