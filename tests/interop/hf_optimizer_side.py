"""megatron-core 0.16's own optimizer wrapper resumes from `hf_model.save` output; run by
`hf_model_side.py` in its world (2 gloo ranks, megatron-core and transformers).

1. A transformers Llama (whole model on each rank) takes one step of a torch AdamW with a
   single param group (the usual fine-tuning setup) and `hf_model.save` writes it (TP=2 in
   the description), its groups regrouped as megatron groups a GPTModel by default (no
   weight decay for 1-D parameters); two torch groups with different `lr` for parameters
   megatron would put in one group are refused with a CheckpointingException naming them.
2. megatron builds a GPTModel at TP=2, its param groups with its own `_get_param_groups`
   (default overrides) and a `FP32Optimizer` over a torch Adam of them; the wrapper's
   constructor allocates one CUDA scalar (its loss scale), so a subclass builds it on the
   CPU and changes nothing else. Its `sharded_state_dict(is_loading=True)` is loaded with
   megatron's `dist_checkpointing.load`, then `FP32Optimizer.load_state_dict` (which matches
   groups by `wd_mult`, `lr_mult`, `is_expert_parallel`, `is_decoupled_lr`) and the model's
   `load_state_dict`; the Adam moments of this rank's rows equal the HF optimizer's, every
   step is 1, and one more `FP32Optimizer.step()` runs.
"""

from __future__ import annotations

import os
from typing import Any, Dict


def hf_side(workdir: str) -> Dict[str, Any]:
    """The HF model's Adam moments of the embedding and first norm, after `hf_model.save`."""
    import torch
    import transformers
    from hf_model_side import hf_config

    from dist_checkpointing import hf_model
    from dist_checkpointing.errors import CheckpointingException

    torch.manual_seed(1)  # the same model on both ranks
    model = transformers.AutoModelForCausalLM.from_config(hf_config(2, vocab=128))
    adam = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    loss = sum((p * torch.linspace(-1, 1, p.numel()).view_as(p)).sum() for p in model.parameters())
    loss.backward()
    adam.step()
    hf_model.save(model, os.path.join(workdir, "ours"), adam, common_state={"iteration": 3}, tp=2)
    embed = model.model.embed_tokens.weight
    others = [p for p in model.parameters() if p is not embed]
    split = torch.optim.AdamW([{"params": [embed], "lr": 1e-3}, {"params": others}], lr=1e-2)
    split.state.update(adam.state)  # the same state, two lr in one megatron group
    try:
        hf_model.save(model, os.path.join(workdir, "split"), split, tp=2)
        refused = "saved without an error"
    except CheckpointingException as e:
        refused = "ok" if "'lr'" in str(e) and "embed_tokens" in str(e) else str(e)
    norm = model.model.norm.weight
    moments = {"embed": adam.state[embed]["exp_avg"], "norm": adam.state[norm]["exp_avg_sq"]}
    return {**moments, "refused": refused}


def megatron_side(rank: int, workdir: str, hf: Dict[str, Any], results: Dict[str, str]) -> None:
    import torch
    from mcore_hf_side import BASE, build
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.optimizer import (
        OptimizerConfig,
        _get_param_groups,
        get_standard_config_overrides,
    )
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    class CpuFP32Optimizer(FP32Optimizer):
        """FP32Optimizer with its loss scale on the CPU (its constructor puts it on CUDA)."""

        def __init__(self, optimizer: Any, config: Any, init_state_fn: Any) -> None:
            MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
            self._scale = torch.tensor([1.0])
            self.is_stub_optimizer = False

    def init_state(opt: Any, config: Any = None) -> None:  # as megatron's Adam setup does
        for group in opt.param_groups:
            for p in group["params"]:
                if not opt.state[p]:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p)

    model = build({**BASE, "num_layers": 2}, 2, 1, 1, seed=5)
    config = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=0.0)
    # the overrides megatron's optimizer setup applies by default (0.19 no longer does with None)
    groups = _get_param_groups([model], config, get_standard_config_overrides(config))
    results["megatron makes two groups by wd_mult"] = (
        "ok"
        if [g["wd_mult"] for g in groups] == [1.0, 0.0]
        else str([g["wd_mult"] for g in groups])
    )
    opt = CpuFP32Optimizer(torch.optim.Adam(groups, lr=1e-2), config, init_state)
    model_sd = model.sharded_state_dict()
    opt_sd = opt.sharded_state_dict(model_sd, is_loading=True)
    loaded = mdc.load({"model": model_sd, "optimizer": opt_sd}, os.path.join(workdir, "ours"))
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    state = opt.optimizer.state
    embed = model.embedding.word_embeddings.weight  # vocabulary-parallel: this rank's rows
    rows = slice(rank * 64, rank * 64 + 64)
    norm = model.decoder.final_layernorm.weight
    same = torch.equal(state[embed]["exp_avg"], hf["embed"][rows]) and torch.equal(
        state[norm]["exp_avg_sq"], hf["norm"]
    )
    steps = {float(s["step"]) for s in state.values()}
    results["FP32Optimizer.load_state_dict resumes our save"] = (
        "ok"
        if same and steps == {1.0} and len(state) == len(list(model.parameters()))
        else f"moments equal: {same}, steps {steps}"
    )
    for p in model.parameters():  # any gradient: the step is what is checked
        p.grad = torch.full_like(p, 0.5)
    ok, _, _ = opt.step()
    results["FP32Optimizer.step after the load"] = (
        "ok" if ok and {float(s["step"]) for s in state.values()} == {2.0} else "failed"
    )


def optimizer_checks(rank: int, workdir: str, results: Dict[str, str]) -> None:
    """Steps 1 and 2 (collective: both ranks), in `hf_model_side`'s world."""
    work = os.path.join(workdir, "optimizer")
    if rank == 0:
        os.makedirs(work, exist_ok=True)
    import torch.distributed as dist

    dist.barrier()
    hf = hf_side(work)
    results["save refuses two lr in one megatron group"] = hf.pop("refused")
    megatron_side(rank, work, hf, results)
