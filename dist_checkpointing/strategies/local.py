"""The ('local', 2) backend: each rank's whole state, as one `MCoreTensorAwareStateDict`,
in a `LocalCheckpointManager` part (docs/formats.md); a rank whose node lost its part loads it
from a replica holder (no resharding). ('local', 1) checkpoints are still read.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch.distributed as dist

from .. import _dist
from .._claim import SAVE_ID_KEY, node_local_claim_name, read_claim
from .._types import ShardedStateDict, StateDict
from ..async_save import AsyncRequest
from ..dict_utils import nested_values
from ..errors import CheckpointCorruptedError, CheckpointingException, IncompatibleCheckpointError
from ..local.ckpt_managers.local_manager import LocalCheckpointManager
from ..local.replication.strategies import ReplicationStrategy
from ..mapping import ShardedObject, ShardedTensor
from ..tensor_aware_state_dict import MCoreTensorAwareStateDict, _check_algo
from .base import (
    CheckpointDir,
    NodeLocalLoadShardedStrategy,
    NodeLocalSaveShardedStrategy,
    StrategyAction,
    register_default_strategy,
    require_backend,
    require_version,
)

__all__ = [
    "LocalSaveShardedStrategy",
    "LocalLoadShardedStrategy",
    "register_default_local_strategies",
]

BACKEND = "local"
VERSION = 2
SUPPORTED_VERSIONS = (1, 2)
_ITERATION = 0
_RESHARD_HINT = (
    "The 'local' backend restores exactly the layout it saved; to change world size or "
    "sharding, save with the ('torch_dist', 1) backend, which reshards on load"
)


def register_default_local_strategies() -> None:
    """Registers ('local', 2) for saving and ('local', 1) and ('local', 2) for loading."""
    for version in SUPPORTED_VERSIONS:
        register_default_strategy(
            StrategyAction.LOAD_SHARDED, BACKEND, version, LocalLoadShardedStrategy()
        )
    register_default_strategy(
        StrategyAction.SAVE_SHARDED, BACKEND, VERSION, LocalSaveShardedStrategy(BACKEND, VERSION)
    )


class LocalSaveShardedStrategy(NodeLocalSaveShardedStrategy):
    """Saves each rank's whole state as a local checkpoint part.

    Args:
        backend, version: must be 'local' and 2 (version 1 is read only).
        repl_strategy: where copies go (e.g. `CliqueReplicationStrategy`); None: none.
        algo, parallelization_group: "atomic" (every rank stores every shard it holds) or
            "fully_parallel" (replicas within the group, default all ranks, stored once).

    Raises:
        CheckpointingException: another backend or version, or an unknown `algo`.
    """

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = VERSION,
        repl_strategy: Optional[ReplicationStrategy] = None,
        *,
        algo: str = "atomic",
        parallelization_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        if backend != BACKEND or version != VERSION:
            raise CheckpointingException(
                f"LocalSaveShardedStrategy writes ({BACKEND!r}, {VERSION}), not "
                f"({backend!r}, {version}); version 1 checkpoints are still loaded"
            )
        _check_algo(algo)
        super().__init__(backend, version)
        self.repl_strategy = repl_strategy
        self.algo = algo
        self.parallelization_group = parallelization_group

    def _save(
        self, sharded: ShardedStateDict, common: StateDict, ckpt: CheckpointDir, is_async: bool
    ) -> Optional[AsyncRequest]:
        for sh in nested_values(sharded):
            if isinstance(sh, ShardedTensor) and sh.data is None:
                raise CheckpointingException(f"ShardedTensor {sh.key!r} has no data to save")
        state, _ = MCoreTensorAwareStateDict.from_state_dict(
            sharded, algo=self.algo, parallelization_group=self.parallelization_group
        )
        state.common = common
        manager = LocalCheckpointManager(ckpt, "", self.repl_strategy)
        manager._cleanup_failed_save(_ITERATION)  # parts of an earlier, uncommitted save here
        return manager.save(state, _ITERATION, is_async=is_async)

    def async_save_rank_state(
        self,
        sharded_state_dict: ShardedStateDict,
        common_state_dict: StateDict,
        checkpoint_dir: CheckpointDir,
    ) -> AsyncRequest:
        request = self._save(sharded_state_dict, common_state_dict, checkpoint_dir, True)
        assert request is not None
        return request

    def save_rank_state(
        self,
        sharded_state_dict: ShardedStateDict,
        common_state_dict: StateDict,
        checkpoint_dir: CheckpointDir,
    ) -> None:
        self._save(sharded_state_dict, common_state_dict, checkpoint_dir, False)


class LocalLoadShardedStrategy(NodeLocalLoadShardedStrategy):
    """Loads ('local', 1) and ('local', 2) checkpoints.

    Args:
        weights_only: False allows arbitrary pickled objects (trusted checkpoints only).
    """

    def __init__(self, weights_only: bool = True) -> None:
        self.weights_only = weights_only

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        require_backend(self, BACKEND, loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        require_version(self, BACKEND, SUPPORTED_VERSIONS, loaded_version)

    def _manager(self, checkpoint_dir: CheckpointDir) -> LocalCheckpointManager:
        manager = LocalCheckpointManager(checkpoint_dir, "", None, use_replicas=True)
        manager.weights_only = self.weights_only
        return manager

    def _read_state(self, checkpoint_dir: CheckpointDir) -> MCoreTensorAwareStateDict:
        """Collective: this rank's stored state (fetched from a holder if needed)."""
        manager = self._manager(checkpoint_dir)
        world = _dist.get_world_size()
        found = manager.find_latest()
        owners = manager._owners_by_iteration().get(_ITERATION, set())
        if found != _ITERATION or any(o >= world for o in owners):
            raise IncompatibleCheckpointError(
                f"{checkpoint_dir}: the local parts found (of ranks {sorted(owners)}) do not match "
                f"the {world} ranks of this job (lost without a replica, or saved with another "
                f"world size). {_RESHARD_HINT}"
            )
        state, _ = manager.load()
        state = self._checked(state, checkpoint_dir)
        _check_one_save(checkpoint_dir, state)
        return state

    @staticmethod
    def _checked(state: Any, where: Any) -> MCoreTensorAwareStateDict:
        """`state` as a version-2 rank state (a version-1 one converted)."""
        v1 = getattr(state, "state_dict", None)
        if isinstance(v1, dict) and v1.get("format") == 1:
            return _v1_as_v2(v1)
        if not isinstance(state, MCoreTensorAwareStateDict):
            raise CheckpointingException(
                f"{where}: not a ('local', 1) or ('local', 2) rank state ({type(state).__name__})"
            )
        return state

    def load_rank_state(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir
    ) -> Tuple[StateDict, StateDict]:
        state = self._read_state(checkpoint_dir)
        common = _common(state)
        state.common = {}  # the request alone comes back, mirroring its structure
        try:
            loaded = state.to_state_dict(
                sharded_state_dict,
                algo="fully_parallel" if _dist.is_distributed() else "atomic",
                validate_access_integrity=False,
            )
        except CheckpointingException as e:
            raise type(e)(f"{checkpoint_dir}: {e}. {_RESHARD_HINT}") from e
        return common, _into_given_tensors(sharded_state_dict, loaded)

    def _own_state(self, checkpoint_dir: CheckpointDir) -> MCoreTensorAwareStateDict:
        """This rank's own stored state (not collective)."""
        manager = self._manager(checkpoint_dir)
        return self._checked(manager._load((_ITERATION, _dist.get_rank(), "")), checkpoint_dir)

    def load_common_rank_state(self, checkpoint_dir: CheckpointDir) -> StateDict:
        return _common(self._own_state(checkpoint_dir))

    def load_tensors_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        """The tensors of this rank's own part (whole-tensor metadata, no data)."""
        return _metadata(self._own_state(checkpoint_dir), with_objects=False)

    def load_sharded_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        return _metadata(self._own_state(checkpoint_dir), with_objects=True)


def _common(state: MCoreTensorAwareStateDict) -> StateDict:
    """The part's common state as saved (without the save id the part records)."""
    if not isinstance(state.common, dict):
        return {}
    return {k: v for k, v in state.common.items() if k != SAVE_ID_KEY}


def _check_one_save(checkpoint_dir: CheckpointDir, state: MCoreTensorAwareStateDict) -> None:
    """Collective: every rank's part names the same save, the one that claimed the directory
    (rank 0's `claim_0.json`, where it has one); parts saved before parts named their save
    are taken as they are.

    Raises:
        CheckpointCorruptedError: on every rank, naming the ranks whose parts differ.
    """
    common = state.common if isinstance(state.common, dict) else {}
    claim = (
        read_claim(Path(checkpoint_dir), node_local_claim_name(0))
        if _dist.get_rank() == 0
        else None
    )
    gathered = _dist.all_gather_object((common.get(SAVE_ID_KEY), claim and claim.token))
    ids, claimed = [i for i, _ in gathered], gathered[0][1]
    if not any(ids):
        return
    if claimed == "?":  # (what `read_claim` gives for a claim it cannot parse)
        raise CheckpointCorruptedError(
            f"{Path(checkpoint_dir) / node_local_claim_name(0)} is damaged (unreadable): the "
            "local parts cannot be checked against the save that claimed the directory"
        )
    expected = claimed or ids[0]
    foreign = [rank for rank, i in enumerate(ids) if i != expected]
    if foreign:
        raise CheckpointCorruptedError(
            f"{checkpoint_dir}: the local part(s) of rank(s) {foreign} belong to another save "
            f"({ids[foreign[0]]}) than this checkpoint's ({expected}, the save that claimed it in "
            f"{node_local_claim_name(0)}): replaced by, or linked to, another checkpoint's files"
        )


def _metadata(state: MCoreTensorAwareStateDict, with_objects: bool) -> ShardedStateDict:
    """Whole-tensor metadata (no data) of a rank state's tensors (and objects)."""
    out: ShardedStateDict = {}
    for x in nested_values(state.sharded_state_dict):
        if isinstance(x, ShardedTensor):
            shape = tuple(x.global_shape)
            out[x.key] = ShardedTensor(x.key, None, x.dtype, shape, shape, (0,) * len(shape), None)
        elif isinstance(x, ShardedObject) and with_objects:
            obj = ShardedObject.empty_from_unique_key(x.unique_key)
            out[obj.unique_key] = obj
    return out


def _into_given_tensors(request: Any, loaded: Any) -> Any:
    """`loaded`, copied into the request's own tensors where given (loads fill in place)."""
    if isinstance(request, dict) and isinstance(loaded, dict):
        return {k: _into_given_tensors(request.get(k), v) for k, v in loaded.items()}
    if isinstance(request, list) and isinstance(loaded, list) and len(request) == len(loaded):
        return [_into_given_tensors(r, v) for r, v in zip(request, loaded)]
    if isinstance(request, ShardedTensor) and request.data is not None:
        if loaded is not request.data:
            request.data.copy_(loaded)
        return request.data
    return loaded


def _v1_as_v2(sd: Dict[str, Any]) -> MCoreTensorAwareStateDict:
    """A version-1 rank state's dict (shards under `"<key> (<global offset>)"`, objects by
    unique key) as the version-2 state holding the same shards and objects."""
    sharded: ShardedStateDict = {}
    for name, entry in sd["sharded"].items():
        key, offset = name.rsplit(" (", 1)
        local, shape = tuple(entry["local_shape"]), tuple(entry["global_shape"])
        data = entry["data"].view(local)
        offsets = ast.literal_eval(f"({offset}")
        prepend = len(shape) - len(local)
        sharded[name] = ShardedTensor(
            key, data, data.dtype, local, shape, offsets, None, prepend_axis_num=prepend
        )
    for unique_key, value in sd["objects"].items():
        sharded[unique_key] = ShardedObject.empty_from_unique_key(unique_key)
        sharded[unique_key].data = value
    common = sd["common"] if isinstance(sd["common"], dict) else {}
    return MCoreTensorAwareStateDict(common=common, sharded_state_dict=sharded)
