"""The strategy registry, keyed by `(StrategyAction, backend, version)`, and the strategy
base classes. Built-ins register lazily on the first lookup. The `(backend, version)` a
save records in `metadata.json` selects the load strategies, which check compatibility.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Type, Union

from .._types import ShardedStateDict, StateDict
from ..async_save import AsyncRequest
from ..errors import CheckpointingException, IncompatibleCheckpointError, StrategyNotFoundError

__all__ = [
    "StrategyAction",
    "default_strategies",
    "get_default_strategy",
    "register_default_strategy",
    "resolve_strategy",
    "LoadStrategyBase",
    "SaveStrategyBase",
    "LoadCommonStrategy",
    "LoadShardedStrategy",
    "SaveCommonStrategy",
    "SaveShardedStrategy",
    "AsyncSaveShardedStrategy",
    "NodeLocalSaveShardedStrategy",
    "NodeLocalLoadShardedStrategy",
]

CheckpointDir = Union[str, Path]


class StrategyAction(Enum):
    """What a strategy does: load or save, the sharded or the common part."""

    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


class StrategyBase(ABC):  # noqa: B024 (abstract methods live in the subclasses)
    """What load and save strategies share."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether it loads or saves ShardedObjects itself (else the common strategy does)."""
        return False


#: The registry. Changed only by `register_default_strategy`.
_registry: Dict[Tuple[StrategyAction, str, int], StrategyBase] = {}
_builtins_registered = False


class _RegistryView(Mapping[str, Mapping[Tuple[str, int], StrategyBase]]):
    """Read-only, live `view[action.value][(backend, version)]` of the registry (megatron's
    layout of `default_strategies`; write with `register_default_strategy`)."""

    def __getitem__(self, action_value: str) -> Mapping[Tuple[str, int], StrategyBase]:
        action = StrategyAction(action_value)
        return MappingProxyType({(b, v): s for (a, b, v), s in _registry.items() if a is action})

    def __iter__(self) -> Iterator[str]:
        return iter([a.value for a in StrategyAction])

    def __len__(self) -> int:
        return len(StrategyAction)


#: Registered strategies, read-only: `default_strategies[action.value][(backend, version)]`.
default_strategies: Mapping[str, Mapping[Tuple[str, int], StrategyBase]] = _RegistryView()


def _register_builtin_strategies() -> None:
    """Registers the built-in backends, once, on first use of the registry."""
    global _builtins_registered
    if _builtins_registered:
        return
    _builtins_registered = True
    from .common import register_default_common_strategies
    from .local import register_default_local_strategies
    from .torch import register_default_torch_strategies

    register_default_common_strategies()
    register_default_torch_strategies()
    register_default_local_strategies()


def get_default_strategy(action: StrategyAction, backend: str, version: int) -> StrategyBase:
    """Returns the strategy registered for `(action, backend, version)`.

    Raises:
        StrategyNotFoundError: naming the triple and listing what is registered.
    """
    _register_builtin_strategies()
    if not isinstance(action, StrategyAction):
        raise StrategyNotFoundError(f"Unknown strategy action {action!r}")
    try:
        return _registry[(action, backend, version)]
    except (KeyError, TypeError) as e:
        listed = sorted(_registry, key=lambda k: (k[0].value, k[1], k[2]))
        registered = ", ".join(f"({a.value}, {b!r}, {v})" for a, b, v in listed) or "none"
        raise StrategyNotFoundError(
            f"Cannot find a default strategy for: {(action.value, backend, version)} (no "
            f"strategy registered for action={action.value}, backend={backend!r}, "
            f"version={version!r}). Registered: {registered}"
        ) from e


def register_default_strategy(
    action: StrategyAction, backend: str, version: int, strategy: StrategyBase
) -> None:
    """Registers `strategy` for `(action, backend, version)`, replacing any earlier one.

    Raises:
        CheckpointingException: on an empty backend, a non-positive version, or a strategy
            that is not an instance of `action`'s base class.
    """
    if not isinstance(action, StrategyAction):
        raise CheckpointingException(f"Unknown strategy action {action!r}")
    if not isinstance(backend, str) or not backend:
        raise CheckpointingException(f"Backend must be a non-empty string, got {backend!r}")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointingException(f"Version must be a positive int, got {version!r}")
    base = _BASES[action]
    if not isinstance(strategy, base):
        raise CheckpointingException(
            f"Strategy for {action.value} must be a {base.__name__}, got {type(strategy).__name__}"
        )
    _registry[(action, backend, version)] = strategy


def resolve_strategy(
    action: StrategyAction, spec: Any, default: Optional[Tuple[str, int]] = None
) -> Any:
    """Turns a strategy argument of `save`/`load` (an instance, a `(backend, version)` tuple,
    or None for `default`) into an instance of `action`'s base class.

    Raises:
        StrategyNotFoundError: if the tuple is not registered.
        CheckpointingException: if `spec` is of the wrong kind.
    """
    base = _BASES[action]
    if spec is None:
        if default is None:
            raise CheckpointingException(f"No strategy given for {action.value}")
        spec = default
    if isinstance(spec, tuple):
        if len(spec) != 2:
            raise CheckpointingException(f"Strategy tuple must be (backend, version), got {spec!r}")
        spec = get_default_strategy(action, spec[0], spec[1])
    if not isinstance(spec, base):
        raise CheckpointingException(
            f"Expected a {base.__name__} or a (backend, version) tuple for {action.value}, "
            f"got {type(spec).__name__}"
        )
    return spec


def strategy_label(strategy: Any) -> str:
    """`Class(backend, version)`: the same on every rank that uses the same strategy (how
    messages name the strategies of ranks that were not called alike)."""
    backend, version = getattr(strategy, "backend", "?"), getattr(strategy, "version", "?")
    return f"{type(strategy).__name__}({backend}, {version})"


class LoadStrategyBase(StrategyBase):
    """Base of load strategies: declares which checkpoints it can read."""

    @abstractmethod
    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Raises `IncompatibleCheckpointError` if checkpoints of `loaded_backend` are unreadable."""

    @abstractmethod
    def check_version_compatibility(self, loaded_version: int) -> None:
        """Raises `IncompatibleCheckpointError` if that format version is unreadable."""

    def __str__(self) -> str:
        return f"{type(self).__name__}()"


class SaveStrategyBase(StrategyBase):
    """Base of save strategies: knows the `(backend, version)` it records in `metadata.json`."""

    def __init__(self, backend: str, version: int) -> None:
        self.backend = backend
        self.version = version

    def __str__(self) -> str:
        return f"{type(self).__name__}({self.backend}, {self.version})"


class LoadCommonStrategy(LoadStrategyBase):
    """Loads the common (non-sharded) part, and ShardedObjects for backends that don't."""

    @abstractmethod
    def load_common(self, checkpoint_dir: CheckpointDir) -> StateDict:
        """Returns the common state dict of the checkpoint (every rank calls it)."""

    @abstractmethod
    def load_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir
    ) -> StateDict:
        """Returns `sharded_objects_state_dict` with each ShardedObject replaced by its data."""

    def load_sharded_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        """Returns `{unique_key: ShardedObject}` (metadata only) of the stored objects."""
        return {}


class LoadShardedStrategy(LoadStrategyBase):
    """Loads the sharded part of a checkpoint (collective: every rank calls `load`)."""

    @abstractmethod
    def load(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir
    ) -> StateDict:
        """Returns `sharded_state_dict` with every sharded leaf replaced by its loaded data."""

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        """Returns `{key: ShardedTensor}` (metadata only, unsharded) of the stored tensors."""

    def load_sharded_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        """Returns tensors and (when handled here) objects metadata, keyed by (unique) key."""
        if self.can_handle_sharded_objects:
            raise CheckpointingException(f"{self} handles ShardedObjects but does not list them")
        return self.load_tensors_metadata(checkpoint_dir)

    def remove_sharded_tensors(self, checkpoint_dir: CheckpointDir, key_prefix: str) -> None:
        """Removes the tensors whose keys start with `key_prefix` (raises if unsupported)."""
        raise CheckpointingException(f"{self} cannot remove sharded tensors")


def require_backend(strategy: LoadStrategyBase, expected: str, loaded: str) -> None:
    """For built-in strategies: raise `IncompatibleCheckpointError` unless `loaded == expected`."""
    if loaded != expected:
        raise IncompatibleCheckpointError(
            f"{strategy} reads backend {expected!r}, but the checkpoint was written by backend {loaded!r}"
        )


def require_version(
    strategy: LoadStrategyBase, backend: str, supported: Tuple[int, ...], loaded: int
) -> None:
    """For built-in strategies: raise `IncompatibleCheckpointError` unless `loaded` is supported."""
    if loaded not in supported:
        raise IncompatibleCheckpointError(
            f"{strategy} reads {backend!r} versions {list(supported)}, but the checkpoint has version {loaded!r}"
        )


class SaveCommonStrategy(SaveStrategyBase):
    """Saves the common part (rank 0 writes) and ShardedObjects for backends that don't."""

    @abstractmethod
    def save_common(self, common_state_dict: StateDict, checkpoint_dir: CheckpointDir) -> None:
        """Writes the common state dict (every rank calls it; rank 0 writes)."""

    def deferred_save_common(
        self, common_state_dict: StateDict, checkpoint_dir: CheckpointDir
    ) -> Optional[List[Tuple[Callable[..., Any], Tuple[Any, ...]]]]:
        """Prepares, on every rank at `save()` time, the common save to run in an async save's
        background writer; the calls must capture a snapshot of the state.

        Returns:
            `(function, args)` calls to run in the background on this rank (possibly none),
            or None (the default, on every rank alike) to run `save_common` synchronously.
        """
        return None

    @abstractmethod
    def save_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir
    ) -> None:
        """Writes this rank's main-replica ShardedObjects."""


class SaveShardedStrategy(SaveStrategyBase):
    """Saves the sharded part (collective: every rank calls `save`)."""

    @abstractmethod
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir) -> None:
        """Writes this rank's main-replica shards; all ranks succeed or all raise."""


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """A sharded save strategy that can also write in the background: `async_save` does the
    caller-side part and returns an `AsyncRequest` for the rest; `save` runs it synchronously.
    """

    @abstractmethod
    def async_save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir
    ) -> AsyncRequest:
        """Starts a save; returns the request (with `execute_sync()`) that writes and finalizes it."""

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir) -> None:
        """Saves synchronously by running the async request in the caller."""
        self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()


class NodeLocalSaveShardedStrategy(AsyncSaveShardedStrategy):
    """A backend that stores each rank's whole state (sharded and common) on its own node;
    every rank writes its own `metadata.json`, so the directory need not be shared."""

    can_handle_sharded_objects = True

    @abstractmethod
    def async_save_rank_state(
        self,
        sharded_state_dict: ShardedStateDict,
        common_state_dict: StateDict,
        checkpoint_dir: CheckpointDir,
    ) -> AsyncRequest:
        """Collective: starts saving this rank's state; returns the request to schedule."""

    @abstractmethod
    def save_rank_state(
        self,
        sharded_state_dict: ShardedStateDict,
        common_state_dict: StateDict,
        checkpoint_dir: CheckpointDir,
    ) -> None:
        """Collective: saves this rank's state; all ranks succeed or all raise."""

    def async_save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir
    ) -> AsyncRequest:
        return self.async_save_rank_state(sharded_state_dict, {}, checkpoint_dir)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir) -> None:
        self.save_rank_state(sharded_state_dict, {}, checkpoint_dir)


class NodeLocalLoadShardedStrategy(LoadShardedStrategy):
    """Loads checkpoints of a `NodeLocalSaveShardedStrategy` backend."""

    can_handle_sharded_objects = True

    @abstractmethod
    def load_rank_state(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir
    ) -> Tuple[StateDict, StateDict]:
        """Collective: returns `(common state, loaded sharded leaves)` of this rank."""

    @abstractmethod
    def load_common_rank_state(self, checkpoint_dir: CheckpointDir) -> StateDict:
        """This rank's common state, from its own node (not collective)."""

    def load(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir
    ) -> StateDict:
        return self.load_rank_state(sharded_state_dict, checkpoint_dir)[1]


#: The base class a strategy registered or resolved for an action must derive from.
_BASES: Dict[StrategyAction, Type[StrategyBase]] = {
    StrategyAction.LOAD_COMMON: LoadCommonStrategy,
    StrategyAction.LOAD_SHARDED: LoadShardedStrategy,
    StrategyAction.SAVE_COMMON: SaveCommonStrategy,
    StrategyAction.SAVE_SHARDED: SaveShardedStrategy,
}
