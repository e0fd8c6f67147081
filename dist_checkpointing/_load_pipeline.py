"""The steps of `load` every backend (and `tensor_aware_state_dict`) shares: the preamble
from a user's request to what the strategies load (megatron objects, factories,
non-persistent values, strict modes, validation) and the epilogue that merges the result."""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, List, Optional, Set, Tuple, Union

from . import _dist, _normalize
from ._save_pipeline import agree, shard_records
from ._sharding_agreement import AgreementCache
from ._types import ShardedStateDict, StateDict
from .dict_utils import dict_list_map_inplace, extract_matching_values, merge
from .errors import KeyMismatchError
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
)
from .quantized import dequantizing
from .validation import StrictHandling, validate_integrity_and_strict_load

__all__ = ["LoadRequest", "complete_request", "finish_load", "prepare_load_request"]

logger = logging.getLogger(__name__)


def _detached(leaf: Any) -> Any:
    """A copy of a ShardedTensor whose destination requires grad, detached (same storage),
    so in-place loads from reader threads work whatever their grad mode."""
    if isinstance(leaf, ShardedTensor) and leaf.data is not None and leaf.data.requires_grad:
        leaf = copy.copy(leaf)
        leaf.data = leaf.data.detach()
    return leaf


@dataclass
class LoadRequest:
    """A load request after `prepare_load_request`: the sharded leaves to load, the
    non-persistent values and factories to merge back, and the key mismatches found."""

    sharded: ShardedStateDict
    nonpersistent: StateDict
    factories: Any
    missing_keys: Set[str]
    unexpected_keys: Set[str]
    #: the plain values requested (loaded from the common state, or named as missing)
    plain: Any = None
    #: Stateful objects of the request, handed their loaded state at the end
    statefuls: Optional[List[Tuple[Tuple[Any, ...], Any]]] = None


#: this process's memory of the last load request validation that passed
_load_agreement = AgreementCache()


def prepare_load_request(
    sharded_state_dict: ShardedStateDict,
    strict: StrictHandling,
    validate_access_integrity: bool,
    stored_metadata: Callable[[], Optional[ShardedStateDict]],
    common: Optional[StateDict] = None,
    stored_tensor_keys: Optional[Callable[[], Collection[str]]] = None,
) -> LoadRequest:
    """The load preamble: factories, non-persistent values, strict handling, validation
    (collective when these need every rank's request; `stored_metadata` called only if needed).
    `common`, the checkpoint's common state, lets DTensors load from plain tensors in it;
    `stored_tensor_keys` (not collective) lets plain tensors it lacks load from tensor items.
    Raises `KeyMismatchError` or `ShardingIntegrityError` on every rank."""
    # opted in, a plain destination stored quantized is dequantized: the stored keys tell
    stored = (stored_metadata() or {}) if dequantizing() else None
    # an error (a leaf that cannot be placed) is raised on every rank with the agreement below
    sd, statefuls, error = _normalize.for_load(
        sharded_state_dict, stored, common, stored_tensor_keys
    )
    factories, _ = extract_matching_values(
        sd, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
    )
    apply_factories(sd)
    nonpersistent, sd = extract_matching_values(
        sd, lambda x: isinstance(x, LocalNonpersistentObject)
    )
    dict_list_map_inplace(lambda o: o.unwrap(), nonpersistent)
    request, plain = extract_matching_values(sd, lambda x: isinstance(x, ShardedBase))
    dict_list_map_inplace(_detached, request)
    ckpt_metadata = None
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        ckpt_metadata = stored_metadata() if stored is None else stored
    request, missing, unexpected = validate_integrity_and_strict_load(
        request, strict, False, None, None, ckpt_metadata
    )
    if validate_access_integrity:  # keys the checkpoint lacks are out of the request by now
        agree(shard_records(request), _load_agreement, error=error, what="load")
    elif error is not None:  # not collective then: fail here alone
        raise error
    return LoadRequest(request, nonpersistent, factories, missing, unexpected, plain, statefuls)


def finish_load(
    prepared: LoadRequest,
    result: StateDict,
    loaded: StateDict,
    strict: StrictHandling,
    log: logging.Logger,
    ckpt: Any,
    start: float,
) -> Union[StateDict, Tuple[StateDict, Set[str], Set[str]]]:
    """The load epilogue: merges `loaded` into `result` (the common state with non-persistent
    values), applies factory merges, logs on `log`, and returns `result` (or
    `(result, missing_keys, unexpected_keys)` when `strict` returns them)."""
    merge(result, loaded)
    apply_factory_merges(result, prepared.factories)
    complete_request(prepared, result, strict)
    _dist.log_rank0(
        log, logging.INFO, "Loaded checkpoint %s in %.2f s", ckpt, time.perf_counter() - start
    )
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return result, prepared.missing_keys, prepared.unexpected_keys
    return result


def complete_request(prepared: LoadRequest, result: StateDict, strict: StrictHandling) -> None:
    """The last step of every load, once the loaded values are merged into `result`: the
    requested plain values are checked (`strict`) and plain tensors filled in place; the
    request's Stateful objects get their state (`load_state_dict`) and their places back."""
    _check_plain_values(prepared, result, strict)
    _normalize.fill_plain(prepared.plain, result)
    _normalize.restore_statefuls(result, prepared.statefuls or [])


def _check_plain_values(prepared: LoadRequest, result: StateDict, strict: StrictHandling) -> None:
    """Plain values requested but absent from the checkpoint's common state are unexpected
    keys, handled by `strict` as for tensors (raised by default, as DCP does)."""
    absent = _normalize.missing_plain_keys(prepared.plain, result)
    if not absent or strict == StrictHandling.IGNORE_ALL:
        return
    if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
        logger.warning("Requested plain values not in the checkpoint: %s", sorted(absent))
    elif StrictHandling.requires_returning_mismatch_keys(strict):
        prepared.unexpected_keys |= absent
    else:
        raise KeyMismatchError(
            f"Requested values not in the checkpoint's common state: {sorted(absent)[:20]} "
            "(load with strict='log_unexpected' or 'return_unexpected' to skip them, or drop "
            "them from the request)"
        )
