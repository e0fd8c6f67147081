"""megatron-core 0.16's GPTModel checkpoints into transformers models with `hf_model.load`
(2 gloo ranks, one interpreter with megatron-core and transformers).

Usage: python hf_model_side.py WORKDIR

1. For each scenario in `SCENARIOS` megatron builds a Llama-style GPTModel (grouped-query
   attention, SwiGLU, RMSNorm, RoPE; vocabulary 130 of which the HF model uses 129, so the
   stored embedding has one padded row and FSDP2's embedding shards are uneven) at its split,
   takes one step of a torch Adam over megatron's default param groups, and saves model and optimizer state as megatron's optimizer wrappers
   do (`dist_checkpointing.optimizer` helpers, one `common_step`), with its own `save`; its
   logits after the step go to `WORKDIR/<name>/logits.pt`.
2. A transformers `LlamaForCausalLM` of the same config, with other values, loads each
   checkpoint with `hf_model.load`: sharded by `fully_shard` on both ranks (with an Adam
   optimizer), plain (a whole model per rank), by `fully_shard` on a mesh of one rank, and
   for pp2 also HSDP (a 2 x 1 mesh); its logits must match megatron's within
   1e-4, and the loaded Adam moments and step must equal the stored ones, split into HF
   names by `hf_map.split` (the mapping `export-hf` uses). Sharded by FSDP2, each rank
   reads (the storage seam's read spy) at most 60% of the stored tensor bytes: its half.
3. `hf_model.save` writes the models `SAVED` names (with Adam state) back in
   megatron's layout; our `load` of it gives the same logits, and megatron-core loads it
   at TP=2 and TP=1 with its own model's sharded state dict (Adam over its default param
   groups): every model and optimizer tensor equals its load of the original checkpoint.
4. megatron's own FP32Optimizer resumes from an `hf_model.save` (`hf_optimizer_side.py`).
5. Mismatched models are refused on both ranks before anything changes: other key/value
   heads (the error names k_proj, both shapes and num_key_value_heads), attention biases.

Each rank writes `WORKDIR/result.<rank>.json`: `{check name: "ok" | failure}`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List

#: name -> (tp, pp, description changes)
SCENARIOS: Dict[str, Any] = {
    "tp2": (2, 1, {"num_layers": 2}),
    "pp2": (1, 2, {"num_layers": 4, "vocab_size": 128}),
    "moe_tp2": (
        2,
        1,
        {"num_layers": 2, "num_moe_experts": 4, "moe_router_topk": 2, "vocab_size": 128},
    ),
}
#: the HF model's vocabulary (megatron's is 130 unless the scenario says otherwise)
HF_VOCAB = 129
#: how the transformers model is sharded: FSDP2 on 2 ranks, plain (a whole model per rank),
#: FSDP2 on a mesh of one rank, HSDP on a 2 x 1 mesh (only for pp2)
HOWS = ("fsdp2", "plain", "fsdp1", "hsdp")
#: scenario -> its models that `hf_model.save` writes back for megatron to load
SAVED = {"pp2": ("fsdp2", "plain", "hsdp"), "moe_tp2": ("fsdp2",)}


def hf_vocab(name: str) -> int:
    return min(HF_VOCAB, SCENARIOS[name][2].get("vocab_size", 130))


def hf_config(layers: int, experts: int = 0, vocab: int = HF_VOCAB, **changes: Any) -> Any:
    import transformers

    fields: Dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        tie_word_embeddings=False,
    )
    fields.update(changes)
    if experts:
        return transformers.MixtralConfig(
            **fields, num_local_experts=experts, num_experts_per_tok=2
        )
    return transformers.LlamaConfig(**fields)


def default_groups(model: Any) -> List[Dict[str, Any]]:
    """The param groups megatron-core's optimizer setup makes for `model` by default."""
    from megatron.core.optimizer import (
        OptimizerConfig,
        _get_param_groups,
        get_standard_config_overrides,
    )

    config = OptimizerConfig(optimizer="adam", lr=1e-2)
    return _get_param_groups([model], config, get_standard_config_overrides(config))


def megatron_save(rank: int, workdir: str) -> None:
    import torch
    import torch.distributed as dist
    from mcore_hf_side import BASE, build, forward
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing import optimizer as m_optimizer

    for name, (tp, pp, extra) in SCENARIOS.items():
        desc = {**BASE, "vocab_size": 130, **extra}
        base = os.path.join(workdir, name)
        mc = os.path.join(base, "mc")
        if rank == 0:
            os.makedirs(mc, exist_ok=True)
        dist.barrier()
        model = build(desc, tp, pp, 1, seed=11)
        adam = torch.optim.Adam(default_groups(model), lr=1e-2)
        loss = sum(
            (p * torch.linspace(-1, 1, p.numel()).view_as(p)).sum() for p in model.parameters()
        )
        loss.backward()
        adam.step()
        model_sd = model.sharded_state_dict()
        params = [p for g in adam.param_groups for p in g["params"]]
        id_map = m_optimizer.get_param_id_to_sharded_param_map(model_sd, params)
        optim_sd = adam.state_dict()
        step = optim_sd["state"][0]["step"]
        m_optimizer.optim_state_to_sharding_state(optim_sd, id_map, exclude_keys="step")
        optim_sd["state"]["common_step"] = step  # as megatron's FP32Optimizer stores it
        mdc.save({"model": model_sd, "optimizer": optim_sd, "iteration": 7}, mc)
        logits = forward(model, pp)
        if logits is not None:
            torch.save(logits[..., : hf_vocab(name)], os.path.join(base, "logits.pt"))
        dist.barrier()


def reference(mc: str, layers: int, vocab: int) -> Dict[str, Any]:
    """The stored Adam moments in HF names (full tensors), through export-hf's mapping."""
    import dist_checkpointing as ours
    from dist_checkpointing.tools import hf_map

    stored = ours.load_plain_tensors(mc)
    out: Dict[str, Any] = {}
    for moment in ("exp_avg", "exp_avg_sq"):
        pre = f"optimizer.state.{moment}."
        for key, hf in hf_map.GLOBAL.items():
            out[f"{moment}/{hf}"] = (
                stored[pre + key][:vocab] if "norm" not in key else stored[pre + key]
            )
        for name, hfs in hf_map.LAYER.items():
            if pre + "decoder.layers." + name not in stored:
                continue
            for i in range(layers):
                parts = hf_map.split(name, stored[pre + "decoder.layers." + name][i], 4, 2)
                for hf, part in zip(hfs, parts):
                    out[f"{moment}/model.layers.{i}.{hf}"] = part
        # transformers 5's Mixtral: the router, and every expert's [gate; up] / down stacked
        for name, hf in (
            ("mlp.router.weight", "mlp.gate.weight"),
            ("mlp.experts.experts.linear_fc1.weight", "mlp.experts.gate_up_proj"),
            ("mlp.experts.experts.linear_fc2.weight", "mlp.experts.down_proj"),
        ):
            for i in range(layers if pre + "decoder.layers." + name in stored else 0):
                out[f"{moment}/model.layers.{i}.{hf}"] = stored[pre + "decoder.layers." + name][i]
    return out


def tensor_bytes(ckpt: str) -> int:
    """The bytes of every tensor the checkpoint stores (global shapes)."""
    import math

    import dist_checkpointing as ours

    meta = ours.load_tensors_metadata(ckpt)
    return sum(math.prod(t.global_shape) * t.dtype.itemsize for t in meta.values())


def hf_checks(rank: int, workdir: str, results: Dict[str, str]) -> None:
    import torch
    import transformers
    from mcore_hf_side import tokens
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from dist_checkpointing import hf_model
    from dist_checkpointing.errors import CheckpointingException
    from dist_checkpointing.storage import faults

    mesh = init_device_mesh("cpu", (2,))
    # HSDP as fully_shard makes it on a 2-D mesh: (Replicate(), Shard(0)), here 2 x 1
    hsdp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    for name, (_tp, _pp, extra) in SCENARIOS.items():
        experts = extra.get("num_moe_experts", 0)
        mc = os.path.join(workdir, name, "mc")
        want = torch.load(os.path.join(workdir, name, "logits.pt"))
        layers = extra["num_layers"]
        ref = reference(mc, layers, hf_vocab(name))
        for how in HOWS if name == "pp2" else HOWS[:3]:
            torch.manual_seed(100 + rank)  # other values on each rank, nothing like megatron's
            config = hf_config(layers, experts, hf_vocab(name))
            model = transformers.AutoModelForCausalLM.from_config(config).eval()
            if how != "plain":
                # fsdp1: FSDP2 on a mesh of one rank (each rank its own world of one)
                shard_mesh = {"fsdp2": mesh, "fsdp1": hsdp["shard"], "hsdp": hsdp}[how]
                for layer in model.model.layers:
                    fully_shard(layer, mesh=shard_mesh)
                fully_shard(model, mesh=shard_mesh)
            adam = torch.optim.Adam(model.parameters(), lr=1e-2)
            with faults.injected(faults.Fault("*.distcp", ops=("read",))) as (spy,):
                out = hf_model.load(model, mc, adam)
            if how == "fsdp2":  # megatron's files have no checksums: exactly the bytes asked
                read, total = sum(c.nbytes for c in spy.calls), tensor_bytes(mc)
                results[f"{name} {how}: each rank reads about half the tensor bytes"] = (
                    "ok" if 0 < read <= 0.6 * total else f"read {read} of {total} bytes"
                )
            named = list(model.named_parameters())  # FSDP2 swaps in unsharded ones in forward
            with torch.no_grad():
                logits = model(tokens()).logits
            diff = float((logits - want).abs().max())
            results[f"{name} {how}: logits equal megatron's"] = (
                "ok" if diff <= 1e-4 else f"max abs difference {diff}"
            )
            bad = []
            for pname, p in named:
                state = adam.state[p]
                if float(state["step"]) != 1.0:
                    bad.append(f"{pname} step {state['step']}")
                for moment in ("exp_avg", "exp_avg_sq"):
                    got = state[moment]
                    got = full(got) if isinstance(p, DTensor) else got
                    if (
                        isinstance(got, DTensor)
                        or isinstance(state[moment], DTensor) != isinstance(p, DTensor)
                        or not torch.equal(got, ref[f"{moment}/{pname}"])
                    ):
                        bad.append(f"{pname} {moment}")
            results[f"{name} {how}: Adam state equals megatron's"] = (
                "ok" if not bad else str(bad[:5])
            )
            results[f"{name} {how}: returns the plain values"] = (
                "ok" if out.get("iteration") == 7 else f"got {sorted(out)}"
            )
            if how in SAVED.get(name, ()):  # back to megatron's layout, see megatron_loads
                ours = os.path.join(workdir, name, f"ours_{how}")
                tp, pp = SCENARIOS[name][:2]  # recorded in the description
                hf_model.save(model, ours, adam, common_state={"iteration": 7}, tp=tp, pp=pp)
                # and our load of it gives the same model again
                torch.manual_seed(200 + rank)
                again = transformers.AutoModelForCausalLM.from_config(config).eval()
                hf_model.load(again, ours)
                with torch.no_grad():
                    diff = float((again(tokens()).logits - want).abs().max())
                results[f"{name} {how}: save, then load, gives the same logits"] = (
                    "ok" if diff <= 1e-4 else f"max abs difference {diff}"
                )
    # refused before anything is read or changed, on both ranks
    for label, changes, needles in (
        (
            "other kv heads",
            {"num_key_value_heads": 4},
            ["k_proj", "(64, 64)", "(32, 64)", "num_key_value_heads"],
        ),
        ("attention bias", {"attention_bias": True}, ["attention_bias"]),
    ):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(2, **changes))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            hf_model.load(model, os.path.join(workdir, "tp2", "mc"))
            results[f"refused: {label}"] = "loaded without an error"
        except CheckpointingException as e:
            missing = [n for n in needles if n not in str(e)]
            same = all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
            results[f"refused: {label}"] = (
                "ok"
                if not missing and same
                else f"message lacks {missing} / changed={not same}: {e}"
            )


def megatron_loads(rank: int, workdir: str, results: Dict[str, str]) -> None:
    """megatron-core loads what `hf_model.save` wrote at TP=2 and TP=1 with its own model's
    sharded state dict (Adam state built as its optimizer wrappers do): every model and
    optimizer tensor equals its load of the original checkpoint."""
    import torch
    from mcore_hf_side import BASE, build
    from mcore_model_side import flatten
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing import optimizer as m_optimizer

    def request(desc: Dict[str, Any], tp: int) -> Dict[str, Any]:
        model = build(desc, tp, 1, 1, seed=500 + tp)
        groups = default_groups(model)
        adam = torch.optim.Adam(groups, lr=1e-2)
        for p in model.parameters():
            adam.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.full_like(p, -7.0),
                "exp_avg_sq": torch.full_like(p, -7.0),
            }
        model_sd = model.sharded_state_dict()
        params = [p for g in adam.param_groups for p in g["params"]]
        id_map = m_optimizer.get_param_id_to_sharded_param_map(model_sd, params)
        optim_sd = adam.state_dict()
        m_optimizer.optim_state_to_sharding_state(optim_sd, id_map, exclude_keys="step")
        return {"model": model_sd, "optimizer": optim_sd}

    def tensors(loaded: Dict[str, Any]) -> Dict[str, Any]:
        flat = flatten(loaded)
        return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}

    for name, hows in SAVED.items():
        desc = {**BASE, **SCENARIOS[name][2]}
        base = os.path.join(workdir, name)
        for tp in (2, 1):
            ref = tensors(mdc.load(request(desc, tp), os.path.join(base, "mc")))
            for how in hows:
                ours = os.path.join(base, f"ours_{how}")
                got = tensors(mdc.load(request(desc, tp), ours))
                bad = sorted(k for k in ref if k not in got or not torch.equal(got[k], ref[k]))
                results[f"megatron loads our save of {name} {how} at tp{tp}"] = (
                    "ok"
                    if not bad and len(ref) > 20 and any("exp_avg_sq" in k for k in ref)
                    else f"{len(bad)} of {len(ref)} differ: {bad[:4]}"
                )


def worker(rank: int, world: int, port: int, workdir: str) -> None:
    import contextlib

    import torch
    import torch.distributed as dist

    # megatron-core calls these on CPU paths; in this test process only
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import tensor_parallel

    no_fork = type("NoFork", (), {"fork": lambda self, *a, **k: contextlib.nullcontext()})()
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: no_fork
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None  # 0.16.1 names it only when Transformer Engine imports
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    run_and_report(rank, workdir, "megatron saved")
    dist.barrier()
    dist.destroy_process_group()


def run_and_report(rank: int, workdir: str, saved: str) -> None:
    """Every step in order (megatron's save, our load and save, megatron's loads, its
    optimizer resuming), each check's outcome in `WORKDIR/result.<rank>.json`; `saved` names
    the check that megatron's save went through."""
    from megatron.core import parallel_state

    results: Dict[str, str] = {}
    try:
        megatron_save(rank, workdir)
        results[saved] = "ok"
        parallel_state.destroy_model_parallel()
        hf_checks(rank, workdir, results)
        megatron_loads(rank, workdir, results)
        from hf_optimizer_side import optimizer_checks

        optimizer_checks(rank, workdir, results)  # megatron's FP32Optimizer resumes our save
    except Exception as e:  # reported by the test
        import traceback

        results["side script"] = f"raised {type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    with open(os.path.join(workdir, f"result.{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    from _side_spawn import spawn_two

    spawn_two(worker, sys.argv[1])
