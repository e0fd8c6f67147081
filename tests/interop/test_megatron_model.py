"""Megatron-core's real GPTModel (dense and MoE) plus optimizer state, saved and loaded through us.

megatron-core and our package run in the same interpreter (`DIST_CKPT_MCORE_PYTHON`, or this
interpreter when it imports megatron-core, with this repository put first on PYTHONPATH;
.ci/run installs one), 2 gloo ranks, TP=2, reloaded at TP=2 and TP=1. The reference for
every check is megatron's own save + load of the same steps; `mcore_model_side.py` documents
the modes. Both wirings a user may choose are covered: megatron's objects handed to our
save/load, and our package installed in place of `megatron.core.dist_checkpointing`.

Two optimizer variants: `adam` (CPU; torch Adam state made sharded with the
`dist_checkpointing.optimizer` helpers) and `fp32`, megatron's own `FP32Optimizer`, which
allocates a CUDA tensor and so runs only with a GPU (marked `gpu`; both ranks on `cuda:0`,
still over gloo): `pytest -m gpu tests/interop/test_megatron_model.py`.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Set

import pytest
import torch

from tests.interop import _launch, _side_jobs

pytestmark = [pytest.mark.interop, pytest.mark.timeout(1200)]
SIDE = _launch.side_script("mcore_model_side.py")
KINDS = ("dense", "moe")
MODES = ("megatron", "installed", "megatron_load")


def _same_interpreter_python() -> Optional[str]:
    """The megatron python if it can also import our package from this checkout."""
    python = _launch.mcore_python()
    modules = ("megatron.core.dist_checkpointing", "dist_checkpointing.utils")
    return python if _launch.importable(python, *modules) else None


PYTHON = _same_interpreter_python()
requires_mcore_and_us = pytest.mark.skipif(
    PYTHON is None,
    reason="needs a python with megatron-core==0.16.1, psutil, numpy and xxhash "
    "(DIST_CKPT_MCORE_PYTHON, or this one if it imports megatron.core; .ci/run makes one) "
    "that imports this checkout",
)
OPTIMIZERS = [
    "adam",
    pytest.param(
        "fp32",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not torch.cuda.is_available(),
                reason="megatron's FP32Optimizer allocates a CUDA tensor: needs a GPU",
            ),
        ],
    ),
]


def _run(mode: str, workdir: str, optimizer: str) -> Dict[str, str]:
    assert PYTHON is not None
    for rank in range(2):
        path = os.path.join(workdir, f"result.{rank}.json")
        if os.path.exists(path):
            os.remove(path)
    _launch.run_side(
        PYTHON,
        [SIDE, mode, workdir, ",".join(KINDS), optimizer],
        timeout=540,
        env={"PYTHONPATH": _launch.pythonpath(_launch.REPO), "OMP_NUM_THREADS": "1"},
    )
    merged: Dict[str, str] = {}
    for rank in range(2):
        for name, outcome in _launch.read_json(
            os.path.join(workdir, f"result.{rank}.json")
        ).items():
            merged[f"rank {rank}: {name}"] = outcome
    return merged


def _run_modes(workdir: str, optimizer: str) -> Dict[str, Dict[str, str]]:
    """The three modes in order (each needs the checkpoints of the previous ones)."""
    return {mode: _run(mode, workdir, optimizer) for mode in MODES}


def start_in_background(tmp_path_factory: pytest.TempPathFactory, fixtures: Set[str]) -> None:
    """Starts the CPU variant's side runs when a selected test of this module needs them."""
    if PYTHON is not None and "outcomes" in fixtures:
        workdir = str(tmp_path_factory.mktemp("mcore_model_adam"))
        _side_jobs.in_background("megatron_model-adam", lambda: _run_modes(workdir, "adam"))


@pytest.fixture(scope="module", params=OPTIMIZERS)
def outcomes(request, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Dict[str, str]]:
    """The three modes' outcomes (started in the background for `adam`)."""
    if PYTHON is None:  # the tests skip too; no side run
        pytest.skip("megatron-core is not available (see requires_mcore_and_us)")
    optimizer = request.param
    runs = _side_jobs.wait_for(
        f"megatron_model-{optimizer}",
        lambda: _run_modes(str(tmp_path_factory.mktemp(f"mcore_model_{optimizer}")), optimizer),
    )
    if optimizer == "fp32":
        built = [k for k in runs["megatron"] if "built by megatron's FP32Optimizer" in k]
        assert len(built) == 2 * len(KINDS), sorted(runs["megatron"])
    return runs


def _failures(results: Dict[str, str], must_contain: List[str]) -> List[str]:
    for needle in must_contain:
        assert any(needle in name for name in results), f"no check named like {needle!r}"
    return [f"{name}: {outcome}" for name, outcome in results.items() if outcome != "ok"]


@requires_mcore_and_us
def test_megatron_objects_saved_by_megatron_load_in_ours_equal_megatrons_load(outcomes):
    results = {
        k: v
        for k, v in outcomes["megatron"].items()
        if "loads mc" in k or "reference" in k or "FP32Optimizer" in k
    }
    needles = [f"{kind}: ours loads mc at tp{tp}" for kind in KINDS for tp in (2, 1)]
    assert not _failures(results, needles + ["reference load at tp1 filled"])


@requires_mcore_and_us
def test_megatron_objects_saved_by_us_load_in_megatron_and_ours_equal_megatrons_load(outcomes):
    results = {
        k: v
        for k, v in outcomes["megatron"].items()
        if "ours_objects" in k or "our save of megatron objects" in k
    }
    needles = [
        f"{kind}: {who} loads ours_objects at tp{tp}"
        for kind in KINDS
        for who in ("ours", "megatron")
        for tp in (2, 1)
    ]
    assert not _failures(results, needles + ["our save of megatron objects"])


@requires_mcore_and_us
def test_installed_in_place_of_megatron_model_code_builds_our_objects_and_round_trips(outcomes):
    needles = [
        f"{kind}: ours loads {name} at tp{tp}"
        for kind in KINDS
        for name in ("mc", "ours_installed")
        for tp in (2, 1)
    ]
    assert not _failures(outcomes["installed"], needles + ["model code builds our ShardedTensor"])


@requires_mcore_and_us
def test_megatron_loads_what_installed_package_saved(outcomes):
    needles = [
        f"{kind}: megatron loads ours_installed at tp{tp}" for kind in KINDS for tp in (2, 1)
    ]
    assert not _failures(outcomes["megatron_load"], needles)
