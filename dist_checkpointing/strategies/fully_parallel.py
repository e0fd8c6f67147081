"""Fully parallel save and load: replicated shards written once and read once per group.

With data parallelism every rank of a data-parallel group holds the same shards; a plain
save writes each shard from its main replica only, so one rank of the group does all the
writing while the others idle. The wrappers here spread that I/O over the group:

- `FullyParallelSaveStrategyWrapper` makes, for each shard whose main replica is in the
  group, one of the ranks holding it the writer, balancing bytes across ranks, then lets
  the wrapped strategy write (each shard still written exactly once).
- `FullyParallelLoadStrategyWrapper` makes one rank of the group read each requested shard
  (bytes balanced likewise), then sends every other rank that asked for it a copy.

Both reuse `exchange_utils` (the same distribution and exchange as
`MCoreTensorAwareStateDict(algo="fully_parallel")`). The exchange runs over the library's
gloo group with host tensors, so it works for CPU tensors on gloo and CUDA tensors on NCCL
(copied to the host and back).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import _dist
from .._types import ShardedStateDict, StateDict
from ..dict_utils import dict_list_map_inplace, extract_matching_values, merge, nested_values
from ..errors import CheckpointingException
from ..exchange_utils import (
    ShardDistribution,
    ShardId,
    compute_distribution,
    exchange_shards,
    shard_id,
)
from ..mapping import ShardedTensor
from ..validation import metadata_fingerprint
from .async_utils import AsyncRequest
from .base import (
    AsyncSaveShardedStrategy,
    CheckpointDir,
    LoadShardedStrategy,
    NodeLocalLoadShardedStrategy,
    NodeLocalSaveShardedStrategy,
    SaveShardedStrategy,
)

__all__ = [
    "FullyParallelSaveStrategyWrapper",
    "FullyParallelLoadStrategyWrapper",
    "EXCHANGE_ALGOS",
]

logger = logging.getLogger(__name__)

#: megatron-core's names for its load exchanges (0.13-0.19; `--ckpt-fully-parallel-load-
#: exchange-algo`), all accepted. In megatron they differ in how shards travel: "broadcast"
#: (its default) broadcasts each shard from its reader to the group, "gather_rounds" all-
#: gathers shards in rounds per dtype (both on CUDA tensors only), "gather_object" all-
#: gathers every loaded shard as Python objects (each rank receives all of them; the one
#: that works on CPU). Here each name gives the same result by the same exchange: every
#: shard goes point to point from its reader to only the ranks that asked for it, as host
#: tensors over the library's gloo group, so a rank receives no shard it does not need and
#: every name works on CPU and CUDA tensors alike. The name is kept (`exchange_algo`) and
#: logged; an unknown one raises.
EXCHANGE_ALGOS = ("broadcast", "gather_rounds", "gather_object")


class _DistributionCache:
    """A distribution reused while this rank's shard structure stays the same.

    Whether to recompute is agreed by all ranks (one small collective), so a rank whose
    structure changed never leaves the others out of the recomputation.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.fingerprint: Optional[str] = None
        self.distribution: Optional[ShardDistribution] = None

    def get(
        self,
        sharded: ShardedStateDict,
        group: Optional[dist.ProcessGroup],
        only_main_replicas: bool,
    ) -> ShardDistribution:
        """Collective: the cached distribution, or a fresh one (then cached)."""
        fingerprint = ""
        if self.enabled:
            fingerprint = metadata_fingerprint(
                [
                    sh.without_data()
                    for sh in nested_values(sharded)
                    if isinstance(sh, ShardedTensor)
                ]
            )
            fresh = fingerprint == self.fingerprint and self.distribution is not None
            if all(_dist.all_gather_object(fresh)):
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


class FullyParallelSaveStrategyWrapper(AsyncSaveShardedStrategy):
    """Spreads the writing of replicated shards over `parallelization_group`, then saves.

    Args:
        strategy: the sharded save strategy that writes (e.g. `TorchDistSaveShardedStrategy`);
            it must write main replicas only.
        parallelization_group: the ranks that share the writing (default: all ranks).
        do_cache_distribution: reuse the distribution while the shard structure is
            unchanged (one small collective checks that instead of recomputing it).
    """

    def __init__(
        self,
        strategy: SaveShardedStrategy,
        parallelization_group: Optional[dist.ProcessGroup] = None,
        do_cache_distribution: bool = False,
    ) -> None:
        if not isinstance(strategy, SaveShardedStrategy) or isinstance(
            strategy, NodeLocalSaveShardedStrategy
        ):
            raise CheckpointingException(
                f"FullyParallelSaveStrategyWrapper needs a shared-storage sharded save "
                f"strategy, got {strategy}"
            )
        super().__init__(strategy.backend, strategy.version)
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self._cache = _DistributionCache(do_cache_distribution)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects

    def apply_saving_parallelization(self, sharded_state_dict: ShardedStateDict) -> None:
        """Collective: marks, in place, which rank writes each shard of the group.

        Each ShardedTensor leaf whose shard has a main replica in the group is replaced by a
        copy whose `replica_id` is 0 on the rank chosen to write it and 1 elsewhere; other
        leaves (and the caller's ShardedTensor objects) are left unchanged.
        """
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
        """Collective: distributes the writing, then starts the wrapped strategy's async save.

        Raises:
            CheckpointingException: the wrapped strategy cannot save asynchronously.
        """
        if not isinstance(self.base_strategy, AsyncSaveShardedStrategy):
            raise CheckpointingException(f"{self.base_strategy} does not support async save")
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.async_save(sharded_state_dict, checkpoint_dir)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir) -> None:
        """Collective: distributes the writing, then saves with the wrapped strategy."""
        self.apply_saving_parallelization(sharded_state_dict)
        self.base_strategy.save(sharded_state_dict, checkpoint_dir)

    def __str__(self) -> str:
        return f"FullyParallel({self.base_strategy})"


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


class FullyParallelLoadStrategyWrapper(LoadShardedStrategy):
    """Reads each requested shard once within `parallelization_group`, then exchanges it.

    Args:
        strategy: the sharded load strategy that reads (e.g. `TorchDistLoadShardedStrategy`).
        parallelization_group: the ranks that share the reading (default: all ranks).
        do_cache_distribution: reuse the distribution while the request structure is
            unchanged.
        exchange_algo: one of megatron-core's names (`EXCHANGE_ALGOS`: "broadcast",
            "gather_rounds", "gather_object"), accepted so megatron-LM's arguments carry
            over. Each gives the same loaded tensors by the same exchange here: shards
            move point to point from the rank that read them to the ranks that asked for
            them (see `EXCHANGE_ALGOS` for what megatron does differently per name).

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
        if not isinstance(strategy, LoadShardedStrategy) or isinstance(
            strategy, NodeLocalLoadShardedStrategy
        ):
            raise CheckpointingException(
                f"FullyParallelLoadStrategyWrapper needs a shared-storage sharded load "
                f"strategy, got {strategy}"
            )
        if exchange_algo not in EXCHANGE_ALGOS:
            raise CheckpointingException(
                f"FullyParallelLoadStrategyWrapper: unknown exchange_algo {exchange_algo!r}; "
                f"megatron-core's names are {EXCHANGE_ALGOS} (each exchanges point to point here)"
            )
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.exchange_algo = exchange_algo
        self._cache = _DistributionCache(do_cache_distribution)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects

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
        """Collective: loads the request, each shard read by one rank of the group.

        Steps: agree on the reader of every requested shard (bytes balanced over the ranks
        asking for it); read this rank's share (and every ShardedObject) with the wrapped
        strategy; exchange the shards; put received shards into the requested destination
        tensors (in place when the request carries them).

        Returns:
            The loaded state dict, as the wrapped strategy would return it.
        """
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

    def __str__(self) -> str:
        return f"FullyParallel({self.base_strategy})"


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
