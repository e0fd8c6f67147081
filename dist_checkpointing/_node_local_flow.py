"""`serialization.save`/`load` for node-local backends (`('local', 2)`): every rank writes its
own `metadata.json`, and its common state travels in its part."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Optional, Set, Tuple, Union

from . import _dist
from ._claim import SAVE_ID_KEY
from ._load_pipeline import finish_load, prepare_load_request
from ._save_pipeline import SavePlan
from ._types import ShardedStateDict, StateDict
from .async_save import AsyncRequest
from .dict_utils import merge
from .strategies.base import NodeLocalLoadShardedStrategy, NodeLocalSaveShardedStrategy
from .validation import StrictHandling

__all__ = ["save", "load"]

logger = logging.getLogger(__name__)

LoadResult = Union[StateDict, Tuple[StateDict, Set[str], Set[str]]]


def save(
    plan: SavePlan, ckpt: Path, async_sharded_save: bool, commit: Callable[[], None]
) -> Optional[AsyncRequest]:
    """Collective: writes every rank's state on its node, then `commit` (every rank writes
    its `metadata.json`); with `async_sharded_save`, returns the request instead."""
    sharded = plan.sharded
    assert isinstance(sharded, NodeLocalSaveShardedStrategy)
    # each rank's part names the save (rank 0's claim token), so that a load can tell a part
    # of another checkpoint (swapped or linked in) from one of this save
    common = {**plan.common_part, SAVE_ID_KEY: plan.ownership.save_id}
    if async_sharded_save:
        request = sharded.async_save_rank_state(plan.sharded_part, common, ckpt)
        request.add_finalize_fn(commit)
        return request
    sharded.save_rank_state(plan.sharded_part, common, ckpt)
    commit()
    return None


def load(
    sharded: NodeLocalLoadShardedStrategy,
    ckpt: Path,
    sharded_state_dict: ShardedStateDict,
    strict: StrictHandling,
    validate_access_integrity: bool,
    stored_metadata: Callable[[], Optional[ShardedStateDict]],
    start: float,
) -> LoadResult:
    """Collective: the node-local part of `serialization.load` (after strategy selection)."""

    def every_ranks_metadata() -> Optional[ShardedStateDict]:
        # each rank stores only its own part: the checkpoint's keys are the union of them
        union: ShardedStateDict = {}
        for part in _dist.all_gather_object(stored_metadata()):
            union.update(part or {})
        return union

    prepared = prepare_load_request(
        sharded_state_dict, strict, validate_access_integrity, every_ranks_metadata
    )
    common_state_dict, loaded = sharded.load_rank_state(prepared.sharded, ckpt)
    merge(common_state_dict, prepared.nonpersistent)
    return finish_load(prepared, common_state_dict, loaded, strict, logger, ckpt, start)
