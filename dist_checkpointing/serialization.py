"""Entry points: `save`, `load` and the metadata/maintenance helpers.

Collective entry points are called on every rank, in the same order; a failure on any rank
raises a `CheckpointingException` on every rank. Node-local backends take the flow in
`_node_local_flow`; shared steps live in `_save_pipeline`, `_load_pipeline` and
`_strategy_selection`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from pathlib import Path
from typing import Callable, Dict, Optional, Set, Tuple, Union

from . import _dist, _node_local_flow
from ._claim import verify_claim
from ._load_pipeline import finish_load, prepare_load_request
from ._save_pipeline import (
    CONTENT_METADATA_KEY,
    SavePlan,
    agree_on_preparation,
    make_commit,
    prepare_save,
    save_common,
)
from ._strategy_selection import select_load_strategies, verify_checkpoint_and_load_strategy
from ._types import CommonStateDict, ShardedStateDict, StateDict
from .async_save import AsyncRequest
from .core import PathArg, check_is_distributed_checkpoint, is_stock_dcp_checkpoint
from .dict_utils import extract_matching_values, merge
from .dtypes import lossy_conversion_allowed
from .errors import CheckpointingException
from .mapping import ShardedObject, ShardedTensor
from .storage import objstore
from .strategies.base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    NodeLocalLoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    resolve_strategy,
)
from .validation import StrictHandling, parse_strict_flag

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
    "CkptShardedMetadata",
]

logger = logging.getLogger(__name__)

LoadResult = Union[StateDict, Tuple[StateDict, Set[str], Set[str]]]
#: What `load_sharded_metadata` returns: tensors by key, ShardedObjects by unique key, no data.
CkptShardedMetadata = Dict[str, Union[ShardedTensor, ShardedObject]]


def get_default_save_sharded_strategy(
    backend: str = "torch_dist", version: int = 1
) -> SaveShardedStrategy:
    """The registered SAVE_SHARDED strategy for `(backend, version)`."""
    return resolve_strategy(StrategyAction.SAVE_SHARDED, (backend, version))


def get_default_save_common_strategy(
    backend: str = "torch", version: int = 1
) -> SaveCommonStrategy:
    """The registered SAVE_COMMON strategy for `(backend, version)`."""
    return resolve_strategy(StrategyAction.SAVE_COMMON, (backend, version))


def get_default_load_sharded_strategy(checkpoint_dir: PathArg) -> LoadShardedStrategy:
    """The LOAD_SHARDED strategy named by a checkpoint's `metadata.json`."""
    return verify_checkpoint_and_load_strategy(checkpoint_dir)[0]


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
    1. Resolve strategies, create the directory (refusing a complete checkpoint), build
       factories, split sharded leaves from common state.
    2. With `validate_access_integrity`, check the global sharding; rank 0 logs where
       other ranks' common state differs from its own.
    3. Rank 0 writes the common state (and ShardedObjects if the sharded strategy can't).
    4. The sharded strategy writes the shards.
    5. Rank 0 writes `metadata.json` (the commit) once every rank's data is durable.

    Args:
        sharded_state_dict: the state to save; it is not modified.
        checkpoint_dir: the checkpoint directory (created if missing).
        sharded_strategy: instance or `(backend, version)`; default ('torch_dist', 1).
        common_strategy: instance or `(backend, version)`; default ('torch', 1).
        validate_access_integrity: run the sharding checks of step 2.
        async_sharded_save: return an async request for steps 4-5 (needs an
            `AsyncSaveShardedStrategy`).
        preprocess_common_before_consistancy_check: applied to the common state before the
            cross-rank comparison (e.g. to drop keys expected to differ), without modifying it.
        content_metadata: a dict saved with the state (see `load_content_metadata`).

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
    plan: Optional[SavePlan] = None
    error: Optional[BaseException] = None
    # the directories this save creates, removed again (if empty) when it is refused
    created = [] if objstore.split(ckpt) else [ckpt, *ckpt.parents]  # prefixes: no directories
    created = list(itertools.takewhile(lambda d: not d.exists(), created))
    try:
        plan = prepare_save(
            sharded_state_dict,
            ckpt,
            sharded_strategy,
            common_strategy,
            async_sharded_save,
            content_metadata,
            validate_access_integrity,
            preprocess_common_before_consistancy_check,
        )
    except Exception as e:  # agreed on below, with the digest exchange
        error = e
    try:
        plan = agree_on_preparation(
            plan, error, ckpt, validate_access_integrity, preprocess_common_before_consistancy_check
        )
    except Exception:  # refused on every rank before anything was written
        if plan is not None:
            plan.ownership.refused()
        for d in created:
            with contextlib.suppress(OSError):  # not empty, or another rank removed it
                d.rmdir()
        raise
    commit = make_commit(plan, ckpt, start)
    own = plan.ownership
    if plan.node_local:  # the one place the flow is chosen
        try:
            local_request = _node_local_flow.save(plan, ckpt, async_sharded_save, commit)
        except BaseException as e:  # before the commit: the claims of an agreed failure go
            own.failed(e)
            raise
        if local_request is not None:
            local_request.finalize_fns[:] = [own.watch(fn) for fn in local_request.finalize_fns]
            local_request.cleanup_fns.append(own.discard)
        return local_request
    try:
        if plan.deferred_common is not None:
            to_save = plan.sharded_part
        else:
            what = f"save of common state to {ckpt}"
            to_save = _dist.run_collectively(what, save_common, plan, ckpt)
        if async_sharded_save:
            assert isinstance(plan.sharded, AsyncSaveShardedStrategy)  # checked in prepare_save
            request = plan.sharded.async_save(to_save, ckpt)
            for fn, args in reversed(plan.deferred_common or []):
                request.prepend_async_fn(fn, *args)
            if plan.deferred_common is not None:  # no collective before the writes: check there
                request.prepend_async_fn(verify_claim, ckpt, own.token, _dist.get_rank(), "writing")
            request.finalize_fns[:] = [own.watch(fn) for fn in request.finalize_fns]
            request.add_finalize_fn(commit)
            request.cleanup_fns.append(own.discard)  # a no-op once committing or committed
            return request
        plan.sharded.save(to_save, ckpt)
    except BaseException as e:  # before the commit: what every rank agreed failed is removed
        own.failed(e)
        raise
    commit()
    return None


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: PathArg,
    sharded_strategy: Union[LoadShardedStrategy, Tuple[str, int], None] = None,
    common_strategy: Union[LoadCommonStrategy, Tuple[str, int], None] = None,
    validate_access_integrity: bool = True,
    strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
    *,
    allow_lossy_dtype_conversion: bool = False,
) -> LoadResult:
    """Collective: loads a checkpoint into the (possibly different) sharding that
    `sharded_state_dict` describes.

    Steps:
    1. Check `metadata.json`, pick compatible strategies and load the common state.
    2. Build factories; put LocalNonpersistentObjects' local values in place.
    3. Apply `strict` and, with `validate_access_integrity`, check the request's sharding.
    4. Load ShardedTensors/ShardedObjects, merge them in, apply factory merges.

    Args:
        sharded_state_dict: what to load and where (ShardedTensors without data are
            allocated on the CPU).
        checkpoint_dir: the checkpoint directory.
        sharded_strategy: instance or `(backend, version)`; default from `metadata.json`.
        common_strategy: instance or `(backend, version)`; default from `metadata.json`.
        validate_access_integrity: check the request's sharding across ranks.
        strict: a `StrictHandling` (or its value) for requested-vs-stored key mismatches.
        allow_lossy_dtype_conversion: load tensors into dtypes that cannot hold every stored
            value (float32 -> bfloat16, ...); without it that raises
            `LossyDtypeConversionError`. Exact conversions always load.

    Returns:
        The loaded state dict; under RETURN_UNEXPECTED / RETURN_ALL a tuple
        `(state_dict, missing_keys, unexpected_keys)`.

    Raises:
        NotACheckpointError: not a complete checkpoint.
        KeyMismatchError: under a raising strict mode.
        CheckpointingException: any other failure, on every rank.
    """
    ckpt = Path(checkpoint_dir)
    with lossy_conversion_allowed(allow_lossy_dtype_conversion), _dist.naming_files_within(ckpt):
        start = time.perf_counter()
        strict = parse_strict_flag(strict)
        # both decide which collectives follow: ranks passing different ones raise here
        options = {
            "validate_access_integrity": bool(validate_access_integrity),
            "strict": strict.value,
        }
        sharded, common, common_state = select_load_strategies(
            ckpt, sharded_strategy, common_strategy, options
        )

        def stored_metadata() -> ShardedStateDict:
            return _dist.run_collectively(
                f"metadata load from {ckpt}", _sharded_metadata, ckpt, sharded, common
            )

        if isinstance(sharded, NodeLocalLoadShardedStrategy):  # the one place the flow is chosen
            return _node_local_flow.load(
                sharded,
                ckpt,
                sharded_state_dict,
                strict,
                validate_access_integrity,
                stored_metadata,
                start,
            )
        assert common_state is not None  # loaded with the selection, or it raised on every rank
        prepared = prepare_load_request(
            sharded_state_dict,
            strict,
            validate_access_integrity,
            stored_metadata,
            common_state,
            lambda: sharded.load_tensors_metadata(ckpt),
        )
        request = prepared.sharded
        merge(common_state, prepared.nonpersistent)
        if not sharded.can_handle_sharded_objects:
            objects, request = extract_matching_values(
                request, lambda v: isinstance(v, ShardedObject)
            )
            loaded_objects = _dist.run_collectively(
                f"ShardedObject load from {ckpt}", common.load_sharded_objects, objects, ckpt
            )
            merge(common_state, loaded_objects)
        loaded = sharded.load(request, ckpt)
        return finish_load(prepared, common_state, loaded, strict, logger, ckpt, start)


def _sharded_metadata(
    ckpt: Path, sharded: LoadShardedStrategy, common: LoadCommonStrategy
) -> ShardedStateDict:
    metadata = sharded.load_sharded_metadata(ckpt)
    if not sharded.can_handle_sharded_objects:
        metadata = merge(metadata, common.load_sharded_metadata(ckpt))
    return metadata


def load_common_state_dict(checkpoint_dir: PathArg) -> StateDict:
    """Loads only the common state of a checkpoint (node-local: this rank's). Not collective."""
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
    """Returns tensors (by key) and ShardedObjects (by unique key), no data. Not collective."""
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
    """Returns the `content_metadata` given to `save` (or None), read from
    `preloaded_state_dict` (a loaded common or full state dict) or else `checkpoint_dir`.

    Raises:
        CheckpointingException: if neither argument is given.
    """
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise CheckpointingException("Give checkpoint_dir or preloaded_state_dict")
        preloaded_state_dict = load_common_state_dict(checkpoint_dir)
    return preloaded_state_dict.get(CONTENT_METADATA_KEY)


def remove_sharded_tensors(checkpoint_dir: PathArg, key_prefix: str) -> None:
    """Removes the tensors whose keys start with `key_prefix` (saved with that separation
    hint). Not collective: run it on one process.

    Raises:
        CheckpointingException: `checkpoint_dir` was written by stock DCP (never modified).
    """
    if is_stock_dcp_checkpoint(checkpoint_dir):
        raise CheckpointingException(
            f"{checkpoint_dir} was written by stock PyTorch DCP: it is read, never modified"
        )
    sharded, _ = verify_checkpoint_and_load_strategy(checkpoint_dir)
    sharded.remove_sharded_tensors(Path(checkpoint_dir), key_prefix)
