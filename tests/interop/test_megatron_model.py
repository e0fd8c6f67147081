"""Megatron-core's real GPTModel (dense and MoE) plus Adam state, saved and loaded through us.

megatron-core and our package run in the same interpreter (`DIST_CKPT_MCORE_PYTHON` with
this repository on PYTHONPATH; .ci/run installs it), 2 gloo ranks, TP=2, reloaded at TP=2
and TP=1. The reference for every check is megatron's own save + load of the same steps;
`mcore_model_side.py` documents the modes. Both wirings a user may choose are covered:
megatron's objects handed to our save/load, and our package installed in place of
`megatron.core.dist_checkpointing`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from typing import Dict, List

import pytest

from tests.interop.test_megatron_core import MCORE_PYTHON

pytestmark = [pytest.mark.interop, pytest.mark.timeout(900)]
SIDE = os.path.join(os.path.dirname(__file__), "mcore_model_side.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KINDS = ("dense", "moe")


def _same_interpreter_python() -> str | None:
    """The megatron python if it can also import our package from this checkout."""
    if MCORE_PYTHON is None:
        return None
    probe = subprocess.run(
        [MCORE_PYTHON, "-c", "import megatron.core.dist_checkpointing, dist_checkpointing.utils"],
        capture_output=True,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    return MCORE_PYTHON if probe.returncode == 0 else None


PYTHON = _same_interpreter_python()
requires_mcore_and_us = pytest.mark.skipif(
    PYTHON is None,
    reason="needs a python with megatron-core==0.16.1, psutil, numpy and xxhash "
    "(DIST_CKPT_MCORE_PYTHON; .ci/run makes one) that imports this checkout",
)


def _run(mode: str, workdir: str) -> Dict[str, str]:
    assert PYTHON is not None
    for rank in range(2):
        path = os.path.join(workdir, f"result.{rank}.json")
        if os.path.exists(path):
            os.remove(path)
    proc = subprocess.Popen(
        [PYTHON, SIDE, mode, workdir, ",".join(KINDS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"},
        start_new_session=True,  # megatron leaves helper processes behind; end the group
    )
    try:
        out, _ = proc.communicate(timeout=420)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out.decode(errors="replace")[-4000:]
    merged: Dict[str, str] = {}
    for rank in range(2):
        with open(os.path.join(workdir, f"result.{rank}.json")) as f:
            for name, outcome in json.load(f).items():
                merged[f"rank {rank}: {name}"] = outcome
    return merged


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Dict[str, str]]:
    """Runs the three modes in order (each needs the checkpoints of the previous ones)."""
    workdir = str(tmp_path_factory.mktemp("mcore_model"))
    return {mode: _run(mode, workdir) for mode in ("megatron", "installed", "megatron_load")}


def _failures(results: Dict[str, str], must_contain: List[str]) -> List[str]:
    for needle in must_contain:
        assert any(needle in name for name in results), f"no check named like {needle!r}"
    return [f"{name}: {outcome}" for name, outcome in results.items() if outcome != "ok"]


@requires_mcore_and_us
def test_megatron_objects_saved_by_megatron_load_in_ours_equal_megatrons_load(outcomes):
    results = {k: v for k, v in outcomes["megatron"].items() if "loads mc" in k or "reference" in k}
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
