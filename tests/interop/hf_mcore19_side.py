"""megatron-core 0.19.2 and `hf_model`, both ways, in one world of 2 gloo ranks, reusing
`hf_model_side.py`'s TP=2 scenario.

Usage: python hf_mcore19_side.py WORKDIR [SITE]

SITE is a site-packages folder with transformers (0.19's interpreter has none): appended to
`sys.path`, so 0.19's own torch and megatron-core come first.

1. megatron-core 0.19: the TP=2 GPTModel takes one Adam step and saves model and optimizer
   state with 0.19's `save` (common state inside the `.distcp` files); its logits.
2. `hf_model.load` into an FSDP2 model gives those logits and Adam state; `hf_model.save`
   writes it back.
3. megatron-core 0.19 loads our save at TP=2 and TP=1 with its own model's sharded state
   dict; every tensor equals its load of its own checkpoint.
4. 0.19's FP32Optimizer resumes from an `hf_model.save` of a single-group AdamW
   (`hf_optimizer_side.py`).

Each rank writes `WORKDIR/result.<rank>.json`: `{check name: "ok" | failure}`.
"""

from __future__ import annotations

import sys

import hf_model_side as side

side.SCENARIOS = {"tp2": (2, 1, {"num_layers": 2, "vocab_size": 128})}  # as saved back
side.HOWS = ("fsdp2",)
side.SAVED = {"tp2": ("fsdp2",)}


def worker(rank: int, world: int, port: int, workdir: str) -> None:
    import contextlib

    import torch
    import torch.distributed as dist

    # megatron-core calls these on CPU paths; in this process only
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import tensor_parallel

    no_fork = type("NoFork", (), {"fork": lambda self, *a, **k: contextlib.nullcontext()})()
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: no_fork
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    side.run_and_report(rank, workdir, "0.19 saved")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from _side_spawn import spawn_two

    sys.path.extend(sys.argv[2:])  # after 0.19's own packages (spawned ranks inherit it)
    spawn_two(worker, sys.argv[1])
