"""Megatron-core 0.16's GPTModel beside `dist-ckpt export-hf` / `import-hf` (2 gloo ranks).

Usage: python mcore_hf_side.py WORKDIR

Run with an interpreter that has megatron-core installed (this repository on PYTHONPATH).
1. For each scenario in `SCENARIOS` a Llama/Mixtral-style GPTModel (local layer spec, fp32,
   RMSNorm, SwiGLU, RoPE, grouped-query attention) is built at its split, saved with
   megatron's own `dist_checkpointing.save` to `WORKDIR/<name>/mc`, and run on a fixed input:
   `WORKDIR/<name>/logits.pt` and the model's description `WORKDIR/<name>/megatron.json`
   (TransformerConfig fields plus GPTModel's arguments) are written for the export test.
2. For each `WORKDIR/<name>/mc` of `IMPORTED` (written by `dist-ckpt import-hf ... --tp 2`),
   a GPTModel at TP=2 described by the `megatron_config` object stored with it loads it
   with megatron's own `dist_checkpointing.load` and runs the same input; its logits must
   match `WORKDIR/<name>/logits.pt` (transformers' own) within 1e-4. Our `load` reads it too.

Each rank writes `WORKDIR/result.<rank>.json`: `{check name: "ok" | failure}`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, Dict

#: name -> (tp, pp, ep, description); `description` is what megatron.json records
SCENARIOS: Dict[str, Any] = {
    "dense_tied_tp2": (2, 1, 1, {"num_layers": 2, "share_embeddings_and_output_weights": True}),
    "dense_untied_pp2": (1, 2, 1, {"num_layers": 4, "share_embeddings_and_output_weights": False}),
    "moe_tp2": (2, 1, 1, {"num_layers": 2, "num_moe_experts": 4, "moe_router_topk": 2}),
    "moe_ep2": (1, 1, 2, {"num_layers": 2, "num_moe_experts": 4, "moe_router_topk": 2}),
}
BASE = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "ffn_hidden_size": 128,
    "normalization": "RMSNorm",
    "layernorm_epsilon": 1e-5,
    "gated_linear_unit": True,
    "activation_func": "silu",
    "add_bias_linear": False,
    "position_embedding_type": "rope",
    "rotary_base": 50000,
    "vocab_size": 128,
    "max_sequence_length": 64,
    "share_embeddings_and_output_weights": False,
}
#: checkpoints written by import-hf (at TP=2), loaded in step 2
IMPORTED = ("imported", "imported_tied_moe")
GPT_ARGS = (
    "rotary_percent",
    "vocab_size",
    "max_sequence_length",
    "position_embedding_type",
    "rotary_base",
    "share_embeddings_and_output_weights",
)


def tokens() -> Any:
    """The fixed input: 2 sequences of 12 token ids."""
    import torch

    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))


def build(desc: Dict[str, Any], tp: int, pp: int, ep: int, seed: int) -> Any:
    """A GPTModel for `desc` at this split (this rank's stage), in eval mode."""
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
    )
    torch.manual_seed(seed)
    split = (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "expert_model_parallel_size",
    )
    fields = {k: v for k, v in desc.items() if k not in GPT_ARGS + split}
    fields["activation_func"] = F.silu
    experts = desc.get("num_moe_experts")
    config = TransformerConfig(
        **fields,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",
        init_method_std=0.05,
        pipeline_dtype=torch.float32,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(num_experts=experts, normalization="RMSNorm"),
        vocab_size=desc["vocab_size"],
        max_sequence_length=desc["max_sequence_length"],
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=False,
        share_embeddings_and_output_weights=desc["share_embeddings_and_output_weights"],
        position_embedding_type="rope",
        rotary_base=desc["rotary_base"],
    )
    with torch.no_grad():  # norms start at 1: make them matter
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape))
    return model.eval()


def forward(model: Any, pp: int) -> Any:
    """Logits of the fixed input on the last stage (stages hand activations on by send/recv)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ids = tokens()
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    mask = torch.triu(torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool), 1)
    with torch.no_grad():
        if pp > 1 and not ps.is_pipeline_first_stage():
            hidden = torch.empty(ids.shape[1], ids.shape[0], model.config.hidden_size)
            dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(ids, pos, mask)
        if pp > 1 and not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), ps.get_pipeline_model_parallel_next_rank())
            return None
    return out


def worker(rank: int, world: int, port: int, workdir: str) -> None:
    import torch
    import torch.distributed as dist

    # megatron-core calls these on CPU paths; in this test process only
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import tensor_parallel

    # attention forks the CUDA RNG (for dropout, off here): a no-op fork on CPU
    no_fork = type("NoFork", (), {"fork": lambda self, *a, **k: contextlib.nullcontext()})()
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: no_fork
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None  # 0.16.1 names it only when Transformer Engine imports
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    from megatron.core import dist_checkpointing as mdc

    import dist_checkpointing as ours

    results: Dict[str, str] = {}
    for name, (tp, pp, ep, extra) in SCENARIOS.items():
        desc = {**BASE, **extra}
        base = os.path.join(workdir, name)
        mc = os.path.join(base, "mc")
        if rank == 0:
            os.makedirs(mc, exist_ok=True)
            with open(os.path.join(base, "megatron.json"), "w") as f:
                json.dump(desc, f, indent=1)
        dist.barrier()
        model = build(desc, tp, pp, ep, seed=11)
        mdc.save(model.sharded_state_dict(), mc)
        logits = forward(model, pp)
        if logits is not None and rank == world - 1:
            torch.save(logits, os.path.join(base, "logits.pt"))
        dist.barrier()
        results[f"{name}: saved"] = "ok"

    for name in IMPORTED:
        mc = os.path.join(workdir, name, "mc")
        if not os.path.isdir(mc):
            continue
        # the description import-hf stored, read with our load
        ask = {"c": ours.ShardedObject("megatron_config", None, (1,), (0,), replica_id=rank)}
        desc = ours.load(ask, mc)["c"]
        model = build(desc, 2, 1, 1, seed=99)  # other values than the checkpoint's
        model.load_state_dict(mdc.load(model.sharded_state_dict(), mc))
        logits = forward(model, 1)
        want = torch.load(os.path.join(workdir, name, "logits.pt"))
        diff = float((logits - want).abs().max())
        results[f"{name}: megatron loads it at tp2, logits match transformers'"] = (
            "ok" if diff <= 1e-4 else f"max abs difference {diff}"
        )
        sd = ours.load(model.sharded_state_dict(), mc)
        mine = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        bad = [k for k, v in mine.items() if not torch.equal(sd.get(k, torch.empty(0)), v)]
        results[f"{name}: our load at tp2 equals megatron's"] = "ok" if not bad else f"{bad}"
    with open(os.path.join(workdir, f"result.{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from _side_spawn import spawn_two

    spawn_two(worker, sys.argv[1])
