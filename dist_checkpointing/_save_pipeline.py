"""The steps of `save` every backend shares: preparing a user's state dict (megatron
objects, factories, non-persistent values, validation), the save's agreement, common state
and commit; and the sharding agreement the load steps (`_load_pipeline`) use too."""

from __future__ import annotations

import hashlib
import logging
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional, Set, Tuple

from . import _dist, _normalize
from ._claim import token_lanes
from ._dcp_plain import PLAIN_ITEMS_KEY, check_no_collision, plain_items
from ._save_ownership import Ownership
from ._sharding_agreement import AgreementCache, ShardRecord, agreement_protocol, record_of
from ._types import CommonStateDict, ShardedStateDict, StateDict
from .coordination import run as run_protocol
from .core import CheckpointingConfig, check_is_distributed_checkpoint, save_config
from .dict_utils import diff, extract_matching_values, nested_values
from .errors import CheckpointExistsError, CheckpointingException
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    apply_factories,
)
from .storage import objstore
from .strategies.base import (
    AsyncSaveShardedStrategy,
    NodeLocalSaveShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    resolve_strategy,
    strategy_label,
)

__all__ = [
    "CONTENT_METADATA_KEY",
    "SavePlan",
    "agree",
    "agree_on_preparation",
    "make_commit",
    "nested_sharded",
    "prepare_save",
    "save_common",
    "save_preprocess",
    "shard_records",
]

logger = logging.getLogger(__name__)

#: Key of `save(content_metadata=...)` in the common state.
CONTENT_METADATA_KEY = "content_metadata"


def _is_nonpersistent(x: Any) -> bool:
    return isinstance(x, LocalNonpersistentObject)


def nested_sharded(tree: Any) -> List[ShardedBase]:
    """The sharded leaves of `tree`, in traversal order."""
    if not isinstance(tree, (dict, list)):
        return []
    return [v for v in nested_values(tree) if isinstance(v, ShardedBase)]


def shard_records(tree: Any) -> List[ShardRecord]:
    """The agreement records (`_sharding_agreement`) of the sharded leaves of `tree`."""
    return [r for r in map(record_of, nested_sharded(tree)) if r is not None]


def agree(records: List[ShardRecord], cache: AgreementCache, **kwargs: Any) -> Any:
    """Collective: this rank's side of `agreement_protocol`; returns its `Agreement`."""
    rank, world = _dist.get_rank(), _dist.get_world_size()
    return run_protocol(agreement_protocol(rank, world, records, cache, **kwargs))


def save_preprocess(
    sharded_state_dict: ShardedStateDict, content_metadata: Optional[dict]
) -> Tuple[ShardedStateDict, CommonStateDict]:
    """Splits a state to save into `(sharded leaves, common state)`, on a copy of the
    containers: flat shards expanded, factories applied, LocalNonpersistentObjects dropped,
    `content_metadata` (if given) stored under `CONTENT_METADATA_KEY`."""
    sd = _normalize.for_save(sharded_state_dict)
    if content_metadata is not None:
        sd[CONTENT_METADATA_KEY] = content_metadata
    apply_factories(sd)
    _, sd = extract_matching_values(sd, _is_nonpersistent)
    return extract_matching_values(sd, lambda x: isinstance(x, ShardedBase))


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
    ownership: Ownership
    async_save: bool = False

    def flow(self) -> str:
        """How this rank saves, as the agreement compares it across ranks."""
        how = "async" if self.async_save else "sync"
        return f"{strategy_label(self.sharded)} and {strategy_label(self.common)}, {how}"


def prepare_save(
    sharded_state_dict: ShardedStateDict,
    ckpt: Path,
    sharded_strategy: Any,
    common_strategy: Any,
    async_sharded_save: bool,
    content_metadata: Optional[dict],
    validate_access_integrity: bool,
    preprocess_common: Optional[Callable[[CommonStateDict], StateDict]],
) -> SavePlan:
    """The local part of a save's preparation (no collectives; may raise); its last step
    claims the directory (rank 0; every rank for node-local backends)."""
    if not isinstance(sharded_state_dict, dict):
        raise CheckpointingException(
            f"save to {ckpt}: the state to save must be a dict (of names to ShardedTensors, "
            f"other sharded objects and plain values), got a {type(sharded_state_dict).__name__}"
            "; wrap it, e.g. {'model': state}"
        )
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
    # the claiming rank alone creates a shared directory, so it knows whether this save
    # created it (and removes it again if the save is refused); for a prefix every rank
    # checks that its bucket can be reached
    if node_local or _dist.get_rank() == 0 or objstore.split(ckpt) is not None:
        objstore.makedirs(ckpt)
    records = shard_records(sharded_part)
    if getattr(sharded, "records_plain_values", False) and _dist.get_rank() == 0:
        sharded_part = _with_plain_items(sharded_part, common_part)
    deferred = None
    if async_sharded_save and sharded.can_handle_sharded_objects and not node_local:
        deferred = common.deferred_save_common(common_part, ckpt)
    digest = _common_digest(common_part, preprocess_common) if validate_access_integrity else ""
    ownership = Ownership(ckpt, node_local)
    ownership.take()  # last: nothing after it may fail and leave the claim behind
    return SavePlan(
        sharded,
        common,
        node_local,
        sharded_part,
        common_part,
        records,
        digest,
        deferred,
        ownership,
        async_sharded_save,
    )


def _with_plain_items(sharded_part: ShardedStateDict, common: CommonStateDict) -> ShardedStateDict:
    """Rank 0: the sharded part plus the common state's plain values as DCP items (for
    stock `dcp.load`; `common.pt` keeps them for us and megatron-core), under a reserved key
    only strategies with `records_plain_values` read.

    Raises:
        CheckpointingException: a plain value's flat name is also a sharded key (named).
    """
    items = plain_items(common)
    check_no_collision(items, nested_sharded(sharded_part))
    return {**sharded_part, PLAIN_ITEMS_KEY: items} if items else sharded_part


def _common_digest(common: CommonStateDict, preprocess: Any) -> str:
    """A digest of the common state as compared across ranks. Tensors enter as digests of
    their values: a pickled tensor holds its storage's address, which differs between ranks
    even when the values agree, and would make every save run `_compare_common`."""
    view = _normalize.plain_tensor_digests(preprocess(common) if callable(preprocess) else common)
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
    global sharding by key (`_sharding_agreement`; skipped when no rank's shards changed).
    The same agreement carries rank 0's claim token to every rank."""
    agreement = agree(
        plan.records if plan is not None else [],
        _save_agreement,
        error=error,
        common_digest=plan.common_digest.encode() if plan is not None else b"",
        validate=validate_access_integrity,
        what=f"save to {ckpt}",
        shared=plan.ownership.lanes() if plan is not None else token_lanes(None),
        # a rank validating alone would compare common states in a collective of its own
        flow=f"{plan.flow()}, validate_access_integrity={bool(validate_access_integrity)}"
        if plan is not None
        else "",
    )
    assert plan is not None
    plan.ownership.agreed(agreement.shared)
    if plan.node_local:
        plan.ownership.take_node_local()
    if validate_access_integrity and agreement.common_differs:
        _compare_common(plan.common_part, preprocess_common, ckpt)
    return plan


def _compare_common(
    common: CommonStateDict,
    preprocess: Optional[Callable[[CommonStateDict], StateDict]],
    ckpt: Path,
) -> None:
    """Collective: finds where ranks' common states differ, comparing digests of plain CPU
    copies of tensors (never the tensors, whose operators may be collectives). A tensor
    that differs raises on every rank (saving rank 0's would lose the others'); other
    differences are logged by rank 0 (rank 0's value is saved)."""
    view = _normalize.plain_tensor_digests(preprocess(common) if preprocess else common)
    gathered = _dist.all_gather_object(view)
    tensors: Set[str] = set()
    for rank, other in enumerate(gathered[1:], start=1):
        only_0, only_r, mismatch = diff(gathered[0], other)
        tensors |= {
            ".".join(map(str, path))
            for path, left, right in mismatch
            if issubclass(left, _normalize.TensorDigest)
            or issubclass(right, _normalize.TensorDigest)
        }
        if _dist.get_rank() == 0 and (only_0 or only_r or mismatch):
            msg = "Common state differs between rank 0 and rank %d (rank 0's is saved): only on "
            msg += "rank 0: %s, only on rank %d: %s, different values: %s"
            mismatched = [m[0] for m in mismatch[:10]]
            logger.warning(msg, rank, only_0[:10], rank, only_r[:10], mismatched)
    if tensors:
        raise CheckpointingException(
            f"Save to {ckpt}: plain tensors differ between ranks: {sorted(tensors)[:10]}. A "
            "plain tensor is saved once, so the other ranks' values would be lost: make it a "
            "ShardedTensor (or DTensor) if each rank holds its own piece, wrap it in "
            "LocalNonpersistentObject if it need not be saved, or drop it from the comparison "
            "with preprocess_common_before_consistancy_check if the difference is expected"
        )


def save_common(plan: SavePlan, ckpt: Path) -> ShardedStateDict:
    """Checks the claim, writes the common state (and ShardedObjects the sharded strategy
    cannot store); returns what is left for the sharded strategy."""
    plan.ownership.check("writing")
    plan.common.save_common(plan.common_part, ckpt)
    if plan.sharded.can_handle_sharded_objects:
        return plan.sharded_part
    objects, rest = extract_matching_values(
        plan.sharded_part, lambda v: isinstance(v, ShardedObject)
    )
    plan.common.save_sharded_objects(objects, ckpt)
    return rest


def make_commit(plan: SavePlan, ckpt: Path, start: float) -> Callable[[], None]:
    """The collective commit, run once every rank's data is durable: every rank checks the
    claim, then rank 0 (every rank for node-local saves) writes `metadata.json`
    (`Ownership.commit`)."""

    def commit() -> None:
        def write_config() -> None:
            if plan.node_local or _dist.get_rank() == 0:
                s, c = plan.sharded, plan.common
                save_config(CheckpointingConfig(s.backend, s.version, c.backend, c.version), ckpt)

        plan.ownership.commit(write_config)
        _dist.log_rank0(
            logger, logging.INFO, "Saved checkpoint %s in %.2f s", ckpt, time.perf_counter() - start
        )

    return commit
