"""Every `dist_checkpointing` name megatron-core 0.16.1-0.19.2 imports from outside its
`dist_checkpointing` (plus Megatron-LM's training loop's), importable from our package, with
megatron's behaviour for the helpers; `megatron_compat.install()` in a fresh interpreter.

The list was derived by parsing every module of megatron-core 0.16.1 and 0.19.2 outside
`megatron/core/dist_checkpointing` for imports of `dist_checkpointing` names.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dist_checkpointing import optimizer, utils
from dist_checkpointing.errors import CheckpointingException
from dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)

IMPORTED_BY_MEGATRON = {
    "dist_checkpointing": [
        "ShardedTensor",
        "ShardedObject",
        "LocalNonpersistentObject",
        "save",
        "load",
        "load_common_state_dict",
        "load_tensors_metadata",
        "load_plain_tensors",
        "load_content_metadata",
        "remove_sharded_tensors",
        "check_is_distributed_checkpoint",
    ],
    "dist_checkpointing.mapping": [
        "LocalNonpersistentObject",
        "ReplicaId",
        "ShardedObject",
        "ShardedStateDict",
        "ShardedTensor",
        "ShardedTensorFactory",
        "StateDict",
        "ShardedBase",
        "apply_factories",
        "apply_factory_merges",
        "is_main_replica",
    ],
    "dist_checkpointing.dict_utils": [
        "nested_values",
        "dict_list_map_inplace",
        "extract_matching_values",
        "merge",
        "diff",
        "map_reduce",
        "dict_list_map_outplace",
    ],
    "dist_checkpointing.utils": [
        "add_prefix_for_sharding",
        "apply_prefix_mapping",
        "extract_sharded_tensors_and_factories",
        "replace_prefix_for_sharding",
        "extract_sharded_tensors",
        "extract_sharded_tensors_or_nonpersistent",
        "extract_sharded_base",
        "extract_nonpersistent",
        "zip_strict",
    ],
    "dist_checkpointing.optimizer": [
        "KEEP_VARS_HINT",
        "get_param_id_to_sharded_param_map",
        "make_sharded_optimizer_tensor",
        "optim_state_to_sharding_state",
        "get_optim_param_to_id_map",
    ],
    # Megatron-LM's training loop (megatron/training/checkpointing.py)
    "dist_checkpointing.serialization": [
        "CkptShardedMetadata",
        "get_default_load_sharded_strategy",
        "get_default_save_sharded_strategy",
        "get_default_save_common_strategy",
    ],
    "dist_checkpointing.core": ["CheckpointingException", "check_is_distributed_checkpoint"],
    "dist_checkpointing.validation": ["StrictHandling"],
    "dist_checkpointing.strategies.fully_parallel": [
        "FullyParallelSaveStrategyWrapper",
        "FullyParallelLoadStrategyWrapper",
    ],
    "dist_checkpointing.strategies.async_utils": ["AsyncRequest", "AsyncCallsQueue"],
    "dist_checkpointing.tensor_aware_state_dict": ["MCoreTensorAwareStateDict"],
}


@pytest.mark.parametrize("module", sorted(IMPORTED_BY_MEGATRON))
def test_every_name_megatron_imports_exists_in_our_package(module):
    mod = importlib.import_module(module)
    missing = [n for n in IMPORTED_BY_MEGATRON[module] if not hasattr(mod, n)]
    assert not missing


def _st(key: str, n: int = 2) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(key, torch.ones(n))


def test_prefix_helpers_rename_keyed_leaves_in_place():
    sd = {"a": _st("w"), "b": [ShardedObject("o", 1, (1,), (0,))], "c": 5}
    utils.add_prefix_for_sharding(sd, "m.")
    assert (sd["a"].key, sd["b"][0].key, sd["c"]) == ("m.w", "m.o", 5)
    utils.replace_prefix_for_sharding(sd, "m.", "n.")
    assert (sd["a"].key, sd["b"][0].key) == ("n.w", "n.o")
    utils.apply_prefix_mapping(sd, {"x.": "y.", "n.w": "z", "n.": "q."})
    assert (sd["a"].key, sd["b"][0].key) == ("z", "q.o")


def test_replace_prefix_raises_naming_the_key_without_the_prefix():
    with pytest.raises(CheckpointingException, match="'other'"):
        utils.replace_prefix_for_sharding({"a": _st("other")}, "m.", "n.")


def test_extract_helpers_split_by_kind():
    f = ShardedTensorFactory("f", torch.ones(1), lambda *a: {}, lambda s: s)
    sd = {
        "t": _st("t"),
        "f": f,
        "o": ShardedObject("o", 1, (1,), (0,)),
        "l": LocalNonpersistentObject(1),
        "p": 2,
    }
    assert set(utils.extract_sharded_tensors(sd)[0]) == {"t"}
    assert set(utils.extract_sharded_tensors_and_factories(sd)[0]) == {"t", "f"}
    assert set(utils.extract_sharded_tensors_or_nonpersistent(sd)[0]) == {"t", "f", "l"}
    assert set(utils.extract_sharded_base(sd)[0]) == {"t", "f", "o"}
    assert set(utils.extract_nonpersistent(sd)[0]) == {"l"}
    with pytest.raises(CheckpointingException, match=r"\[1, 2\]"):
        list(utils.zip_strict([1], [1, 2]))


def test_optimizer_state_is_sharded_like_its_parameters():
    model = torch.nn.Linear(4, 2)
    model_sd = {
        "weight": ShardedTensor.from_rank_offsets("l.weight", model.weight, (0, 0, 1)),
        "bias": ShardedTensor.from_rank_offsets("l.bias", model.bias, (0, 0, 1)),
    }
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    params = [p for g in opt.param_groups for p in g["params"]]
    id_map = optimizer.get_param_id_to_sharded_param_map(model_sd, params)
    assert {k: v.key for k, v in id_map.items()} == {0: "l.weight", 1: "l.bias"}
    osd = opt.state_dict()
    optimizer.optim_state_to_sharding_state(osd, id_map, exclude_keys="step")
    assert set(osd["state"][0]) == {"exp_avg", "exp_avg_sq"}
    sh = osd["state"][0]["exp_avg"]
    assert (
        sh.key == "optimizer.state.exp_avg.l.weight"
        and sh.data is opt.state[model.weight]["exp_avg"]
    )
    assert isinstance(osd["param_groups"][0]["params"], LocalNonpersistentObject)
    assert isinstance(opt.state_dict()["param_groups"][0]["params"], list)  # deep-copied


def test_optimizer_state_of_an_unknown_param_raises_with_the_keep_vars_hint():
    with pytest.raises(CheckpointingException, match="keep_vars=True"):
        optimizer.optim_state_to_sharding_state(
            {"state": {3: {"exp_avg": torch.ones(1)}}, "param_groups": []}, {}
        )
    with pytest.raises(CheckpointingException, match="shape"):
        optimizer.make_sharded_optimizer_tensor(_st("w", 2), torch.ones(3), "optimizer.state.x")


_INSTALL_SCRIPT = textwrap.dedent(
    """
    import sys, importlib
    import dist_checkpointing, dist_checkpointing.mapping
    from dist_checkpointing import megatron_compat
    megatron_compat.install()
    megatron_compat.install()  # idempotent
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    import megatron.core.dist_checkpointing.optimizer as mopt
    assert mdc is dist_checkpointing and ShardedTensor is dist_checkpointing.mapping.ShardedTensor
    assert mopt is importlib.import_module("dist_checkpointing.optimizer")
    assert dist_checkpointing.mapping.__spec__.name == "dist_checkpointing.mapping"
    try:
        import megatron.core.dist_checkpointing.strategies.zarr
        raise SystemExit("a module we do not have imported")
    except ModuleNotFoundError as e:
        assert "zarr" in str(e), e
    removed = megatron_compat.uninstall()
    assert "megatron.core.dist_checkpointing" in removed, removed
    # megatron's own package imported first: install refuses to mix the two
    sys.modules["megatron.core.dist_checkpointing"] = type(sys)("megatron.core.dist_checkpointing")
    try:
        megatron_compat.install()
        raise SystemExit("install after megatron's import did not raise")
    except dist_checkpointing.CheckpointingException as e:
        assert "before importing megatron.core" in str(e)
    print("OK")
    """
)


def test_install_makes_megatron_module_paths_resolve_to_our_package(tmp_path):
    # empty `megatron` and `megatron.core` packages stand in for an installed megatron-core
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (tmp_path / "megatron" / "core" / "__init__.py").write_text("")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-c", _INSTALL_SCRIPT],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{tmp_path}"},
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
