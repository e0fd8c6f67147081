"""`MCoreTensorAwareStateDict`: sharded state dicts saved by the local checkpoint manager.

The bridge from this package's sharded state dicts to `local/`'s `TensorAwareStateDict`:

    tasd, cache = MCoreTensorAwareStateDict.from_state_dict(sharded_sd, algo="fully_parallel")
    manager.save(tasd, iteration)
    ...
    tasd, _ = manager.load()
    state_dict = tasd.to_state_dict(sharded_sd, algo="fully_parallel")
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import _dist
from ._load_pipeline import complete_request, prepare_load_request
from ._save_pipeline import save_preprocess
from ._types import ShardedStateDict, StateDict
from .dict_utils import dict_list_map_inplace, dict_list_map_outplace, merge, nested_values
from .errors import CheckpointingException
from .exchange_utils import (
    ShardDistribution,
    compute_distribution,
    exchange_shards,
    group_ranks,
    shard_id,
)
from .local.base_state_dict import TensorAwareStateDict, allow_in_hollow_state
from .local.basic_state_dict import _usable_device
from .mapping import ShardedBase, ShardedObject, ShardedTensor, apply_factory_merges
from .validation import StrictHandling, parse_strict_flag

__all__ = ["MCoreTensorAwareStateDict", "ShardDistribution"]

ALGOS = ("atomic", "fully_parallel")


def _check_algo(algo: str) -> None:
    if algo not in ALGOS:
        raise CheckpointingException(f"Unknown algo {algo!r}; expected one of {ALGOS}")


@dataclass
class MCoreTensorAwareStateDict(TensorAwareStateDict):
    """A sharded state dict split into its common part and its sharded part.

    Attributes:
        common: the plain (non-sharded) values.
        sharded_state_dict: ShardedTensors (without data where another rank stores them)
            and ShardedObjects.
    """

    common: StateDict
    sharded_state_dict: ShardedStateDict
    _is_hollow: bool = False
    #: per stored tensor (in `tensors` order): the device it was taken from, once known
    _devices: Optional[List[str]] = None
    #: positions (among all ShardedTensors) of those with data, while hollow
    _stored: Optional[List[int]] = None

    @classmethod
    def from_state_dict(
        cls,
        sharded_state_dict: ShardedStateDict,
        algo: str = "fully_parallel",
        parallelization_group: Optional[dist.ProcessGroup] = None,
        cached_metadata: Optional[ShardDistribution] = None,
    ) -> Tuple[MCoreTensorAwareStateDict, Optional[ShardDistribution]]:
        """Wraps a sharded state dict (not modified) for `LocalCheckpointManager.save`.

        Collective with `algo="fully_parallel"` and no `cached_metadata`.

        Args:
            sharded_state_dict: the state, as for `dist_checkpointing.save`.
            algo: "atomic" (every rank stores all it holds) or "fully_parallel" (replicas
                within `parallelization_group`, default all ranks, stored once).
            cached_metadata: the distribution an earlier call with the same structure
                returned; skips the exchange.

        Returns:
            `(state, distribution)`; distribution is None for "atomic".

        Raises:
            CheckpointingException: unknown `algo`, or `cached_metadata` made for another
                group or not covering this rank's shards.
        """
        _check_algo(algo)
        sharded, common = save_preprocess(sharded_state_dict, None)
        distribution = None
        if algo == "fully_parallel":
            if cached_metadata is None:
                what, group = "fully parallel shard distribution", parallelization_group
                distribution = _dist.run_collectively(what, compute_distribution, sharded, group)
            else:
                distribution = cached_metadata
                if distribution.group != group_ranks(parallelization_group):
                    raise CheckpointingException(
                        f"cached_metadata was computed for group {distribution.group}, not "
                        f"{group_ranks(parallelization_group)}; pass cached_metadata=None"
                    )
        me = _dist.get_rank()

        def own_leaf(x: Any) -> Any:
            # a copy per leaf, so popping tensors never touches the caller's objects
            if isinstance(x, ShardedTensor) and x.data is not None and distribution is not None:
                sid = shard_id(x)
                if sid not in distribution.saver:
                    raise CheckpointingException(
                        f"cached_metadata does not cover shard {sid} of {x.key!r}: the "
                        "structure changed since it was computed; pass cached_metadata=None"
                    )
                if distribution.saver[sid] != me:
                    return x.without_data()
            return copy.copy(x) if isinstance(x, (ShardedTensor, ShardedObject)) else x

        sharded = dict_list_map_outplace(own_leaf, sharded)
        return cls(common=common, sharded_state_dict=sharded), distribution

    def _all_sharded_tensors(self) -> List[ShardedTensor]:
        return [x for x in nested_values(self.sharded_state_dict) if isinstance(x, ShardedTensor)]

    def _with_data(self) -> List[ShardedTensor]:
        return [x for x in self._all_sharded_tensors() if x.data is not None]

    def _stored_shards(self) -> List[ShardedTensor]:
        """The shards whose tensors this state stores, in `tensors` order (popped or not)."""
        if not self._is_hollow:
            return self._with_data()
        every = self._all_sharded_tensors()
        return [every[i] for i in self._stored or []]

    @property
    def is_hollow(self) -> bool:
        return self._is_hollow

    @property
    def common_state_dict(self) -> StateDict:
        """The plain (non-sharded) values."""
        return self.common

    @property
    def tensors(self) -> List[torch.Tensor]:
        self._require(False, "list tensors")
        return [sh.data for sh in self._with_data()]  # type: ignore[misc]

    def tensor_names(self) -> List[str]:
        """`key@offset` of each stored tensor, in `tensors` order (for error messages)."""
        return [f"{sh.key}@{sh.global_offset}" for sh in self._stored_shards()]

    def pop_tensors(self) -> List[torch.Tensor]:
        self._require(False, "pop tensors")
        every = self._all_sharded_tensors()
        stored = [i for i, sh in enumerate(every) if sh.data is not None]
        popped = [every[i].data for i in stored]
        if self._devices is None:
            self._devices = [str(t.device) for t in popped]  # type: ignore[union-attr]
        for i in stored:
            every[i].data = None
        self._stored, self._is_hollow = stored, True
        return popped  # type: ignore[return-value]

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        self._require(True, "insert tensors")
        data = list(tensor_data)
        shards = self._stored_shards()
        slots = [
            (f"shard {sh.key!r} at {sh.global_offset}", sh.local_shape, sh.dtype) for sh in shards
        ]
        self._check_insert(data, slots, "stored shards")
        for sh, t in zip(shards, data):
            sh.data = t
        self._stored, self._is_hollow = None, False

    def init_tensors(self) -> None:
        self._require(True, "init tensors")
        shards = self._stored_shards()
        devices = self._devices or ["cpu"] * len(shards)
        self.insert_tensors(
            torch.empty(sh.local_shape, dtype=sh.dtype, device=_usable_device(d))
            for sh, d in zip(shards, devices)
        )

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        self._require(False, "copy tensors to CPU")
        shards = self._with_data()
        if self._devices is None:
            self._devices = [str(sh.data.device) for sh in shards]  # type: ignore[union-attr]
        for sh in shards:
            assert sh.data is not None
            # a CPU tensor is copied too: the caller's training keeps changing the original
            sh.data = sh.data.detach().to("cpu", non_blocking=non_blocking, copy=True)

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        self._require(False, "restore tensor devices")
        for sh, device in zip(self._with_data(), self._devices or []):
            assert sh.data is not None
            target = _usable_device(device)
            if sh.data.device != target:
                sh.data = sh.data.to(target, non_blocking=non_blocking)

    def to_state_dict(
        self,
        sharded_state_dict: ShardedStateDict,
        algo: str = "atomic",
        exchange_algo: str = "broadcast",
        validate_access_integrity: bool = True,
        parallelization_group: Optional[dist.ProcessGroup] = None,
        strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
        return_mismatch_keys: bool = False,
    ) -> Any:
        """Builds the state dict `sharded_state_dict` asks for (in the saved layout).

        Collective when `validate_access_integrity`, a global `strict` mode or
        `algo="fully_parallel"` asks for an exchange.

        Args:
            sharded_state_dict: the request, as for `dist_checkpointing.load`.
            algo: "fully_parallel" fetches shards this rank did not store from a rank that
                did; "atomic" expects every rank to hold all it asks for.
            exchange_algo, parallelization_group: accepted for compatibility (shards always
                move point to point).
            validate_access_integrity: check the request's sharding across ranks.
            strict: key mismatch handling, as for `dist_checkpointing.load`.
            return_mismatch_keys: return `(state_dict, missing, unexpected)`, not the state dict.

        Raises:
            CheckpointingException: the state is hollow, `algo` is unknown, or a requested
                shard was stored by no rank or with another shape or dtype.
        """
        self._require(False, "build a state dict")
        _check_algo(algo)
        del exchange_algo, parallelization_group
        result = dict_list_map_outplace(lambda x: x, self.common)
        if not sharded_state_dict:
            return (result, set(), set()) if return_mismatch_keys else result
        strict = parse_strict_flag(strict)
        stored = list(nested_values(self.sharded_state_dict))

        def stored_metadata() -> Dict[str, ShardedBase]:
            return {
                (sh.key if isinstance(sh, ShardedTensor) else sh.unique_key): sh.without_data()
                for sh in stored
                if isinstance(sh, (ShardedTensor, ShardedObject))
            }

        prepared = prepare_load_request(
            sharded_state_dict, strict, validate_access_integrity, stored_metadata
        )
        merge(result, prepared.nonpersistent)
        request = prepared.sharded
        tensors = {shard_id(sh): sh.data for sh in self._with_data()}
        objects = {sh.unique_key: sh.data for sh in stored if isinstance(sh, ShardedObject)}
        wanted = [sh for sh in nested_values(request) if isinstance(sh, ShardedTensor)]
        if algo == "fully_parallel" and _dist.is_distributed():
            what = "fully parallel exchange of local checkpoint shards"
            _dist.run_collectively(what, exchange_shards, tensors, wanted)
        where = f"rank {_dist.get_rank()}'s local checkpoint"

        def fill(leaf: Any) -> Any:
            if isinstance(leaf, ShardedTensor):
                data = tensors.get(shard_id(leaf))
                if data is None:
                    raise CheckpointingException(
                        f"{where} has no shard of {leaf.key!r} at offset {leaf.global_offset}"
                        + ("" if algo == "fully_parallel" else " (saved fully_parallel?)")
                    )
                if tuple(data.shape) != tuple(leaf.local_shape) or data.dtype != leaf.dtype:
                    raise CheckpointingException(
                        f"{where}: shard of {leaf.key!r} at {leaf.global_offset} was saved with "
                        f"shape {tuple(data.shape)} and dtype {data.dtype}; requested "
                        f"{tuple(leaf.local_shape)}, {leaf.dtype}"
                    )
                return data
            if isinstance(leaf, ShardedObject):
                if leaf.unique_key not in objects:
                    raise CheckpointingException(
                        f"{where} has no ShardedObject {leaf.unique_key!r}"
                    )
                return objects[leaf.unique_key]
            return leaf

        if _dist.is_distributed() and (algo == "fully_parallel" or validate_access_integrity):
            # the call is collective anyway: fail on every rank, not only where a shard is off
            _dist.run_collectively(
                "local checkpoint shards into the request", dict_list_map_inplace, fill, request
            )
        else:
            dict_list_map_inplace(fill, request)
        merge(result, apply_factory_merges(request, prepared.factories))
        complete_request(prepared, result, strict)
        if return_mismatch_keys:
            return result, prepared.missing_keys, prepared.unexpected_keys
        return result


allow_in_hollow_state(MCoreTensorAwareStateDict, ShardedTensor, ShardedObject)
