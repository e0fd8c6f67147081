"""Which load strategies read a checkpoint: `metadata.json`, the registry, compatibility checks."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

from . import _dist
from ._types import StateDict
from .core import (
    DCP_METADATA_FNAME,
    STOCK_DCP_CONFIG,
    CheckpointingConfig,
    PathArg,
    is_stock_dcp_checkpoint,
    maybe_load_config,
)
from .errors import CheckpointCorruptedError, CheckpointingException, NotACheckpointError
from .seal import check_seal, config_damage, raise_findings, warn_unverified
from .storage import objstore
from .strategies.base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    NodeLocalLoadShardedStrategy,
    StrategyAction,
    resolve_strategy,
    strategy_label,
)

__all__ = [
    "verify_checkpoint_and_load_strategy",
    "check_sealed_checkpoint",
    "compatible_strategies",
    "select_load_strategies",
]

logger = logging.getLogger(__name__)


def verify_checkpoint_and_load_strategy(
    checkpoint_dir: PathArg,
    sharded_strategy: Union[LoadShardedStrategy, Tuple[str, int], None] = None,
    common_strategy: Union[LoadCommonStrategy, Tuple[str, int], None] = None,
) -> Tuple[LoadShardedStrategy, LoadCommonStrategy]:
    """Checks that `checkpoint_dir` is a complete checkpoint and picks strategies for it
    (from `metadata.json` unless given), each checked compatible with the recorded ones. A
    checkpoint written by stock PyTorch DCP (its `.metadata` and none of our files) reads as
    `STOCK_DCP_CONFIG`: tensors by torch_dist, non-tensor values by ('dcp', 1).

    Raises:
        NotACheckpointError: no such directory, or neither `metadata.json` nor a stock DCP
            `.metadata` in it.
        CheckpointCorruptedError: `metadata.json` is invalid, or differs from what the
            commit record (`checksums.json`) bound.
        CheckpointingException: no compatible strategy.
    """
    path = Path(checkpoint_dir)
    if not objstore.is_dir(path):
        raise NotACheckpointError(
            f"Checkpoint directory {path} does not exist or is not a directory"
        )
    config = maybe_load_config(path)
    if config is None and is_stock_dcp_checkpoint(path):
        config = STOCK_DCP_CONFIG
    if config is None:
        dcp = objstore.exists(path / DCP_METADATA_FNAME)
        raise NotACheckpointError(
            f"{path} is not a distributed checkpoint: no metadata.json"
            + (
                " (its .metadata is not that of a stock DCP checkpoint: a save of ours that "
                "did not finish, or not DCP metadata)"
                if dcp
                else " and no DCP .metadata (a save that did not finish, or not a checkpoint)"
            )
        )
    try:
        return compatible_strategies(config, sharded_strategy, common_strategy)
    except CheckpointingException as e:
        # a flipped bit in a backend name reads as an unknown backend: say what it is
        damage = config_damage(path)
        if damage is not None:
            raise CheckpointCorruptedError(damage) from e
        raise


def check_sealed_checkpoint(ckpt: Path) -> None:
    """The checks of a checkpoint's files against its commit record (`seal.check_seal`,
    whole files hashed) that a load runs on one rank; warns once when it has no checksums.

    Raises:
        CheckpointCorruptedError: naming each missing, extra, linked or damaged file.
    """
    findings, record = check_seal(ckpt, hash_files=True)
    raise_findings(ckpt, findings)
    if record is None:
        warn_unverified(ckpt)


def compatible_strategies(c: CheckpointingConfig, sharded: Any, common: Any) -> Tuple[Any, Any]:
    """The given (or registered) load strategies for config `c`, checked compatible."""
    found = []
    for action, spec, backend, version in (
        (StrategyAction.LOAD_SHARDED, sharded, c.sharded_backend, c.sharded_backend_version),
        (StrategyAction.LOAD_COMMON, common, c.common_backend, c.common_backend_version),
    ):
        strategy = resolve_strategy(action, spec, (backend, version))
        strategy.check_backend_compatibility(backend)
        strategy.check_version_compatibility(version)
        found.append(strategy)
    return found[0], found[1]


def select_load_strategies(
    ckpt: Path,
    sharded_strategy: Any,
    common_strategy: Any,
    options: Optional[Dict[str, Any]] = None,
) -> Tuple[LoadShardedStrategy, LoadCommonStrategy, Optional[StateDict]]:
    """Collective: `(sharded, common strategy, common state (None if node-local))` for `ckpt`,
    agreed in one small reduction (reports are exchanged only after a failure). A rank missing
    a node-local checkpoint adopts the others' record; other failures raise on every rank.

    The same reduction compares how the ranks load (their strategies and `options`, the
    arguments that decide which collectives follow, by name): ranks called differently would
    wait for each other in different collectives, so that raises on every rank, naming each
    rank's."""
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
            if _dist.get_rank() == 0 and getattr(found[0], "verify_checksums", True):
                check_sealed_checkpoint(ckpt)  # one rank: its error is agreed on below
            try:
                common_state = found[1].load_common(ckpt)
                if common_state is None:
                    raise CheckpointingException(f"{found[1]} returned no common state for {ckpt}")
            except Exception as e:  # agreed on below
                common_error = e
    except Exception as e:  # agreed on below
        error = e
    flow = "" if found is None else f"{strategy_label(found[0])} and {strategy_label(found[1])}"
    options = options or {}
    flow += "".join(f", {name}={value}" for name, value in options.items())
    failed, differ = _dist.failed_or_flows_differ(
        error is not None or common_error is not None, flow
    )
    if not failed:
        assert found is not None
        if differ:  # rare: who does what is gathered only then
            alike = " and ".join(["strategies", *options])
            _dist.raise_flows_differ(f"load from {ckpt}", flow, alike)
        return found[0], found[1], common_state  # one small reduction when all succeeded
    reports = _dist.all_gather_object(
        (_dist.error_report(error), config, _dist.error_report(common_error))
    )
    records = [r[1] for r in reports if r[1] is not None]
    failures = [r[0] for r in reports if r[0] is not None]
    what = f"load from {ckpt} (preparation)"
    if not failures:  # only loads of the common state failed: raises
        _dist.raise_on_reported_errors(
            [r[2] for r in reports], common_error, f"load of common state from {ckpt}"
        )
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
            found = compatible_strategies(record, sharded_strategy, common_strategy)
        except Exception as e:  # agreed on below
            error = e
    _dist.agree_on_errors(error, what)
    assert found is not None
    return found[0], found[1], None
