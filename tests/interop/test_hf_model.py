"""`dist_checkpointing.hf_model`: megatron-core 0.16's GPTModel checkpoints (TP=2, PP=2, MoE,
with Adam state) into transformers models, FSDP2-sharded on 2 ranks and plain, and back.

One side run (`hf_model_side.py` says what it checks) in the side venv that has megatron-core
and transformers (`DIST_CKPT_MCORE_PYTHON`, .ci/run installs both); the row mapping itself
is also checked here, in this process, against megatron's layouts written out.
"""

from __future__ import annotations

import os
import subprocess
from typing import Dict, Set

import pytest
import torch

from dist_checkpointing import _hf_layout
from dist_checkpointing.tools import hf_map
from tests.interop import _launch, _side_jobs

PYTHON = _launch.mcore_python()
_ENV = {"PYTHONPATH": _launch.pythonpath(_launch.REPO)}
if PYTHON and not _launch.importable(PYTHON, "transformers", "dist_checkpointing"):
    PYTHON = None
MCORE19 = _launch.mcore19()
requires_side_venv = pytest.mark.skipif(
    PYTHON is None,
    reason="needs a python with megatron-core==0.16.1 and transformers that imports this "
    "checkout (DIST_CKPT_MCORE_PYTHON; .ci/run makes one)",
)


def _hf_model_run(work: str) -> Dict[str, str]:
    """`hf_model_side.py`'s checks, by rank."""
    assert PYTHON is not None
    env = {**_ENV, "OMP_NUM_THREADS": "1"}
    script = _launch.side_script("hf_model_side.py")
    _launch.run_side(PYTHON, [script, work], timeout=600, env=env)
    got = [_launch.read_json(os.path.join(work, f"result.{r}.json")) for r in (0, 1)]
    return {f"rank {r}: {k}": v for r, res in enumerate(got) for k, v in res.items()}


def _mcore19_run(work: str) -> str:
    """`hf_mcore19_side.py` run in `work` (megatron-core 0.19's interpreter)."""
    assert PYTHON is not None and MCORE19 is not None
    script = _launch.side_script("hf_mcore19_side.py")
    # 0.19's interpreter has no transformers: the side venv's packages, after its own
    site = subprocess.run(
        [PYTHON, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    env = {"PYTHONPATH": _launch.pythonpath(MCORE19["path"], _launch.REPO), "OMP_NUM_THREADS": "1"}
    _launch.run_side(MCORE19["python"], [script, work, site], timeout=600, env=env)
    return work


def start_in_background(tmp_path_factory: pytest.TempPathFactory, fixtures: Set[str]) -> None:
    """Starts the side runs behind `fixtures` (the names this module's selected tests use)."""
    if PYTHON is not None and "results" in fixtures:
        work = str(tmp_path_factory.mktemp("hf_model"))
        _side_jobs.in_background("hf_model", lambda: _hf_model_run(work))
    if PYTHON is not None and MCORE19 is not None and "mcore19_work" in fixtures:
        work19 = str(tmp_path_factory.mktemp("hf_mcore19"))
        _side_jobs.in_background("hf_mcore19", lambda: _mcore19_run(work19))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, str]:
    if PYTHON is None:
        pytest.skip("no side venv (see requires_side_venv)")
    return _side_jobs.wait_for(
        "hf_model", lambda: _hf_model_run(str(tmp_path_factory.mktemp("hf_model")))
    )


@pytest.fixture(scope="module")
def mcore19_work(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Where `hf_mcore19_side.py` ran (both interpreters there, or the test skips)."""
    if PYTHON is None or MCORE19 is None:
        pytest.skip("no side venv or no megatron-core 0.19.2 (see the test's marks)")
    return _side_jobs.wait_for(
        "hf_mcore19", lambda: _mcore19_run(str(tmp_path_factory.mktemp("hf_mcore19")))
    )


def _check(results: Dict[str, str], checks: list) -> None:
    """Each named check ran on both ranks and passed."""
    for check in checks:
        for rank in (0, 1):
            got = results.get(f"rank {rank}: {check}")
            assert got == "ok", f"rank {rank}: {check}: {got or 'not run'}"


@pytest.mark.interop
@pytest.mark.timeout(900)
@requires_side_venv
@pytest.mark.parametrize("scenario", ["tp2", "pp2", "moe_tp2"])
@pytest.mark.parametrize("how", ["fsdp2", "plain", "fsdp1"])
def test_load_into_transformers_model_gives_megatrons_logits_and_adam_state(results, scenario, how):
    _check(
        results,
        [
            f"{scenario} {how}: logits equal megatron's",
            f"{scenario} {how}: Adam state equals megatron's",
            f"{scenario} {how}: returns the plain values",
        ],
    )


@pytest.mark.interop
@pytest.mark.timeout(900)
@requires_side_venv
@pytest.mark.parametrize(
    "scenario,how", [("pp2", "fsdp2"), ("pp2", "plain"), ("pp2", "hsdp"), ("moe_tp2", "fsdp2")]
)
def test_save_loads_in_megatron_bit_exactly_at_tp2_and_tp1(results, scenario, how):
    checks = [f"megatron loads our save of {scenario} {how} at tp{tp}" for tp in (2, 1)]
    _check(results, [*checks, f"{scenario} {how}: save, then load, gives the same logits"])


@pytest.mark.interop
@pytest.mark.timeout(900)
@requires_side_venv
def test_load_into_hsdp_model_gives_megatrons_logits_and_adam_state(results):
    _check(
        results,
        [
            "pp2 hsdp: logits equal megatron's",
            "pp2 hsdp: Adam state equals megatron's",
            "pp2 hsdp: returns the plain values",
        ],
    )


@pytest.mark.interop
@pytest.mark.timeout(900)
@requires_side_venv
def test_fsdp2_load_reads_only_each_ranks_half_of_the_stored_bytes(results):
    _check(
        results,
        [
            f"{name} fsdp2: each rank reads about half the tensor bytes"
            for name in ("tp2", "pp2", "moe_tp2")
        ],
    )


@pytest.mark.interop
@pytest.mark.timeout(900)
@requires_side_venv
def test_load_refuses_mismatched_models_on_every_rank_before_reading(results):
    _check(results, ["refused: other kv heads", "refused: attention bias"])


@pytest.mark.parametrize("heads,groups,d", [(4, 2, 3), (6, 3, 2), (4, 4, 2), (8, 1, 2)])
def test_row_pieces_of_any_row_range_follow_megatrons_fused_layouts(heads, groups, d):
    hidden, ffn, vocab, padded = 5, 6, 7, 9
    shapes = {
        "embedding.word_embeddings.weight": (padded, hidden),
        "decoder.layers.self_attention.linear_qkv.weight": (2, (heads + 2 * groups) * d, hidden),
        "decoder.layers.mlp.linear_fc1.weight": (2, 2 * ffn, hidden),
        "decoder.layers.1.mlp.linear_fc2.weight": (hidden, ffn),
    }
    stored = {k: torch.randn(s) for k, s in shapes.items()}
    index = _hf_layout.index_stored(shapes)
    layout = _hf_layout.Heads(heads, groups, d)
    want = {"model.embed_tokens.weight": stored["embedding.word_embeddings.weight"][:vocab]}
    want["model.layers.1.mlp.down_proj.weight"] = stored["decoder.layers.1.mlp.linear_fc2.weight"]
    # megatron's layouts written out: per query group its query heads, its key head, its
    # value head; fc1 = [gate; up]
    qkv = stored["decoder.layers.self_attention.linear_qkv.weight"][1].view(groups, -1, d, hidden)
    per = heads // groups
    for hf, rows in (("q", slice(0, per)), ("k", slice(per, per + 1)), ("v", slice(per + 1, None))):
        want[f"model.layers.1.self_attn.{hf}_proj.weight"] = qkv[:, rows].reshape(-1, hidden)
    fc1 = stored["decoder.layers.mlp.linear_fc1.weight"][1]
    want["model.layers.1.mlp.gate_proj.weight"] = fc1[:ffn]
    want["model.layers.1.mlp.up_proj.weight"] = fc1[ffn:]
    for hf_name, full in want.items():
        src, why = _hf_layout.source(hf_name, index)
        assert src is not None, why
        shape, shorter = _hf_layout.expected_shape(src, layout)
        assert shape[1:] == full.shape[1:] and (shape[0] == full.shape[0] or shorter)
        st = src.stored[0]
        rows = full.shape[0]
        for start in range(rows):
            for stop in range(start, rows + 1):
                got = torch.zeros(stop - start, *full.shape[1:])
                for srow, hrow, n in _hf_layout.row_pieces(src, layout, start, stop):
                    whole = stored[st.key][st.lead] if st.lead else stored[st.key]
                    got[hrow - start : hrow - start + n] = whole[srow : srow + n]
                assert torch.equal(got, full[start:stop]), (hf_name, start, stop)
    # export-hf's split and import-hf's fuse (built on row_pieces) agree
    for name in ("self_attention.linear_qkv.weight", "mlp.linear_fc1.weight"):
        fused = stored[f"decoder.layers.{name}"][1]
        hf = [want[f"model.layers.1.{n}"] for n in hf_map.LAYER[name]]
        parts = hf_map.split(name, fused, heads, groups)
        assert len(parts) == len(hf) and all(torch.equal(a, b) for a, b in zip(parts, hf))
        assert torch.equal(hf_map.fuse(name, hf, heads, groups), fused)


def test_unmapped_parameter_names_say_why():
    index = _hf_layout.index_stored({"embedding.word_embeddings.weight": (4, 2)})
    src, why = _hf_layout.source("model.layers.0.self_attn.q_proj.bias", index)
    assert src is None and "no megatron-core GPTModel name" in why
    src, why = _hf_layout.source("model.norm.weight", index)
    assert src is None and "decoder.final_layernorm.weight" in why


@pytest.mark.interop
@pytest.mark.timeout(900)
@requires_side_venv
def test_megatrons_fp32_optimizer_resumes_from_our_save_of_a_single_group_adamw(results):
    _check(
        results,
        [
            "megatron makes two groups by wd_mult",
            "save refuses two lr in one megatron group",
            "FP32Optimizer.load_state_dict resumes our save",
            "FP32Optimizer.step after the load",
        ],
    )


@pytest.mark.interop
@pytest.mark.timeout(900)
@requires_side_venv
@pytest.mark.skipif(
    MCORE19 is None,
    reason="megatron-core 0.19.2 is not set up (DIST_CKPT_MCORE19_PYTHON, DIST_CKPT_MCORE19_PATH)",
)
def test_megatron_core_019_checkpoint_loads_and_our_save_loads_in_019(mcore19_work):
    work = mcore19_work
    for rank in (0, 1):
        got = _launch.read_json(os.path.join(work, f"result.{rank}.json"))
        bad = {k: v for k, v in got.items() if v != "ok"}
        assert got and not bad, f"rank {rank}: {bad}"
    # 0.19's layout: the common state inside the .distcp files, no common.pt
    assert not os.path.exists(os.path.join(work, "tp2", "mc", "common.pt"))
    hf = _launch.read_json(os.path.join(work, "result.0.json"))
    assert (
        "tp2 fsdp2: logits equal megatron's" in hf
        and "tp2 fsdp2: Adam state equals megatron's" in hf
        and all(f"megatron loads our save of tp2 fsdp2 at tp{tp}" in hf for tp in (2, 1))
        and "FP32Optimizer.load_state_dict resumes our save" in hf
    )
