"""Every public name users rely on imports from its documented path (the list below).

These paths mirror megatron-core's `dist_checkpointing` and nvidia-resiliency-ext's local
checkpointing, so moving code inside the package must keep each of them importable.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Dict, List, Tuple

import pytest

PUBLIC: Dict[str, List[str]] = {
    "dist_checkpointing": [
        "save",
        "load",
        "load_common_state_dict",
        "load_tensors_metadata",
        "load_sharded_metadata",
        "load_plain_tensors",
        "load_content_metadata",
        "remove_sharded_tensors",
        "check_is_distributed_checkpoint",
        "ShardedTensor",
        "ShardedObject",
        "LocalNonpersistentObject",
    ],
    "dist_checkpointing.mapping": [
        "ShardedTensor",
        "ShardedObject",
        "LocalNonpersistentObject",
        "ShardedTensorFactory",
        "ShardedBase",
        "ShardedStateDict",
        "StateDict",
        "ReplicaId",
        "is_main_replica",
        "apply_factories",
        "apply_factory_merges",
    ],
    "dist_checkpointing.core": [
        "CheckpointingException",
        "CheckpointingConfig",
        "check_is_distributed_checkpoint",
        "maybe_load_config",
        "save_config",
    ],
    "dist_checkpointing.serialization": [
        "save",
        "load",
        "load_common_state_dict",
        "load_tensors_metadata",
        "load_sharded_metadata",
        "load_plain_tensors",
        "load_content_metadata",
        "remove_sharded_tensors",
        "check_is_distributed_checkpoint",
        "get_default_save_sharded_strategy",
        "get_default_save_common_strategy",
        "get_default_load_sharded_strategy",
    ],
    "dist_checkpointing.validation": [
        "StrictHandling",
        "parse_strict_flag",
        "validate_sharding_integrity",
        "determine_global_metadata",
    ],
    "dist_checkpointing.strategies.base": [
        "StrategyAction",
        "default_strategies",
        "get_default_strategy",
        "register_default_strategy",
        "LoadStrategyBase",
        "SaveStrategyBase",
        "LoadCommonStrategy",
        "SaveCommonStrategy",
        "LoadShardedStrategy",
        "SaveShardedStrategy",
        "AsyncSaveShardedStrategy",
    ],
    "dist_checkpointing.strategies.async_utils": ["AsyncRequest", "AsyncCallsQueue"],
    "dist_checkpointing.strategies.torch": [
        "TorchDistSaveShardedStrategy",
        "TorchDistLoadShardedStrategy",
    ],
    "dist_checkpointing.dict_utils": [
        "diff",
        "nested_values",
        "dict_list_map_inplace",
        "dict_list_map_outplace",
        "extract_matching_values",
        "merge",
        "map_reduce",
    ],
    "dist_checkpointing.tensor_aware_state_dict": ["MCoreTensorAwareStateDict"],
    "dist_checkpointing.utils": [
        "replace_prefix_for_sharding",
        "apply_prefix_mapping",
        "add_prefix_for_sharding",
        "extract_sharded_tensors_and_factories",
    ],
    "dist_checkpointing.optimizer": [
        "get_param_id_to_sharded_param_map",
        "optim_state_to_sharding_state",
        "make_sharded_optimizer_tensor",
        "KEEP_VARS_HINT",
    ],
    "dist_checkpointing.strategies.fully_parallel": [
        "FullyParallelSaveStrategyWrapper",
        "FullyParallelLoadStrategyWrapper",
    ],
    "dist_checkpointing.megatron_compat": ["install", "uninstall", "convert_sharded_state_dict"],
    "dist_checkpointing.local.ckpt_managers.base_manager": [
        "BaseCheckpointManager",
        "CheckpointingException",
        "SameMachineReplicationException",
    ],
    "dist_checkpointing.local.ckpt_managers.local_manager": ["LocalCheckpointManager"],
    "dist_checkpointing.local.base_state_dict": ["TensorAwareStateDict"],
    "dist_checkpointing.local.basic_state_dict": ["BasicTensorAwareStateDict"],
    "dist_checkpointing.local.replication.strategies": [
        "ReplicationStrategy",
        "CliqueReplicationStrategy",
        "LazyCliqueReplicationStrategy",
        "NoReplicasAvailableError",
    ],
}


def _pairs(table: Dict[str, List[str]]) -> List[Tuple[str, str]]:
    return [(module, name) for module, names in table.items() for name in names]


def _importable(module: str, name: str) -> bool:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and module.startswith(e.name):
            return False  # the module itself is missing (not one of its imports)
        raise
    return hasattr(mod, name)


@pytest.mark.parametrize(("module", "name"), _pairs(PUBLIC))
def test_public_name_imports_from_its_documented_path(module, name):
    assert _importable(module, name), f"from {module} import {name}"


def _params(obj: object) -> List[str]:
    return [p for p in inspect.signature(obj).parameters if p != "self"]  # type: ignore[arg-type]


def test_documented_signatures_keep_their_parameter_names():
    from dist_checkpointing import mapping, serialization
    from dist_checkpointing.strategies import base, torch
    from dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    assert _params(mapping.ShardedTensor.from_rank_offsets)[:5] == [
        "key",
        "data",
        "rank_offsets",
        "replica_id",
        "prepend_axis_num",
    ]
    assert _params(serialization.get_default_save_sharded_strategy) == ["backend", "version"]
    assert _params(serialization.get_default_load_sharded_strategy) == ["checkpoint_dir"]
    assert _params(base.get_default_strategy) == ["action", "backend", "version"]
    assert _params(base.register_default_strategy) == ["action", "backend", "version", "strategy"]
    assert _params(base.SaveStrategyBase.__init__) == ["backend", "version"]
    assert _params(torch.TorchDistSaveShardedStrategy.__init__)[:6] == [
        "backend",
        "version",
        "keep_only_main_replica",
        "thread_count",
        "cached_metadata",
        "separation_hint",
    ]
    from dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )

    assert _params(FullyParallelSaveStrategyWrapper.__init__) == [
        "strategy",
        "parallelization_group",
        "do_cache_distribution",
    ]
    assert _params(FullyParallelLoadStrategyWrapper.__init__) == [
        "strategy",
        "parallelization_group",
        "do_cache_distribution",
        "exchange_algo",
    ]
    assert _params(MCoreTensorAwareStateDict.from_state_dict)[:4] == [
        "sharded_state_dict",
        "algo",
        "parallelization_group",
        "cached_metadata",
    ]


def test_documented_enum_members_exist():
    from dist_checkpointing.strategies.base import StrategyAction
    from dist_checkpointing.validation import StrictHandling

    assert {m.name for m in StrategyAction} == {
        "LOAD_COMMON",
        "LOAD_SHARDED",
        "SAVE_COMMON",
        "SAVE_SHARDED",
    }
    assert {m.name for m in StrictHandling} == {
        "ASSUME_OK_UNEXPECTED",
        "LOG_UNEXPECTED",
        "LOG_ALL",
        "RAISE_UNEXPECTED",
        "RAISE_ALL",
        "RETURN_UNEXPECTED",
        "RETURN_ALL",
        "IGNORE_ALL",
    }
    for predicate in (
        "requires_explicit_ckpt_mismatch_check",
        "requires_global_app_metadata",
        "requires_returning_mismatch_keys",
    ):
        assert callable(getattr(StrictHandling, predicate))
