"""Which load strategies read a checkpoint: `metadata.json`, the registry, compatibility checks.

`verify_checkpoint_and_load_strategy` is the local check (re-exported by `serialization`);
`select_load_strategies` is its collective form used by `load`, including the one node-local
rule: a rank whose node lost its copy of a node-local checkpoint adopts the other ranks'
record, since its part can be fetched from a replica holder.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional, Tuple, Union

from . import _dist
from ._types import StateDict
from .core import maybe_load_config
from .errors import CheckpointingException, NotACheckpointError
from .strategies.base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    NodeLocalLoadShardedStrategy,
    StrategyAction,
    resolve_strategy,
)

__all__ = ["verify_checkpoint_and_load_strategy", "compatible_strategy", "select_load_strategies"]

logger = logging.getLogger(__name__)

PathArg = Union[str, "os.PathLike[str]"]


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
        raise NotACheckpointError(f"{path} is not a distributed checkpoint: no metadata.json")
    sharded = compatible_strategy(
        StrategyAction.LOAD_SHARDED,
        sharded_strategy,
        config.sharded_backend,
        config.sharded_backend_version,
    )
    common = compatible_strategy(
        StrategyAction.LOAD_COMMON,
        common_strategy,
        config.common_backend,
        config.common_backend_version,
    )
    return sharded, common


def compatible_strategy(action: StrategyAction, spec: Any, backend: str, version: int) -> Any:
    """The given (or registered) load strategy for `(backend, version)`, checked compatible."""
    strategy = resolve_strategy(action, spec, (backend, version))
    strategy.check_backend_compatibility(backend)
    strategy.check_version_compatibility(version)
    return strategy


def select_load_strategies(
    ckpt: Path, sharded_strategy: Any, common_strategy: Any
) -> Tuple[LoadShardedStrategy, LoadCommonStrategy, Optional[StateDict]]:
    """Collective: the load strategies for `ckpt`, checked on every rank, and the
    checkpoint's common state, agreed on in the same exchange (each exchange of a 4-rank
    load cost 3-10 ms on this project's 2-core VM).

    A rank whose directory lacks the checkpoint (its node lost it) adopts the record of
    the other ranks when they hold a node-local checkpoint, whose parts can be fetched from
    replica holders; otherwise every rank raises.

    Args:
        ckpt: the checkpoint directory.
        sharded_strategy: instance or `(backend, version)`; None: from `metadata.json`.
        common_strategy: the same for the common state.

    Returns:
        `(sharded strategy, common strategy, common state)`; the common state is None for
        node-local checkpoints, whose ranks each read their own with their part.

    Raises:
        CheckpointingException: on every rank, where any rank found no usable checkpoint
            or strategy, or failed to load the common state.
    """
    found: Optional[Tuple[LoadShardedStrategy, LoadCommonStrategy]] = None
    error: Optional[BaseException] = None
    config = None
    common_state: Optional[StateDict] = None
    common_error: Optional[BaseException] = None
    try:
        found = verify_checkpoint_and_load_strategy(ckpt, sharded_strategy, common_strategy)
        if isinstance(found[0], NodeLocalLoadShardedStrategy):
            config = maybe_load_config(ckpt)
        else:
            try:
                common_state = found[1].load_common(ckpt)
                if common_state is None:
                    raise CheckpointingException(f"{found[1]} returned no common state for {ckpt}")
            except Exception as e:  # agreed on below
                common_error = e
    except Exception as e:  # agreed on below
        error = e
    reports = _dist.all_gather_object(
        (_dist.error_report(error), config, _dist.error_report(common_error))
    )
    records = [r[1] for r in reports if r[1] is not None]
    failures = [r[0] for r in reports if r[0] is not None]
    what = f"load from {ckpt} (preparation)"
    if not failures:
        assert found is not None
        _dist.raise_on_reported_errors(
            [r[2] for r in reports], common_error, f"load of common state from {ckpt}"
        )
        return found[0], found[1], common_state
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
                compatible_strategy(
                    StrategyAction.LOAD_SHARDED,
                    sharded_strategy,
                    record.sharded_backend,
                    record.sharded_backend_version,
                ),
                compatible_strategy(
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
    return found[0], found[1], None
