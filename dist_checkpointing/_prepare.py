"""From a user's sharded state dict to what save and load work on; the shared load preamble.

Used by `serialization` (checkpoint directories) and `tensor_aware_state_dict` (local
checkpoints), so both treat megatron-core's mapping objects (converted to ours first), factories, LocalNonpersistentObjects, strict modes and sharding
validation the same way.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Set, Tuple, Union

from . import _dist
from ._flat import expand_flat_shards
from ._types import CommonStateDict, ShardedStateDict, StateDict
from .dict_utils import dict_list_map_inplace, extract_matching_values, merge, nested_values
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
)
from .megatron_compat import convert_sharded_state_dict
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
    """A copy of a ShardedTensor whose destination requires grad (a parameter), detached.

    Loads write into the destination in place, also from reader threads, where grad mode
    is on whatever the caller set; the detached tensor shares the parameter's storage, so
    the parameter still receives the values. The caller's object is not modified.
    """
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
    """Splits a state to save into `(sharded leaves, common state)`.

    Flat shards become their ordinary pieces (see `_flat`), factories are applied and
    LocalNonpersistentObjects dropped, on a copy of the containers (the caller's dict is
    not modified).

    Args:
        sharded_state_dict: the state.
        content_metadata: stored under `CONTENT_METADATA_KEY` in the common state if given.

    Returns:
        The sharded part and the common part.
    """
    sd = expand_flat_shards(convert_sharded_state_dict(_shallow_copy(sharded_state_dict)))
    if content_metadata is not None:
        sd[CONTENT_METADATA_KEY] = content_metadata
    apply_factories(sd)
    _, sd = extract_matching_values(sd, _is_nonpersistent)
    return extract_matching_values(sd, lambda x: isinstance(x, ShardedBase))


@dataclass
class LoadRequest:
    """A load request after the preamble (see `prepare_load_request`).

    Attributes:
        sharded: the sharded leaves to load (factories applied, strict mode applied).
        nonpersistent: the LocalNonpersistentObjects' local values, to merge into the result.
        factories: the factories, for `apply_factory_merges` on the loaded result.
        missing_keys: requested keys absent from the checkpoint (when the mode computes them).
        unexpected_keys: stored keys not requested (when the mode computes them).
    """

    sharded: ShardedStateDict
    nonpersistent: StateDict
    factories: Any
    missing_keys: Set[str]
    unexpected_keys: Set[str]


def prepare_load_request(
    sharded_state_dict: ShardedStateDict,
    strict: StrictHandling,
    validate_access_integrity: bool,
    stored_metadata: Callable[[], Optional[ShardedStateDict]],
) -> LoadRequest:
    """The load preamble: factories, non-persistent values, strict handling, validation.

    Collective when `validate_access_integrity` or `strict` needs every rank's request
    (and whatever `stored_metadata` does); every rank calls it with the same flags.

    Args:
        sharded_state_dict: what the caller asks to load (not modified).
        strict: key mismatch handling.
        validate_access_integrity: check the request's sharding across ranks.
        stored_metadata: returns the checkpoint's `{key: sharded metadata}`; called only
            when `strict` compares requested and stored keys.

    Returns:
        The prepared request.

    Raises:
        KeyMismatchError: under a raising strict mode.
        ShardingIntegrityError: the request's sharding is invalid (on every rank).
    """
    # flat shards become factories of ordinary pieces, merged back into the flat tensor
    sd = expand_flat_shards(convert_sharded_state_dict(_shallow_copy(sharded_state_dict)))
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
        ckpt_metadata = stored_metadata()
    local_md, global_md = None, None
    if validate_access_integrity or StrictHandling.requires_global_app_metadata(strict):
        local_md = [sh.without_data() for sh in nested_sharded(request)]
        global_md = _dist.all_gather_object(local_md)
    request, missing, unexpected = validate_integrity_and_strict_load(
        request, strict, validate_access_integrity, local_md, global_md, ckpt_metadata
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
    """The load epilogue every flow shares: merge, factory merges, the INFO line, the result.

    Args:
        prepared: the request `prepare_load_request` returned.
        result: the common state, the non-persistent values already merged into it.
        loaded: what the sharded strategy loaded; merged into `result`.
        strict: key mismatch handling (decides the return form).
        log: the logger of the entry point (its name shows in the INFO line).
        ckpt: the checkpoint directory, for the INFO line.
        start: `time.perf_counter()` at the start of the load.

    Returns:
        `result`, or `(result, missing_keys, unexpected_keys)` when `strict` returns them.
    """
    merge(result, loaded)
    apply_factory_merges(result, prepared.factories)
    _dist.log_rank0(
        log, logging.INFO, "Loaded checkpoint %s in %.2f s", ckpt, time.perf_counter() - start
    )
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return result, prepared.missing_keys, prepared.unexpected_keys
    return result
