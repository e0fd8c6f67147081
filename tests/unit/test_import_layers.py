"""The import layers of the package, read from the source with `ast` (nothing is imported).

Rules (docs/architecture.md, "Imports flow one way"):
1. Backends depend on the core, never the reverse: no module outside the backends and the
   application layer (the `dist-ckpt` command, its tools, the demo) imports one, except
   the registry's `_register_builtin_strategies`, which loads the built-ins lazily on first
   use (an import inside that function only).
2. `local/` knows only its own `TensorAwareStateDict` interface: it never imports the
   sharded data model, the entry points, the bridge or any strategy (it may use the async
   service and the shared I/O layer).
3. Nothing in the package imports megatron, nvidia-resiliency-ext, the tests or benchmarks.
"""

from __future__ import annotations

import ast
import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Set

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "dist_checkpointing"

#: Backends: the built-in save/load strategies and their private helpers (fnmatch patterns;
#: `x` also covers `x.*`, a name imported from it or a submodule).
BACKENDS = [
    f"{PACKAGE}.strategies.torch",
    f"{PACKAGE}.strategies.torch_dist",
    f"{PACKAGE}.strategies.local",
    f"{PACKAGE}.strategies.common",
    f"{PACKAGE}.strategies.fully_parallel",
    f"{PACKAGE}.strategies._dcp_*",
]
#: The application layer on top of everything (the `dist-ckpt` command and its tools): it
#: may import backends (to inspect, verify and convert their files).
APPLICATIONS = [
    f"{PACKAGE}.cli",
    f"{PACKAGE}.__main__",
    f"{PACKAGE}.demo",
    f"{PACKAGE}.tools",
]
#: The one place in the core allowed to import backends, lazily.
LAZY_REGISTRATION = "_register_builtin_strategies"

#: What `local/` must not import (rule 2). It may import the async service (`async_save/`).
LOCAL_FORBIDDEN = [
    f"{PACKAGE}.mapping",
    f"{PACKAGE}.serialization",
    f"{PACKAGE}.validation",
    f"{PACKAGE}.tensor_aware_state_dict",
    f"{PACKAGE}.strategies",
]

#: Top-level packages the library never imports (rule 3).
FOREIGN = ["megatron", "nvidia_resiliency_ext", "tests", "benchmarks"]


@dataclass(frozen=True)
class Import:
    """One import statement's target, where it is, and whether it runs at module level."""

    module: str  # importing module
    target: str  # imported module (or module.name when the name may be a submodule)
    line: int
    function: Optional[str]  # enclosing function, None at module level

    def __str__(self) -> str:
        where = f" (in {self.function})" if self.function else ""
        return f"{self.module}:{self.line} imports {self.target}{where}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> List[Path]:
    return sorted((ROOT / PACKAGE).rglob("*.py"))


def _resolve(module: str, is_package: bool, level: int, name: Optional[str]) -> str:
    if level == 0:
        return name or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports_of(path: Path) -> Iterator[Import]:
    module = _module_name(path)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))

    def walk(node: ast.AST, function: Optional[str]) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(child, child.name)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(module, alias.name, child.lineno, function)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(module, is_package, child.level, child.module)
                for alias in child.names:  # the name may be a submodule: keep both levels
                    yield Import(module, f"{base}.{alias.name}", child.lineno, function)
            elif isinstance(child, ast.Call):  # importlib.import_module("x") / __import__("x")
                func = child.func
                fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if fname in ("import_module", "__import__") and child.args:
                    arg = child.args[0]
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        yield Import(module, arg.value, child.lineno, function)
            yield from walk(child, function)

    yield from walk(tree, None)


def all_imports() -> List[Import]:
    return [imp for path in package_modules() for imp in _imports_of(path)]


def _within(target: str, patterns: List[str]) -> bool:
    return any(
        fnmatch.fnmatchcase(target, p) or fnmatch.fnmatchcase(target, p + ".*") for p in patterns
    )


def test_imports_are_found_with_their_resolved_names():
    """The parser itself: relative imports resolve, and lazy imports are told apart."""
    found = {(i.module, i.target, i.function) for i in all_imports()}
    assert (f"{PACKAGE}.serialization", f"{PACKAGE}.mapping.ShardedObject", None) in found
    lazy = [i for i in all_imports() if i.function == LAZY_REGISTRATION]
    assert lazy and all(_within(i.target, BACKENDS) for i in lazy), lazy


def test_core_never_imports_a_backend():
    bad = [
        str(i)
        for i in all_imports()
        if _within(i.target, BACKENDS)
        and not _within(i.module, BACKENDS + APPLICATIONS)
        and i.function != LAZY_REGISTRATION
    ]
    assert bad == [], "\n".join(bad)


def test_local_never_imports_the_sharded_data_model_or_strategies():
    bad = [
        str(i)
        for i in all_imports()
        if _within(i.module, [f"{PACKAGE}.local"]) and _within(i.target, LOCAL_FORBIDDEN)
    ]
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize("foreign", FOREIGN)
def test_package_never_imports(foreign):
    bad = [str(i) for i in all_imports() if _within(i.target, [foreign])]
    assert bad == [], "\n".join(bad)


def test_the_public_backend_modules_exist():
    """Rule 1 names backends by path: if these moved, the rule would silently check nothing."""
    existing: Set[str] = {_module_name(p) for p in package_modules()}
    public = [f"{PACKAGE}.strategies.{name}" for name in ("torch", "local", "common")]
    assert [m for m in public if m not in existing] == []
