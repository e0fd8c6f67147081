"""From a user's sharded state dict to what save and load work on, shared by `serialization`
and `tensor_aware_state_dict`: megatron objects, factories, non-persistent values, strict
modes and validation are treated the same way."""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Set, Tuple, Union

from . import _dist
from ._flat import expand_flat_shards
from ._sharding_agreement import AgreementCache, agreement_protocol
from ._sharding_records import record_of
from ._types import CommonStateDict, ShardedStateDict, StateDict
from .coordination import run as run_protocol
from .dict_utils import dict_list_map_inplace, extract_matching_values, merge, nested_values
from .errors import CheckpointingException
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
)
from .megatron_compat import convert_sharded_state_dict
from .quantized import dequantizing, expand_quantized
from .validation import StrictHandling, validate_integrity_and_strict_load

__all__ = [
    "CONTENT_METADATA_KEY",
    "LoadRequest",
    "finish_load",
    "nested_sharded",
    "prepare_load_request",
    "save_preprocess",
]

#: Key of `save(content_metadata=...)` in the common state.
CONTENT_METADATA_KEY = "content_metadata"


def _shallow_copy(tree: Any) -> Any:
    """Copies the dict/list containers (not the leaves) so preprocessing never edits the caller's."""
    return (
        extract_matching_values(tree, lambda _: True)[0] if isinstance(tree, (dict, list)) else tree
    )


def _is_nonpersistent(x: Any) -> bool:
    return isinstance(x, LocalNonpersistentObject)


def _detached(leaf: Any) -> Any:
    """A copy of a ShardedTensor whose destination requires grad, detached (same storage),
    so in-place loads from reader threads work whatever their grad mode."""
    if isinstance(leaf, ShardedTensor) and leaf.data is not None and leaf.data.requires_grad:
        leaf = copy.copy(leaf)
        leaf.data = leaf.data.detach()
    return leaf


def nested_sharded(tree: Any) -> List[ShardedBase]:
    """The sharded leaves of `tree`, in traversal order."""
    return (
        [v for v in nested_values(tree) if isinstance(v, ShardedBase)]
        if isinstance(tree, (dict, list))
        else []
    )


def save_preprocess(
    sharded_state_dict: ShardedStateDict, content_metadata: Optional[dict]
) -> Tuple[ShardedStateDict, CommonStateDict]:
    """Splits a state to save into `(sharded leaves, common state)`, on a copy of the
    containers: flat shards expanded, factories applied, LocalNonpersistentObjects dropped,
    `content_metadata` (if given) stored under `CONTENT_METADATA_KEY`."""
    sd = expand_flat_shards(convert_sharded_state_dict(_shallow_copy(sharded_state_dict)))
    expand_quantized(sd)
    if content_metadata is not None:
        sd[CONTENT_METADATA_KEY] = content_metadata
    apply_factories(sd)
    _, sd = extract_matching_values(sd, _is_nonpersistent)
    return extract_matching_values(sd, lambda x: isinstance(x, ShardedBase))


@dataclass
class LoadRequest:
    """A load request after `prepare_load_request`: the sharded leaves to load, the
    non-persistent values and factories to merge back, and the key mismatches found."""

    sharded: ShardedStateDict
    nonpersistent: StateDict
    factories: Any
    missing_keys: Set[str]
    unexpected_keys: Set[str]


#: this process's memory of the last load request validation that passed
_load_agreement = AgreementCache()


def prepare_load_request(
    sharded_state_dict: ShardedStateDict,
    strict: StrictHandling,
    validate_access_integrity: bool,
    stored_metadata: Callable[[], Optional[ShardedStateDict]],
) -> LoadRequest:
    """The load preamble: factories, non-persistent values, strict handling, validation
    (collective when these need every rank's request; `stored_metadata` called only if needed).
    Raises `KeyMismatchError` or `ShardingIntegrityError` on every rank."""
    sd = expand_flat_shards(convert_sharded_state_dict(_shallow_copy(sharded_state_dict)))
    # opted in, a plain destination stored quantized is dequantized: the stored keys tell
    stored = (stored_metadata() or {}) if dequantizing() else None
    error: Optional[Exception] = None
    try:
        expand_quantized(sd, stored)
    except CheckpointingException as e:  # with the agreement below, raised on every rank
        error = e
    factories, _ = extract_matching_values(
        sd, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
    )
    apply_factories(sd)
    nonpersistent, sd = extract_matching_values(sd, _is_nonpersistent)
    dict_list_map_inplace(lambda o: o.unwrap(), nonpersistent)
    request, _ = extract_matching_values(sd, lambda x: isinstance(x, ShardedBase))
    dict_list_map_inplace(_detached, request)
    ckpt_metadata = None
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        ckpt_metadata = stored_metadata() if stored is None else stored
    request, missing, unexpected = validate_integrity_and_strict_load(
        request, strict, False, None, None, ckpt_metadata
    )
    if not validate_access_integrity:  # not collective then: fail here alone
        if error is not None:
            raise error
    else:  # keys the checkpoint lacks are out of the request by now
        records = [r for r in map(record_of, nested_sharded(request)) if r is not None]
        run_protocol(
            agreement_protocol(
                _dist.get_rank(),
                _dist.get_world_size(),
                records,
                _load_agreement,
                error=error,
                what="load",
            )
        )
    return LoadRequest(request, nonpersistent, factories, missing, unexpected)


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
    _dist.log_rank0(
        log, logging.INFO, "Loaded checkpoint %s in %.2f s", ckpt, time.perf_counter() - start
    )
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return result, prepared.missing_keys, prepared.unexpected_keys
    return result
