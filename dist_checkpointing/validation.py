"""Sharding integrity checks and strict-load handling: pure functions of metadata, except
the collective `determine_global_metadata`. The per-key checks and the distributed check a
save runs live in `_sharding_agreement`."""

from __future__ import annotations

import logging
from collections import defaultdict
from enum import Enum
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

from ._dist import (
    agree_on_errors,
    all_gather_object,
    all_reduce_max,
    error_report,
    is_distributed,
    raise_on_reported_errors,
)
from ._sharding_agreement import MAX_REPORTED, ShardRecord, format_problems, key_problems, record_of
from ._types import ShardedStateDict
from .dict_utils import dict_list_map_outplace, extract_matching_values, nested_values
from .errors import KeyMismatchError, ShardingIntegrityError, close_matches
from .mapping import ShardedBase, ShardedObject
from .megatron_compat import convert_object, convert_sharded_state_dict

__all__ = [
    "StrictHandling",
    "parse_strict_flag",
    "determine_global_metadata",
    "validate_sharding_integrity",
    "find_sharding_problems",
    "validate_integrity_and_strict_load",
    "determine_missing_and_unexpected_keys",
    "keys_requested_anywhere",
    "adjust_non_strict_load",
]

logger = logging.getLogger(__name__)

LocalMetadata = List[ShardedBase]
GlobalMetadata = List[LocalMetadata]
CkptShardedMetadata = Dict[str, ShardedBase]


class StrictHandling(Enum):
    """What `load` does when requested keys and checkpoint keys differ.

    "Unexpected" keys are requested but not in the checkpoint; "missing" keys are in the
    checkpoint but requested by no rank (`*_ALL` modes: needs every rank's request).
    """

    #: No check: an unexpected key fails inside the load strategy.
    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    #: Log unexpected keys (WARNING) and skip them.
    LOG_UNEXPECTED = "log_unexpected"
    #: Log unexpected and missing keys (WARNING); skip unexpected keys.
    LOG_ALL = "log_all"
    #: Raise before loading if any key is unexpected.
    RAISE_UNEXPECTED = "raise_unexpected"
    #: Raise before loading if any key is unexpected or missing.
    RAISE_ALL = "raise_all"
    #: Like RETURN_ALL, with missing_keys empty.
    RETURN_UNEXPECTED = "return_unexpected"
    #: Skip unexpected keys; `load` returns (state_dict, missing_keys, unexpected_keys).
    RETURN_ALL = "return_all"
    #: Skip unexpected keys silently.
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: StrictHandling) -> bool:
        """Whether `val` needs the checkpoint's key list before loading."""
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: StrictHandling) -> bool:
        """Whether `val` needs every rank's requested keys (an exchange between ranks)."""
        return val in (
            StrictHandling.IGNORE_ALL,
            StrictHandling.RAISE_ALL,
            StrictHandling.RETURN_ALL,
            StrictHandling.LOG_ALL,
        )

    @staticmethod
    def requires_returning_mismatch_keys(val: StrictHandling) -> bool:
        """Whether `load` returns `(state_dict, missing_keys, unexpected_keys)` under `val`."""
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: Union[str, StrictHandling]) -> StrictHandling:
    """Turns a `StrictHandling` or its string value into a `StrictHandling` (else ValueError)."""
    if isinstance(strict, StrictHandling):
        return strict
    try:
        return StrictHandling(strict)
    except (ValueError, TypeError) as e:
        choices = ", ".join(s.value for s in StrictHandling)
        raise ValueError(f"Invalid strict flag {strict!r}; expected one of: {choices}") from e


def determine_global_metadata(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[LocalMetadata, GlobalMetadata]:
    """Collective: call on all ranks. Returns (local_metadata, global_metadata): this rank's
    metadata-only shards, and every rank's, indexed by rank."""
    local: LocalMetadata = []
    error: Optional[BaseException] = None
    try:  # megatron-core's objects count like ours; anything unhandled fails on every rank
        copy = dict_list_map_outplace(lambda v: v, sharded_state_dict)
        local = _metadata(convert_sharded_state_dict(copy))
    except Exception as e:  # agreed on below, with the metadata exchange
        error = e
    gathered = all_gather_object((local, error_report(error)))
    raise_on_reported_errors([g[1] for g in gathered], error, "determine_global_metadata")
    return local, [g[0] for g in gathered]


def find_sharding_problems(global_metadata: GlobalMetadata) -> List[str]:
    """Lists what is wrong with a global sharding (empty when valid): ranks disagreeing on
    shape or dtype, main replicas that overlap or leave a gap, a key used as both a tensor
    and an object."""
    by_key: Dict[str, List[Tuple[int, ShardRecord]]] = defaultdict(list)
    for rank, local in enumerate(global_metadata):
        for leaf in local:
            rec = record_of(convert_object(leaf, f"rank {rank}'s metadata"))
            if rec is not None:
                by_key[rec.key].append((rank, rec))
    return [p for key, shards in by_key.items() for p in key_problems(key, shards)]


def validate_sharding_integrity(
    global_metadata: GlobalMetadata, common_state_dict: Optional[dict] = None
) -> None:
    """Checks that the shards of all ranks form valid global tensors and objects.

    Args:
        global_metadata: every rank's metadata-only shards, indexed by rank (as from
            `determine_global_metadata`), so every rank reaches the same verdict.
        common_state_dict: accepted for API compatibility; not inspected.

    Raises:
        ShardingIntegrityError: listing the problems (see `find_sharding_problems`).
    """
    problems = find_sharding_problems(global_metadata)
    if problems:
        raise ShardingIntegrityError(format_problems(problems))


def _metadata(sharded_state_dict: ShardedStateDict) -> LocalMetadata:
    return [
        sh.without_data() for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedBase)
    ]


def _sharded_key(sh: ShardedBase) -> str:
    return sh.unique_key if isinstance(sh, ShardedObject) else sh.key


def determine_missing_and_unexpected_keys(
    ckpt_sharded_metadata: CkptShardedMetadata,
    local_metadata: LocalMetadata,
    global_metadata: Optional[GlobalMetadata] = None,
) -> Tuple[Set[str], Set[str]]:
    """Returns (missing_keys, unexpected_keys): checkpoint keys no rank requested (empty
    without `global_metadata`), and keys this rank requested that the checkpoint lacks."""
    local_keys = {_sharded_key(sh) for sh in local_metadata}
    unexpected = local_keys - ckpt_sharded_metadata.keys()
    missing: Set[str] = set()
    if global_metadata is not None:
        requested = {_sharded_key(sh) for local in global_metadata for sh in local}
        missing = set(ckpt_sharded_metadata.keys()) - requested
    return missing, unexpected


def keys_requested_anywhere(ckpt_keys: Iterable[str], local_keys: Set[str]) -> Set[str]:
    """Collective: the checkpoint keys that some rank requests. One max-reduction of a flag
    per checkpoint key: the same size whatever the number of ranks."""
    ordered = sorted(ckpt_keys)
    flags = all_reduce_max([int(k in local_keys) for k in ordered])
    return {k for k, flag in zip(ordered, flags) if flag}


def adjust_non_strict_load(
    sharded_state_dict: ShardedStateDict, unexpected_keys: Set[str]
) -> ShardedStateDict:
    """Returns `sharded_state_dict` without the leaves whose key is in `unexpected_keys`."""
    if not unexpected_keys:
        return sharded_state_dict
    _, kept = extract_matching_values(
        sharded_state_dict,
        lambda x: isinstance(x, ShardedBase) and _sharded_key(x) in unexpected_keys,
    )
    return kept


def _listing(keys: Set[str]) -> str:
    shown = sorted(keys)[:MAX_REPORTED]
    more = f" and {len(keys) - MAX_REPORTED} more" if len(keys) > MAX_REPORTED else ""
    return f"{shown}{more}"


def _report(
    missing: Set[str], unexpected: Set[str], available: Optional[Sequence[str]] = None
) -> str:
    """The key-mismatch message ('' if none differ), in megatron-core's words (scripts match
    on them); `available` (checkpoint keys) feeds the close-match hints."""
    titles, bodies = [], []
    if missing:
        titles.append(
            "Some keys found in the checkpoint are missing in the provided sharded state dict."
        )
        bodies.append(
            f"Missing keys (for all ranks; in the checkpoint, requested by no rank): "
            f"{_listing(missing)}."
        )
    if unexpected:
        titles.append(
            "Unexpected keys (not found in the checkpoint) encountered in the provided "
            "sharded state dict."
        )
        bodies.append(
            f"Unexpected keys (for this rank; requested, not in the checkpoint): "
            f"{_listing(unexpected)}."
        )
        candidates = list(missing) if available is None else list(available)
        for key in sorted(unexpected)[:3]:  # a typo leaves its intended key unrequested
            hint = close_matches(key, candidates)
            if hint:
                bodies.append(f"{key!r}{hint}.")
    return " ".join(titles + bodies)


def validate_integrity_and_strict_load(
    sharded_state_dict: ShardedStateDict,
    strict: StrictHandling,
    validate_access_integrity: bool,
    local_metadata: Optional[LocalMetadata] = None,
    global_metadata: Optional[GlobalMetadata] = None,
    ckpt_sharded_metadata: Optional[CkptShardedMetadata] = None,
) -> Tuple[ShardedStateDict, Set[str], Set[str]]:
    """Applies the strict mode and the sharding integrity check before a load (raising
    modes are agreed on across ranks: collective when a process group is initialized).

    Returns:
        (sharded_state_dict without unexpected keys, missing_keys, unexpected_keys).

    Raises:
        KeyMismatchError: under RAISE_UNEXPECTED / RAISE_ALL when keys differ.
        ShardingIntegrityError: the request is invalid (with `validate_access_integrity`).
        ValueError: metadata needed by `strict` was not provided.
    """
    missing: Set[str] = set()
    unexpected: Set[str] = set()
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        if ckpt_sharded_metadata is None:
            raise ValueError(f"strict={strict} needs the checkpoint's sharded metadata")
        if local_metadata is None:
            local_metadata = _metadata(sharded_state_dict)
        missing, unexpected = determine_missing_and_unexpected_keys(
            ckpt_sharded_metadata, local_metadata, global_metadata
        )
        if not StrictHandling.requires_global_app_metadata(strict):
            missing = set()
        elif global_metadata is None:
            local_keys = {_sharded_key(sh) for sh in local_metadata}
            requested = keys_requested_anywhere(ckpt_sharded_metadata, local_keys)
            missing = set(ckpt_sharded_metadata) - requested
        sharded_state_dict = adjust_non_strict_load(sharded_state_dict, unexpected)
        if global_metadata is not None:
            # keys absent from the checkpoint are skipped on whichever rank requested them
            global_metadata = [
                [sh for sh in local if _sharded_key(sh) in ckpt_sharded_metadata]
                for local in global_metadata
            ]
        if strict == StrictHandling.IGNORE_ALL:
            missing, unexpected = set(), set()
        elif strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
            if missing or unexpected:
                logger.warning(
                    "Checkpoint key mismatch: %s",
                    _report(missing, unexpected, list(ckpt_sharded_metadata)),
                )
        elif strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
            report = _report(missing, unexpected, list(ckpt_sharded_metadata))
            error = KeyMismatchError(report) if report else None
            if is_distributed():
                agree_on_errors(error, "Strict key check")
            elif error is not None:
                raise error
    if validate_access_integrity:
        if global_metadata is None:
            raise ValueError("validate_access_integrity needs global_metadata")
        validate_sharding_integrity(global_metadata)
    return sharded_state_dict, missing, unexpected
