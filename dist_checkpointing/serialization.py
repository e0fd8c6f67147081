"""Entry points: `save`, `load` and the metadata/maintenance helpers.

All entry points that take a process group's worth of ranks are collective: call them on
every rank, in the same order. A failure on any rank raises a `CheckpointingException` on
every rank.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional, Set, Tuple, Union

from . import _dist
from ._types import CommonStateDict, ShardedStateDict, StateDict
from .async_save import AsyncRequest
from .core import (
    CheckpointingConfig,
    check_is_distributed_checkpoint,
    maybe_load_config,
    save_config,
)
from .dict_utils import dict_list_map_inplace, diff, extract_matching_values, merge, nested_values
from .errors import CheckpointExistsError, CheckpointingException, NotACheckpointError
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
)
from .strategies.base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    NodeLocalLoadShardedStrategy,
    NodeLocalSaveShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
    resolve_strategy,
)
from .validation import (
    StrictHandling,
    metadata_fingerprint,
    parse_strict_flag,
    validate_integrity_and_strict_load,
    validate_sharding_integrity,
)

__all__ = [
    "save",
    "load",
    "load_common_state_dict",
    "load_tensors_metadata",
    "load_sharded_metadata",
    "load_plain_tensors",
    "load_content_metadata",
    "remove_sharded_tensors",
    "check_is_distributed_checkpoint",
    "verify_checkpoint_and_load_strategy",
    "get_default_save_sharded_strategy",
    "get_default_save_common_strategy",
    "get_default_load_sharded_strategy",
]

logger = logging.getLogger(__name__)

CONTENT_METADATA_KEY = "content_metadata"
PathArg = Union[str, "os.PathLike[str]"]
LoadResult = Union[StateDict, Tuple[StateDict, Set[str], Set[str]]]


def get_default_save_sharded_strategy(
    backend: str = "torch_dist", version: int = 1
) -> SaveShardedStrategy:
    """The registered SAVE_SHARDED strategy for `(backend, version)`."""
    strategy = get_default_strategy(StrategyAction.SAVE_SHARDED, backend, version)
    assert isinstance(strategy, SaveShardedStrategy)  # register_default_strategy checks it
    return strategy


def get_default_save_common_strategy(
    backend: str = "torch", version: int = 1
) -> SaveCommonStrategy:
    """The registered SAVE_COMMON strategy for `(backend, version)`."""
    strategy = get_default_strategy(StrategyAction.SAVE_COMMON, backend, version)
    assert isinstance(strategy, SaveCommonStrategy)  # register_default_strategy checks it
    return strategy


def get_default_load_sharded_strategy(checkpoint_dir: PathArg) -> LoadShardedStrategy:
    """The LOAD_SHARDED strategy named by a checkpoint's `metadata.json`."""
    return verify_checkpoint_and_load_strategy(checkpoint_dir)[0]


def verify_checkpoint_and_load_strategy(
    checkpoint_dir: PathArg,
    sharded_strategy: Union[LoadShardedStrategy, Tuple[str, int], None] = None,
    common_strategy: Union[LoadCommonStrategy, Tuple[str, int], None] = None,
) -> Tuple[LoadShardedStrategy, LoadCommonStrategy]:
    """Checks that `checkpoint_dir` is a complete checkpoint and picks strategies for it.

    Strategies not given are looked up from `metadata.json`; given or not, each must declare
    itself compatible with the recorded backend and version.

    Raises:
        NotACheckpointError: no such directory, or no `metadata.json` in it.
        CheckpointCorruptedError: `metadata.json` is invalid.
        StrategyNotFoundError: no strategy is registered for the recorded backend/version.
        IncompatibleCheckpointError: a strategy cannot read this checkpoint.
    """
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise NotACheckpointError(
            f"Checkpoint directory {path} does not exist or is not a directory"
        )
    config = maybe_load_config(path)
    if config is None:
        raise NotACheckpointError(
            f"{path} is not a complete distributed checkpoint: no metadata.json"
        )
    sharded = _compatible_strategy(
        StrategyAction.LOAD_SHARDED,
        sharded_strategy,
        config.sharded_backend,
        config.sharded_backend_version,
    )
    common = _compatible_strategy(
        StrategyAction.LOAD_COMMON,
        common_strategy,
        config.common_backend,
        config.common_backend_version,
    )
    return sharded, common


def _compatible_strategy(action: StrategyAction, spec: Any, backend: str, version: int) -> Any:
    """The given (or registered) load strategy for `(backend, version)`, checked compatible."""
    strategy = resolve_strategy(action, spec, (backend, version))
    strategy.check_backend_compatibility(backend)
    strategy.check_version_compatibility(version)
    return strategy


def _shallow_copy(tree: Any) -> Any:
    """Copies the dict/list containers (not the leaves) so preprocessing never edits the caller's."""
    return (
        extract_matching_values(tree, lambda _: True)[0] if isinstance(tree, (dict, list)) else tree
    )


def _is_nonpersistent(x: Any) -> bool:
    return isinstance(x, LocalNonpersistentObject)


def _save_preprocess(
    sharded_state_dict: ShardedStateDict, content_metadata: Optional[dict]
) -> Tuple[ShardedStateDict, CommonStateDict]:
    sd = _shallow_copy(sharded_state_dict)
    if content_metadata is not None:
        sd[CONTENT_METADATA_KEY] = content_metadata
    apply_factories(sd)
    _, sd = extract_matching_values(sd, _is_nonpersistent)
    return extract_matching_values(sd, lambda x: isinstance(x, ShardedBase))


def _log_common_differences(
    common: CommonStateDict, preprocess: Optional[Callable[[CommonStateDict], StateDict]]
) -> None:
    """Collective: logs (rank 0) where ranks' common state differs from rank 0's."""
    view = preprocess(common) if preprocess is not None else common
    gathered = _dist.gather_object(view)
    if gathered is None or len(gathered) == 1:
        return
    for rank, other in enumerate(gathered[1:], start=1):
        only_0, only_r, mismatch = diff(gathered[0], other)
        if only_0 or only_r or mismatch:
            logger.warning(
                "Common state differs between rank 0 and rank %d (rank 0's is saved): only on rank 0: %s, "
                "only on rank %d: %s, different values: %s",
                rank,
                only_0[:10],
                rank,
                only_r[:10],
                [m[0] for m in mismatch[:10]],
            )


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: PathArg,
    sharded_strategy: Union[SaveShardedStrategy, Tuple[str, int], None] = None,
    common_strategy: Union[SaveCommonStrategy, Tuple[str, int], None] = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Optional[
        Callable[[CommonStateDict], StateDict]
    ] = None,
    content_metadata: Optional[dict] = None,
) -> Optional[AsyncRequest]:
    """Collective: saves a sharded state dict as a checkpoint directory.

    Steps:
    1. Every rank resolves the strategies, creates the directory, builds factories and
       splits its state into sharded leaves and common state (LocalNonpersistentObjects are
       dropped); rank 0 refuses a directory that already holds a complete checkpoint.
       Failures anywhere raise everywhere.
    2. With `validate_access_integrity`, the shard metadata of all ranks is checked: main
       replicas cover each tensor exactly once and ranks agree on shapes and dtypes; rank 0
       logs where other ranks' common state differs from its own.
    3. Rank 0 writes `common.pt`; ShardedObjects go to the common strategy if the sharded
       one cannot store them.
    4. The sharded strategy writes the shards.
    5. Rank 0 writes `metadata.json` (the commit) once every rank's data is durable.

    Args:
        sharded_state_dict: the state to save; it is not modified.
        checkpoint_dir: the checkpoint directory (created if missing).
        sharded_strategy: instance or `(backend, version)`; default ('torch_dist', 1).
        common_strategy: instance or `(backend, version)`; default ('torch', 1).
        validate_access_integrity: run the sharding checks of step 2.
        async_sharded_save: return an async request for step 4-5 instead of running them
            (requires an `AsyncSaveShardedStrategy`).
        preprocess_common_before_consistancy_check: applied to the common state before the
            cross-rank comparison (e.g. to drop keys expected to differ); must not modify its
            argument.
        content_metadata: a dict stored in the common state, read back with
            `load_content_metadata`.

    Returns:
        None, or the async request when `async_sharded_save`.

    Raises:
        CheckpointExistsError: `checkpoint_dir` already holds a complete checkpoint.
        ShardingIntegrityError: the shards do not form valid global tensors.
        StrategyNotFoundError: an unknown `(backend, version)`.
        CheckpointingException: any other failure, on every rank.
    """
    start = time.perf_counter()
    ckpt = Path(checkpoint_dir)
    result: Optional[_SavePlan] = None
    error: Optional[BaseException] = None
    try:
        result = _prepare_save(
            sharded_state_dict,
            ckpt,
            sharded_strategy,
            common_strategy,
            async_sharded_save,
            content_metadata,
            (preprocess_common_before_consistancy_check or True)
            if validate_access_integrity
            else None,
        )
    except Exception as e:  # agreed on below, with the digest exchange
        error = e
    reports = _dist.all_gather_object(
        (
            result.structure if result else "",
            _last_validated_structure,
            result.common_digest if result else "",
            _dist.error_report(error),
        )
    )
    _dist.raise_on_reported_errors([r[3] for r in reports], error, f"save to {ckpt} (preparation)")
    assert result is not None
    sharded, common = result.sharded, result.common
    if validate_access_integrity:
        _validate_save_sharding(result.local_metadata, reports)
        if len({r[2] for r in reports}) > 1:
            _log_common_differences(result.common_part, preprocess_common_before_consistancy_check)
    node_local = isinstance(sharded, NodeLocalSaveShardedStrategy)
    if node_local or result.deferred_common is not None:
        to_save = result.sharded_part  # node-local backends store the common state themselves
    else:
        to_save = _dist.run_collectively(
            f"save of common state to {ckpt}", _save_common, result, ckpt
        )

    def commit() -> None:
        def write_config() -> None:
            if node_local or _dist.get_rank() == 0:
                save_config(
                    CheckpointingConfig(
                        sharded.backend, sharded.version, common.backend, common.version
                    ),
                    ckpt,
                )

        _dist.run_collectively(f"commit of {ckpt}", write_config)
        _dist.log_rank0(
            logger, logging.INFO, "Saved checkpoint %s in %.2f s", ckpt, time.perf_counter() - start
        )

    if node_local:
        assert isinstance(sharded, NodeLocalSaveShardedStrategy)
        if async_sharded_save:
            request = sharded.async_save_rank_state(to_save, result.common_part, ckpt)
            request.add_finalize_fn(commit)
            return request
        sharded.save_rank_state(to_save, result.common_part, ckpt)
        commit()
        return None
    if async_sharded_save:
        assert isinstance(sharded, AsyncSaveShardedStrategy)  # checked in _prepare_save
        request = sharded.async_save(to_save, ckpt)
        for fn, args in reversed(result.deferred_common or []):
            request.prepend_async_fn(fn, *args)
        request.add_finalize_fn(commit)
        return request
    sharded.save(to_save, ckpt)
    commit()
    return None


@dataclass
class _SavePlan:
    """What `_prepare_save` worked out on one rank."""

    sharded: SaveShardedStrategy
    common: SaveCommonStrategy
    sharded_part: ShardedStateDict
    common_part: CommonStateDict
    local_metadata: list
    structure: str
    common_digest: str
    deferred_common: Optional[List[Tuple[Callable[..., Any], Tuple[Any, ...]]]]


def _prepare_save(
    sharded_state_dict: ShardedStateDict,
    ckpt: Path,
    sharded_strategy: Any,
    common_strategy: Any,
    async_sharded_save: bool,
    content_metadata: Optional[dict],
    preprocess_common: Union[Callable[[CommonStateDict], StateDict], bool, None],
) -> _SavePlan:
    """The local part of a save's preparation (no collectives; may raise).

    `preprocess_common` is None when the common state is not compared across ranks, True
    to compare it as is, or the caller's preprocessing function.
    """
    sharded = resolve_strategy(StrategyAction.SAVE_SHARDED, sharded_strategy, ("torch_dist", 1))
    common = resolve_strategy(StrategyAction.SAVE_COMMON, common_strategy, ("torch", 1))
    if async_sharded_save and not isinstance(sharded, AsyncSaveShardedStrategy):
        raise CheckpointingException(f"{sharded} does not support async save")
    if (sharded.node_local or _dist.get_rank() == 0) and check_is_distributed_checkpoint(ckpt):
        raise CheckpointExistsError(
            f"{ckpt} already holds a complete checkpoint; refusing to overwrite it"
        )
    ckpt.mkdir(parents=True, exist_ok=True)
    sharded_part, common_part = _save_preprocess(sharded_state_dict, content_metadata)
    for sh in _nested_sharded(sharded_part):
        sh.validate_metadata_integrity()
    local_md = [sh.without_data() for sh in _nested_sharded(sharded_part)]
    deferred = None
    if async_sharded_save and sharded.can_handle_sharded_objects and not sharded.node_local:
        deferred = common.deferred_save_common(common_part, ckpt)
    return _SavePlan(
        sharded,
        common,
        sharded_part,
        common_part,
        local_md,
        metadata_fingerprint(local_md),
        _common_digest(common_part, preprocess_common),
        deferred,
    )


def _common_digest(common: CommonStateDict, preprocess: Any) -> str:
    """A digest of the common state as compared across ranks ('' when not compared)."""
    if preprocess is None:
        return ""
    view = preprocess(common) if callable(preprocess) else common
    try:
        return hashlib.blake2b(pickle.dumps(view, protocol=4), digest_size=16).hexdigest()
    except Exception:  # unpicklable values: compare in full instead
        return f"unhashable:{_dist.get_rank()}"


def _save_common(plan: _SavePlan, ckpt: Path) -> ShardedStateDict:
    plan.common.save_common(plan.common_part, ckpt)
    if plan.sharded.can_handle_sharded_objects:
        return plan.sharded_part
    objects, rest = extract_matching_values(
        plan.sharded_part, lambda v: isinstance(v, ShardedObject)
    )
    plan.common.save_sharded_objects(objects, ckpt)
    return rest


# Digest of the last global sharding that passed validation (identical on every rank).
_last_validated_structure: Optional[str] = None


def _validate_save_sharding(local_md: list, reports: list) -> None:
    """Collective (unless skipped on every rank alike): validates the global sharding.

    The exchange of every rank's shard metadata is skipped when every rank reports the same
    structure digest as the last validated save (decided from `reports`, which every rank
    holds, so all ranks skip or exchange together).
    """
    global _last_validated_structure
    structure = "|".join(r[0] for r in reports)
    if all(r[1] == structure for r in reports):
        return
    validate_sharding_integrity(_dist.all_gather_object(local_md))
    _last_validated_structure = structure


def _nested_sharded(tree: Any) -> list:
    return (
        [v for v in nested_values(tree) if isinstance(v, ShardedBase)]
        if isinstance(tree, (dict, list))
        else []
    )


def _load_preprocess(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict, Any]:
    sd = _shallow_copy(sharded_state_dict)
    factories, _ = extract_matching_values(
        sd, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
    )
    apply_factories(sd)
    nonpersistent, sd = extract_matching_values(sd, _is_nonpersistent)
    dict_list_map_inplace(lambda o: o.unwrap(), nonpersistent)
    sharded, _ = extract_matching_values(sd, lambda x: isinstance(x, ShardedBase))
    return sharded, nonpersistent, factories


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: PathArg,
    sharded_strategy: Union[LoadShardedStrategy, Tuple[str, int], None] = None,
    common_strategy: Union[LoadCommonStrategy, Tuple[str, int], None] = None,
    validate_access_integrity: bool = True,
    strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
) -> LoadResult:
    """Collective: loads a checkpoint into the layout that `sharded_state_dict` describes.

    The requested sharding may differ from the saved one (other world size, axis or number
    of pieces): each rank reads exactly the regions it asks for.

    Steps:
    1. Check `metadata.json` and pick compatible strategies (from it unless given).
    2. Load the common state; it forms the base of the result.
    3. Build factories; put LocalNonpersistentObjects' local values in place.
    4. Apply `strict` (key mismatch handling) and, with `validate_access_integrity`, check
       that the request is a valid sharding.
    5. Load ShardedTensors/ShardedObjects, merge them in, apply factory merges.

    Args:
        sharded_state_dict: what to load and where (ShardedTensors may carry the destination
            tensors; those without data are allocated on the CPU).
        checkpoint_dir: the checkpoint directory.
        sharded_strategy: instance or `(backend, version)`; default from `metadata.json`.
        common_strategy: instance or `(backend, version)`; default from `metadata.json`.
        validate_access_integrity: check the request's sharding across ranks.
        strict: a `StrictHandling` (or its value) for requested-vs-stored key mismatches.

    Returns:
        The loaded state dict; under RETURN_UNEXPECTED / RETURN_ALL a tuple
        `(state_dict, missing_keys, unexpected_keys)`.

    Raises:
        NotACheckpointError: not a complete checkpoint.
        KeyMismatchError: under a raising strict mode.
        CheckpointingException: any other failure, on every rank.
    """
    start = time.perf_counter()
    strict = parse_strict_flag(strict)
    ckpt = Path(checkpoint_dir)

    sharded, common = _load_strategies(ckpt, sharded_strategy, common_strategy)
    node_local = isinstance(sharded, NodeLocalLoadShardedStrategy)
    common_state_dict: StateDict = (
        {}
        if node_local
        else _dist.run_collectively(f"load of common state from {ckpt}", common.load_common, ckpt)
    )
    request, nonpersistent, factories = _load_preprocess(sharded_state_dict)

    ckpt_metadata = None
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        ckpt_metadata = _dist.run_collectively(
            f"metadata load from {ckpt}", _sharded_metadata, ckpt, sharded, common
        )
    local_md, global_md = None, None
    if validate_access_integrity or StrictHandling.requires_global_app_metadata(strict):
        local_md = [sh.without_data() for sh in _nested_sharded(request)]
        global_md = _dist.all_gather_object(local_md)
    request, missing, unexpected = validate_integrity_and_strict_load(
        request, strict, validate_access_integrity, local_md, global_md, ckpt_metadata
    )
    if node_local:
        assert isinstance(sharded, NodeLocalLoadShardedStrategy)
        common_state_dict, loaded = sharded.load_rank_state(request, ckpt)
        merge(common_state_dict, nonpersistent)
        merge(common_state_dict, loaded)
        apply_factory_merges(common_state_dict, factories)
        _dist.log_rank0(
            logger,
            logging.INFO,
            "Loaded checkpoint %s in %.2f s",
            ckpt,
            time.perf_counter() - start,
        )
        if StrictHandling.requires_returning_mismatch_keys(strict):
            return common_state_dict, missing, unexpected
        return common_state_dict
    merge(common_state_dict, nonpersistent)
    if not sharded.can_handle_sharded_objects:
        objects, request = extract_matching_values(request, lambda v: isinstance(v, ShardedObject))
        loaded_objects = _dist.run_collectively(
            f"ShardedObject load from {ckpt}", common.load_sharded_objects, objects, ckpt
        )
        merge(common_state_dict, loaded_objects)
    loaded = sharded.load(request, ckpt)
    merge(common_state_dict, loaded)
    apply_factory_merges(common_state_dict, factories)
    _dist.log_rank0(
        logger, logging.INFO, "Loaded checkpoint %s in %.2f s", ckpt, time.perf_counter() - start
    )
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return common_state_dict, missing, unexpected
    return common_state_dict


def _load_strategies(
    ckpt: Path, sharded_strategy: Any, common_strategy: Any
) -> Tuple[LoadShardedStrategy, LoadCommonStrategy]:
    """Collective: the load strategies for `ckpt`, checked on every rank.

    A rank whose directory lacks the checkpoint (its node lost it) adopts the record of
    the other ranks when they hold a node-local checkpoint, whose parts can be fetched from
    replica holders; otherwise every rank raises.
    """
    found: Optional[Tuple[LoadShardedStrategy, LoadCommonStrategy]] = None
    error: Optional[BaseException] = None
    config = None
    try:
        found = verify_checkpoint_and_load_strategy(ckpt, sharded_strategy, common_strategy)
        if found[0].node_local:
            config = maybe_load_config(ckpt)
    except Exception as e:  # agreed on below
        error = e
    reports = _dist.all_gather_object((_dist.error_report(error), config))
    records = [r[1] for r in reports if r[1] is not None]
    failures = [r[0] for r in reports if r[0] is not None]
    what = f"load from {ckpt} (preparation)"
    if not failures:
        assert found is not None
        return found
    if not records or any(f[0] != "NotACheckpointError" for f in failures):
        _dist.raise_on_reported_errors([r[0] for r in reports], error, what)
    # every failure is a missing checkpoint, and others hold a node-local one: adopt it
    if error is not None:
        record = records[0]
        logger.warning(
            "%s is missing on rank %d; using the other ranks' record (backend %r) to fetch this "
            "rank's part from a replica holder",
            ckpt,
            _dist.get_rank(),
            record.sharded_backend,
        )
        error = None
        try:
            found = (
                _compatible_strategy(
                    StrategyAction.LOAD_SHARDED,
                    sharded_strategy,
                    record.sharded_backend,
                    record.sharded_backend_version,
                ),
                _compatible_strategy(
                    StrategyAction.LOAD_COMMON,
                    common_strategy,
                    record.common_backend,
                    record.common_backend_version,
                ),
            )
        except Exception as e:  # agreed on below
            error = e
    _dist.agree_on_errors(error, what)
    assert found is not None
    return found


def _sharded_metadata(
    ckpt: Path, sharded: LoadShardedStrategy, common: LoadCommonStrategy
) -> ShardedStateDict:
    metadata = sharded.load_sharded_metadata(ckpt)
    if not sharded.can_handle_sharded_objects:
        metadata = merge(metadata, common.load_sharded_metadata(ckpt))
    return metadata


def load_common_state_dict(checkpoint_dir: PathArg) -> StateDict:
    """Loads only the common (non-sharded) state of a checkpoint. Not collective.

    For node-local backends, this rank's common state from its own directory.
    """
    sharded, common = verify_checkpoint_and_load_strategy(checkpoint_dir)
    if isinstance(sharded, NodeLocalLoadShardedStrategy):
        return sharded.load_common_rank_state(Path(checkpoint_dir))
    return common.load_common(Path(checkpoint_dir))


def load_tensors_metadata(
    checkpoint_dir: PathArg, sharded_strategy: Optional[LoadShardedStrategy] = None
) -> ShardedStateDict:
    """Returns `{key: ShardedTensor}` (whole tensors, no data) of a checkpoint. Not collective."""
    sharded, _ = verify_checkpoint_and_load_strategy(checkpoint_dir, sharded_strategy)
    return sharded.load_tensors_metadata(Path(checkpoint_dir))


def load_sharded_metadata(
    checkpoint_dir: PathArg,
    sharded_strategy: Optional[LoadShardedStrategy] = None,
    common_strategy: Optional[LoadCommonStrategy] = None,
) -> ShardedStateDict:
    """Returns tensors (by key) and ShardedObjects (by unique key) of a checkpoint, no data.

    Not collective.
    """
    sharded, common = verify_checkpoint_and_load_strategy(
        checkpoint_dir, sharded_strategy, common_strategy
    )
    return _sharded_metadata(Path(checkpoint_dir), sharded, common)


def load_plain_tensors(checkpoint_dir: PathArg) -> StateDict:
    """Collective: loads every tensor of a checkpoint whole, as `{key: tensor}` (common state excluded)."""
    request = load_tensors_metadata(checkpoint_dir)
    result = load(request, checkpoint_dir, validate_access_integrity=False)
    assert isinstance(result, dict)
    return {k: result[k] for k in request}


def load_content_metadata(
    checkpoint_dir: Optional[PathArg] = None, *, preloaded_state_dict: Optional[StateDict] = None
) -> Optional[dict]:
    """Returns the `content_metadata` given to `save`, or None if there was none.

    Args:
        checkpoint_dir: the checkpoint (read if `preloaded_state_dict` is not given).
        preloaded_state_dict: an already loaded common or full state dict.

    Raises:
        CheckpointingException: if neither argument is given.
    """
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise CheckpointingException("Give checkpoint_dir or preloaded_state_dict")
        preloaded_state_dict = load_common_state_dict(checkpoint_dir)
    return preloaded_state_dict.get(CONTENT_METADATA_KEY)


def remove_sharded_tensors(checkpoint_dir: PathArg, key_prefix: str) -> None:
    """Removes the tensors whose keys start with `key_prefix` (saved with that separation hint).

    Not collective: run it on one process.
    """
    sharded, _ = verify_checkpoint_and_load_strategy(checkpoint_dir)
    sharded.remove_sharded_tensors(Path(checkpoint_dir), key_prefix)
