"""`dist-ckpt export-hf` / `import-hf` between megatron-core 0.16's GPTModel and transformers.

Three side runs and our CLI in between (`mcore_hf_side.py` and `hf_side.py` say what each
checks); megatron-core and transformers run in the side venv (`DIST_CKPT_MCORE_PYTHON`,
.ci/run installs both), our CLI in this process:
1. transformers builds a Llama and a tied-embedding Mixtral; `import-hf --tp 2` writes them;
2. megatron (2 gloo ranks) saves Llama-style models at TP=2 (tied) and PP=2 (untied) and a
   Mixtral-style one at TP=2 and at EP=2, with its own sharded state dict and save, and
   loads the imported checkpoints at TP=2 (its own load), comparing logits;
3. `export-hf` writes each of megatron's checkpoints, and the imported Llama again without
   a description (the stored one is used); transformers loads each and compares logits.
"""

from __future__ import annotations

import os
import shutil
from typing import Dict, Set, Tuple

import pytest

from dist_checkpointing.cli import main
from tests.interop import _launch, _side_jobs

pytestmark = [pytest.mark.interop, pytest.mark.timeout(900)]
SCENARIOS = ("dense_tied_tp2", "dense_untied_pp2", "moe_tp2", "moe_ep2")
IMPORTED = ("imported", "imported_tied_moe")


def _python() -> object:
    python = _launch.mcore_python()
    modules = ("megatron.core", "transformers", "dist_checkpointing")
    return python if _launch.importable(python, *modules) else None


PYTHON = _python()
requires_side_venv = pytest.mark.skipif(
    PYTHON is None,
    reason="needs a python with megatron-core==0.16.1 and transformers that imports this "
    "checkout (DIST_CKPT_MCORE_PYTHON; .ci/run makes one)",
)


def _side(script: str, *args: str) -> None:
    assert isinstance(PYTHON, str)
    env = {"PYTHONPATH": _launch.pythonpath(_launch.REPO), "OMP_NUM_THREADS": "1"}
    _launch.run_side(PYTHON, [_launch.side_script(script), *args], timeout=600, env=env)


def _make(work: str) -> Tuple[str, Dict[str, str]]:
    """Step 1 in `work`: transformers builds the models `import-hf` reads; its checks."""
    _side("hf_side.py", "make", work)
    return work, _launch.read_json(os.path.join(work, "hf_result.json"))


def start_in_background(tmp_path_factory: pytest.TempPathFactory, fixtures: Set[str]) -> None:
    """Starts step 1 (a side run of its own) when a selected test of this module needs it."""
    if PYTHON is not None and "results" in fixtures:
        work = str(tmp_path_factory.mktemp("hf"))
        _side_jobs.in_background("hf_make", lambda: _make(work))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, str]:
    if PYTHON is None:
        pytest.skip("no side venv (see requires_side_venv)")
    work, made = _side_jobs.wait_for("hf_make", lambda: _make(str(tmp_path_factory.mktemp("hf"))))
    for name in IMPORTED:
        base = os.path.join(work, name)
        assert main(["import-hf", f"{base}/hf", f"{base}/mc", "--tp", "2"]) == 0
    _side("mcore_hf_side.py", work)
    merged = {**made, **_launch.read_json(os.path.join(work, "result.1.json"))}
    for name in SCENARIOS:
        base = os.path.join(work, name)
        config = os.path.join(base, "megatron.json")
        assert main(["export-hf", f"{base}/mc", f"{base}/hf", "--config", config]) == 0
    # the imported Llama back to HF, described by what import-hf stored
    os.makedirs(os.path.join(work, "roundtrip"))
    shutil.copy(os.path.join(work, "imported", "logits.pt"), os.path.join(work, "roundtrip"))
    assert main(["export-hf", f"{work}/imported/mc", f"{work}/roundtrip/hf"]) == 0
    _side("hf_side.py", "check", work, *SCENARIOS, "roundtrip")
    return {**merged, **_launch.read_json(os.path.join(work, "hf_result.json"))}


def _check(results: Dict[str, str], needles: list) -> None:
    for needle in needles:
        assert any(needle in k for k in results), f"no check like {needle!r}: {sorted(results)}"
    bad = {k: v for k, v in results.items() if any(n in k for n in needles) and v != "ok"}
    assert not bad


@requires_side_venv
def test_export_hf_of_megatron_checkpoints_gives_megatrons_logits_in_transformers(results):
    _check(results, [f"{name}: transformers loads the export" for name in SCENARIOS])


@requires_side_venv
def test_import_hf_loads_in_megatron_at_tp2_with_transformers_logits(results):
    needles = [f"{n}: megatron loads it at tp2, logits match" for n in IMPORTED]
    _check(results, needles + [f"{n}: our load at tp2 equals megatron's" for n in IMPORTED])


@requires_side_venv
def test_export_hf_of_imported_checkpoint_needs_no_description_and_round_trips(results):
    _check(results, ["roundtrip: transformers loads the export"])
