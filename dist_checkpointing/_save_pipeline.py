"""The steps of `serialization.save` shared by every backend: preparation, validation, commit."""

from __future__ import annotations

import hashlib
import logging
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple, Union

from . import _dist
from ._prepare import nested_sharded, save_preprocess
from ._sharding_agreement import AgreementCache, agreement_protocol
from ._sharding_records import ShardRecord, record_of
from ._types import CommonStateDict, ShardedStateDict, StateDict
from .coordination import run as run_protocol
from .core import CheckpointingConfig, check_is_distributed_checkpoint, save_config
from .dict_utils import diff, extract_matching_values
from .errors import CheckpointExistsError, CheckpointingException
from .mapping import ShardedObject
from .storage import objstore
from .strategies.base import (
    AsyncSaveShardedStrategy,
    NodeLocalSaveShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    resolve_strategy,
)

__all__ = ["SavePlan", "prepare_save", "agree_on_preparation", "save_common", "make_commit"]

logger = logging.getLogger(__name__)

#: `(function, args)` calls run in an async save's background writer
DeferredCalls = List[Tuple[Callable[..., Any], Tuple[Any, ...]]]


@dataclass
class SavePlan:
    """What `prepare_save` worked out on one rank."""

    sharded: SaveShardedStrategy
    common: SaveCommonStrategy
    node_local: bool
    sharded_part: ShardedStateDict
    common_part: CommonStateDict
    records: List[ShardRecord]
    common_digest: str
    deferred_common: Optional[DeferredCalls]


def prepare_save(
    sharded_state_dict: ShardedStateDict,
    ckpt: Path,
    sharded_strategy: Any,
    common_strategy: Any,
    async_sharded_save: bool,
    content_metadata: Optional[dict],
    preprocess_common: Union[Callable[[CommonStateDict], StateDict], bool, None],
) -> SavePlan:
    """The local part of a save's preparation (no collectives; may raise). `preprocess_common`:
    None (no cross-rank comparison), True (compare as is) or the caller's function."""
    sharded = resolve_strategy(StrategyAction.SAVE_SHARDED, sharded_strategy, ("torch_dist", 1))
    common = resolve_strategy(StrategyAction.SAVE_COMMON, common_strategy, ("torch", 1))
    node_local = isinstance(sharded, NodeLocalSaveShardedStrategy)
    if async_sharded_save and not isinstance(sharded, AsyncSaveShardedStrategy):
        raise CheckpointingException(
            f"Cannot apply async_save to non-async strategy {sharded}: it does not support "
            "async save"
        )
    # node-local: every rank has its own directory to check
    if (node_local or _dist.get_rank() == 0) and check_is_distributed_checkpoint(ckpt):
        raise CheckpointExistsError(
            f"{ckpt} already holds a complete checkpoint; refusing to overwrite it. Save to "
            "a new directory (e.g. one per iteration, iter_0000200), or remove this one "
            "first (shutil.rmtree on one rank, then a barrier) if it is no longer needed"
        )
    if objstore.is_file(ckpt):
        raise CheckpointingException(
            f"{ckpt} is a regular file; a checkpoint is a directory: save to another path"
        )
    sharded_part, common_part = save_preprocess(sharded_state_dict, content_metadata)
    for sh in nested_sharded(sharded_part):
        sh.validate_metadata_integrity()
    objstore.makedirs(ckpt)  # for a prefix: checks that its bucket can be reached
    records = [r for r in map(record_of, nested_sharded(sharded_part)) if r is not None]
    deferred = None
    if async_sharded_save and sharded.can_handle_sharded_objects and not node_local:
        deferred = common.deferred_save_common(common_part, ckpt)
    digest = _common_digest(common_part, preprocess_common)
    return SavePlan(
        sharded, common, node_local, sharded_part, common_part, records, digest, deferred
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


#: this process's memory of the last save validation that passed
_save_agreement = AgreementCache()


def agree_on_preparation(
    plan: Optional[SavePlan],
    error: Optional[BaseException],
    ckpt: Path,
    validate_access_integrity: bool,
    preprocess_common: Optional[Callable[[CommonStateDict], StateDict]],
) -> SavePlan:
    """Collective: agrees on preparation failures (raising on every rank), then checks the
    global sharding by key (`_sharding_agreement`; skipped when no rank's shards changed)."""
    agreement = run_protocol(
        agreement_protocol(
            _dist.get_rank(),
            _dist.get_world_size(),
            plan.records if plan is not None else [],
            _save_agreement,
            error=error,
            common_digest=plan.common_digest.encode() if plan is not None else b"",
            validate=validate_access_integrity,
            what=f"save to {ckpt}",
        )
    )
    assert plan is not None
    if validate_access_integrity and agreement.common_differs:
        _log_common_differences(plan.common_part, preprocess_common)
    return plan


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
            msg = "Common state differs between rank 0 and rank %d (rank 0's is saved): only on "
            msg += "rank 0: %s, only on rank %d: %s, different values: %s"
            mismatched = [m[0] for m in mismatch[:10]]
            logger.warning(msg, rank, only_0[:10], rank, only_r[:10], mismatched)


def save_common(plan: SavePlan, ckpt: Path) -> ShardedStateDict:
    """Writes the common state (and ShardedObjects the sharded strategy cannot store);
    returns what is left for the sharded strategy."""
    plan.common.save_common(plan.common_part, ckpt)
    if plan.sharded.can_handle_sharded_objects:
        return plan.sharded_part
    objects, rest = extract_matching_values(
        plan.sharded_part, lambda v: isinstance(v, ShardedObject)
    )
    plan.common.save_sharded_objects(objects, ckpt)
    return rest


def make_commit(plan: SavePlan, ckpt: Path, start: float) -> Callable[[], None]:
    """The collective commit, run once every rank's data is durable: `metadata.json` by
    rank 0 (by every rank for node-local saves)."""

    def commit() -> None:
        def write_config() -> None:
            if plan.node_local or _dist.get_rank() == 0:
                s, c = plan.sharded, plan.common
                save_config(CheckpointingConfig(s.backend, s.version, c.backend, c.version), ckpt)

        _dist.run_collectively(f"commit of {ckpt}", write_config)
        _dist.log_rank0(
            logger, logging.INFO, "Saved checkpoint %s in %.2f s", ckpt, time.perf_counter() - start
        )

    return commit
