"""The strategy registry: lookup, registration, errors, and lazy built-ins."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

from dist_checkpointing.errors import CheckpointingException, StrategyNotFoundError
from dist_checkpointing.strategies.base import (
    LoadShardedStrategy,
    StrategyAction,
    default_strategies,
    get_default_strategy,
    register_default_strategy,
    resolve_strategy,
)
from dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)

PKG = pathlib.Path(__file__).resolve().parents[2] / "dist_checkpointing"


def test_builtins_are_found():
    assert isinstance(
        get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1),
        TorchDistSaveShardedStrategy,
    )
    assert isinstance(
        get_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1),
        TorchDistLoadShardedStrategy,
    )
    assert (
        str(get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1))
        == "TorchDistSaveShardedStrategy(torch_dist, 1)"
    )


def test_unknown_triple_names_all_three_and_lists_registered():
    with pytest.raises(StrategyNotFoundError) as info:
        get_default_strategy(StrategyAction.LOAD_SHARDED, "zarr", 3)
    msg = str(info.value)
    assert "load_sharded" in msg and "'zarr'" in msg and "version=3" in msg
    assert "(load_sharded, 'torch_dist', 1)" in msg


class _Loader(LoadShardedStrategy):
    def check_backend_compatibility(self, loaded_backend):
        pass

    def check_version_compatibility(self, loaded_version):
        pass

    def load(self, sharded_state_dict, checkpoint_dir):
        return {}

    def load_tensors_metadata(self, checkpoint_dir):
        return {}


def test_register_and_resolve_user_strategy():
    loader = _Loader()
    register_default_strategy(StrategyAction.LOAD_SHARDED, "unit_backend", 4, loader)
    assert get_default_strategy(StrategyAction.LOAD_SHARDED, "unit_backend", 4) is loader
    assert resolve_strategy(StrategyAction.LOAD_SHARDED, ("unit_backend", 4)) is loader
    assert resolve_strategy(StrategyAction.LOAD_SHARDED, loader) is loader


@pytest.mark.parametrize(
    "backend,version,strategy,match",
    [
        ("", 1, _Loader(), "non-empty"),
        ("b", 0, _Loader(), "positive"),
        ("b", True, _Loader(), "positive"),
        ("b", 1, object(), "must be a LoadShardedStrategy"),
    ],
)
def test_register_rejects_bad_entries(backend, version, strategy, match):
    with pytest.raises(CheckpointingException, match=match):
        register_default_strategy(StrategyAction.LOAD_SHARDED, backend, version, strategy)


def test_resolve_rejects_strategy_of_wrong_kind():
    with pytest.raises(CheckpointingException, match="SaveShardedStrategy"):
        resolve_strategy(StrategyAction.SAVE_SHARDED, _Loader())
    with pytest.raises(CheckpointingException, match=r"\(backend, version\)"):
        resolve_strategy(StrategyAction.SAVE_SHARDED, ("torch_dist",))


def test_default_strategies_is_a_read_only_view_of_the_registry():
    strategy = TorchDistLoadShardedStrategy()
    register_default_strategy(StrategyAction.LOAD_SHARDED, "view_test", 3, strategy)
    table = default_strategies[StrategyAction.LOAD_SHARDED.value]
    assert table[("view_test", 3)] is strategy
    assert ("view_test", 3) not in default_strategies[StrategyAction.SAVE_SHARDED.value]
    assert set(default_strategies) == {a.value for a in StrategyAction}
    with pytest.raises(TypeError):
        table[("view_test", 4)] = strategy  # type: ignore[index]


def test_importing_the_package_registers_nothing_and_starts_nothing():
    code = (
        "import threading, dist_checkpointing, dist_checkpointing.strategies.base as b;"
        "assert not b._builtins_registered, 'registered at import';"
        "assert not any(b.default_strategies.values());"
        "assert threading.active_count() == 1, threading.enumerate();"
        "import sys; assert 'dist_checkpointing.strategies.torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _imports(path: pathlib.Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize(
    "module",
    ["core.py", "mapping.py", "dict_utils.py", "validation.py", "serialization.py", "errors.py"],
)
def test_core_modules_never_import_a_backend(module):
    for name in _imports(PKG / module):
        assert ".strategies.torch" not in name and ".strategies.common" not in name, (module, name)
        assert not name.startswith("megatron") and not name.startswith("nvidia_resiliency_ext"), (
            module,
            name,
        )


def test_package_never_imports_reference_implementations():
    for path in PKG.rglob("*.py"):
        for name in _imports(path):
            assert not name.startswith(("megatron", "nvidia_resiliency_ext")), (path, name)
