"""Fully parallel save and load: data-parallel replicas hold the same shards, so instead
of one rank writing each shard while the others idle, the writing and reading of replicated
shards is balanced over a group (`exchange_utils`)."""

from __future__ import annotations

import copy
import logging
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import _dist
from .._types import ShardedStateDict, StateDict
from ..coordination import digest
from ..dict_utils import dict_list_map_inplace, extract_matching_values, merge, nested_values
from ..errors import CheckpointingException
from ..exchange_utils import (
    ShardDistribution,
    ShardId,
    compute_distribution,
    exchange_shards,
    shard_id,
    shard_sizes,
)
from ..mapping import ShardedTensor
from .async_utils import AsyncRequest
from .base import (
    AsyncSaveShardedStrategy,
    CheckpointDir,
    LoadShardedStrategy,
    NodeLocalLoadShardedStrategy,
    NodeLocalSaveShardedStrategy,
    SaveShardedStrategy,
)

__all__ = ["FullyParallelSaveStrategyWrapper", "FullyParallelLoadStrategyWrapper", "EXCHANGE_ALGOS"]

logger = logging.getLogger(__name__)

#: megatron-core's names for its load exchanges, all accepted; here each one sends every
#: shard point to point from its reader to the ranks that asked for it.
EXCHANGE_ALGOS = ("broadcast", "gather_rounds", "gather_object")


class _DistributionCache:
    """A distribution reused while no rank's input to it (`shard_sizes`) changes (agreed on
    by all ranks, so they recompute together)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.fingerprint: Optional[bytes] = None
        self.distribution: Optional[ShardDistribution] = None

    def get(
        self,
        sharded: ShardedStateDict,
        group: Optional[dist.ProcessGroup],
        only_main_replicas: bool,
    ) -> ShardDistribution:
        """Collective: the cached distribution, or a fresh one (then cached)."""
        fingerprint = b""
        if self.enabled:
            fingerprint = digest(sorted(shard_sizes(sharded).items()))
            fresh = fingerprint == self.fingerprint and self.distribution is not None
            if not _dist.all_reduce_max([int(not fresh)])[0]:
                assert self.distribution is not None
                return self.distribution
        distribution = _dist.run_collectively(
            "fully parallel shard distribution",
            compute_distribution,
            sharded,
            group,
            only_main_replicas,
        )
        if self.enabled:
            self.fingerprint, self.distribution = fingerprint, distribution
        return distribution


class _Wrapper:
    """What both wrappers take from the strategy they wrap."""

    base_strategy: Any

    @property
    def can_handle_sharded_objects(self) -> bool:
        return bool(self.base_strategy.can_handle_sharded_objects)

    @property
    def records_plain_values(self) -> bool:
        """Whether the wrapped strategy stores plain values as DCP items (`_dcp_plain`)."""
        return bool(getattr(self.base_strategy, "records_plain_values", False))

    def __str__(self) -> str:
        return f"FullyParallel({self.base_strategy})"

    def _wrap(self, strategy: Any, base: type, node_local: type, what: str) -> None:
        if not isinstance(strategy, base) or isinstance(strategy, node_local):
            raise CheckpointingException(
                f"FullyParallel{what.capitalize()}StrategyWrapper needs a shared-storage sharded "
                f"{what} strategy, got {strategy}"
            )
        self.base_strategy = strategy


class FullyParallelSaveStrategyWrapper(_Wrapper, AsyncSaveShardedStrategy):
    """Spreads the writing of replicated shards over `parallelization_group` (balancing
    bytes among the ranks holding each shard), then saves.

    Args:
        strategy: the sharded save strategy that writes (e.g. `TorchDistSaveShardedStrategy`);
            it must write main replicas only.
        parallelization_group: the ranks that share the writing (default: all ranks).
        do_cache_distribution: reuse the distribution while the shard structure is unchanged.
    """

    def __init__(
        self,
        strategy: SaveShardedStrategy,
        parallelization_group: Optional[dist.ProcessGroup] = None,
        do_cache_distribution: bool = False,
    ) -> None:
        self._wrap(strategy, SaveShardedStrategy, NodeLocalSaveShardedStrategy, "save")
        super().__init__(strategy.backend, strategy.version)
        self.parallelization_group = parallelization_group
        self._cache = _DistributionCache(do_cache_distribution)

    def apply_saving_parallelization(self, sharded_state_dict: ShardedStateDict) -> None:
        """Collective: replaces, in place, each ShardedTensor whose shard has a main replica
        in the group by a copy with `replica_id` 0 on the rank chosen to write it, else 1."""
        distribution = self._cache.get(sharded_state_dict, self.parallelization_group, True)
        me = _dist.get_rank()

        def mark(leaf: Any) -> Any:
            if isinstance(leaf, ShardedTensor) and leaf.data is not None:
                saver = distribution.saver.get(shard_id(leaf))
                if saver is not None:
                    leaf = copy.copy(leaf)
                    leaf.replica_id = 0 if saver == me else 1
            return leaf

        dict_list_map_inplace(mark, sharded_state_dict)

    def async_save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir
    ) -> AsyncRequest:
        """Collective: distributes the writing, then starts the wrapped strategy's async save."""
        if not isinstance(self.base_strategy, AsyncSaveShardedStrategy):
            raise CheckpointingException(f"{self.base_strategy} does not support async save")
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.async_save(sharded_state_dict, checkpoint_dir)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir) -> None:
        """Collective: distributes the writing, then saves with the wrapped strategy."""
        self.apply_saving_parallelization(sharded_state_dict)
        self.base_strategy.save(sharded_state_dict, checkpoint_dir)


def _tensor_paths(tree: Any, path: Tuple[Any, ...] = ()) -> Iterator[Tuple[Tuple[Any, ...], Any]]:
    """`(key path, ShardedTensor)` of every ShardedTensor leaf of a tree."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensor_paths(v, path + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _tensor_paths(v, path + (i,))
    elif isinstance(tree, ShardedTensor):
        yield path, tree


def _at(tree: Any, path: Tuple[Any, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


class FullyParallelLoadStrategyWrapper(_Wrapper, LoadShardedStrategy):
    """Reads each requested shard once within `parallelization_group`, then exchanges it.

    Args:
        strategy: the sharded load strategy that reads (e.g. `TorchDistLoadShardedStrategy`).
        parallelization_group: the ranks that share the reading (default: all ranks).
        do_cache_distribution: reuse the distribution while the request is unchanged.
        exchange_algo: one of megatron-core's names (`EXCHANGE_ALGOS`), accepted so
            megatron-LM's arguments carry over; all exchange the same way here.

    Raises:
        CheckpointingException: an unknown `exchange_algo`, or a node-local strategy.
    """

    def __init__(
        self,
        strategy: LoadShardedStrategy,
        parallelization_group: Optional[dist.ProcessGroup] = None,
        do_cache_distribution: bool = False,
        exchange_algo: str = "broadcast",
    ) -> None:
        self._wrap(strategy, LoadShardedStrategy, NodeLocalLoadShardedStrategy, "load")
        if exchange_algo not in EXCHANGE_ALGOS:
            raise CheckpointingException(
                f"FullyParallelLoadStrategyWrapper: unknown exchange_algo {exchange_algo!r}; "
                f"megatron-core's names are {EXCHANGE_ALGOS} (each exchanges point to point here)"
            )
        self.parallelization_group = parallelization_group
        self.exchange_algo = exchange_algo
        self._cache = _DistributionCache(do_cache_distribution)

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        self.base_strategy.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        self.base_strategy.check_version_compatibility(loaded_version)

    def load_tensors_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        return self.base_strategy.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        return self.base_strategy.load_sharded_metadata(checkpoint_dir)

    def remove_sharded_tensors(self, checkpoint_dir: CheckpointDir, key_prefix: str) -> None:
        self.base_strategy.remove_sharded_tensors(checkpoint_dir, key_prefix)

    def load(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir
    ) -> StateDict:
        """Collective: loads the request, each shard read by one rank of the group and sent
        to the others that asked for it."""
        logger.debug("fully parallel load, exchange_algo=%r (point to point)", self.exchange_algo)
        # ShardedTensors without destinations still count as wanted: give them data
        request = _with_destinations(sharded_state_dict)
        distribution = self._cache.get(request, self.parallelization_group, False)
        me = _dist.get_rank()
        deferred, own = extract_matching_values(
            request,
            lambda v: (
                isinstance(v, ShardedTensor) and distribution.saver.get(shard_id(v), me) != me
            ),
        )
        own_tensors = list(_tensor_paths(own))  # before the load: it may edit `own` in place
        loaded = self.base_strategy.load(own, checkpoint_dir)
        tensors: Dict[ShardId, Optional[torch.Tensor]] = {
            shard_id(sh): _at(loaded, path) for path, sh in own_tensors
        }
        wanted: List[ShardedTensor] = [
            sh for sh in nested_values(request) if isinstance(sh, ShardedTensor)
        ]
        _dist.run_collectively("fully parallel load exchange", exchange_shards, tensors, wanted)

        def fill(leaf: Any) -> Any:
            value = tensors[shard_id(leaf)]
            assert value is not None and leaf.data is not None
            if value is not leaf.data:
                leaf.data.copy_(value)
            return leaf.data

        dict_list_map_inplace(fill, deferred)
        return merge(loaded, deferred)


def _with_destinations(sharded_state_dict: ShardedStateDict) -> ShardedStateDict:
    """A shallow copy in which every ShardedTensor has a destination tensor (CPU if none)."""

    def allocate(leaf: Any) -> Any:
        if isinstance(leaf, ShardedTensor) and leaf.data is None:
            leaf = copy.copy(leaf)
            leaf.data = torch.empty(leaf.local_shape, dtype=leaf.dtype)
        return leaf

    copied, _ = extract_matching_values(sharded_state_dict, lambda _: True)
    dict_list_map_inplace(allocate, copied)
    return copied
