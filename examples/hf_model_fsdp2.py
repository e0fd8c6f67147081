"""A megatron-core GPT checkpoint into an FSDP2 `transformers` model, one training step, and
back: `hf_model.load`, an AdamW step, `hf_model.save` (model and Adam state in megatron's
layout), and a check that loading the saved checkpoint gives the same model and optimizer.

The megatron checkpoint here is a random tiny Llama that `dist-ckpt import-hf --tp 2`
writes in megatron-core's GPTModel layout; for one that Megatron-LM wrote, build the
transformers model from its config (the `config.json` that `dist-ckpt export-hf` derives
from it) and call the same functions. Needs `transformers`.

    torchrun --standalone --nproc-per-node 2 examples/hf_model_fsdp2.py [DIR]

Running it again reuses DIR (default: a temporary directory): it removes its old
checkpoints first, because `save` never overwrites a complete checkpoint.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from _output import output_dir  # examples/_output.py
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dist_checkpointing import hf_model

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def sharded_model(config: Any) -> Any:
    """The model built on the meta device, sharded by FSDP2 over all ranks, then allocated
    (uninitialised: `hf_model.load` fills every parameter), its RoPE buffers rebuilt."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    # buffers that are in no checkpoint (RoPE's inv_freq) are left uninitialised by
    # `to_empty`: build them again
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model


def make_megatron_checkpoint(root: Path) -> Path:
    """Rank 0 writes a random tiny Llama as a megatron-core GPT checkpoint (TP=2 layout)
    with `dist-ckpt import-hf`, in a process of its own (a save in this one would be a
    collective of both ranks)."""
    ckpt = root / "megatron"
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(root / "hf")
        cli = [sys.executable, "-m", "dist_checkpointing", "import-hf"]
        subprocess.run([*cli, str(root / "hf"), str(ckpt), "--tp", "2"], check=True)
    dist.barrier()
    return ckpt


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = output_dir("hf_model") / "hf_model_fsdp2"
    config = transformers.LlamaConfig(**TINY)
    megatron = make_megatron_checkpoint(root)

    # 1. megatron -> FSDP2: each rank reads only its own rows
    model = sharded_model(config)
    # the optimizer before any forward: FSDP2 keeps the root's parameters unsharded (other
    # tensors) after a forward without backward
    adam = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hf_model.load(model, megatron)
    original = transformers.AutoModelForCausalLM.from_pretrained(root / "hf")  # to compare
    loaded = all(
        torch.equal(p.full_tensor(), q)  # full_tensor: a collective, same order on all ranks
        for p, q in zip(model.parameters(), original.parameters())
    )
    tokens = torch.arange(2 * 16).reshape(2, 16) % config.vocab_size
    with torch.no_grad():
        diff = float((model(tokens).logits - original(tokens).logits).abs().max())
    loaded = loaded and diff <= 1e-5
    verdict = "OK" if loaded else "DIFFERENT"
    print(f"rank {rank}: megatron checkpoint into the FSDP2 model, same logits: {verdict}")

    # 2. one training step
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    adam.step()
    print(f"rank {rank}: trained one step, loss {loss.item():.4f}")

    # 3. back to megatron's layout, optimizer included, and load it again to check
    saved = root / "after_step"
    hf_model.save(model, saved, adam, common_state={"iteration": 1}, tp=2)
    again = sharded_model(config)
    adam_again = torch.optim.AdamW(again.parameters(), lr=1e-3)
    hf_model.load(again, saved, adam_again)
    same = True
    for p, q in zip(model.parameters(), again.parameters()):
        s, t = adam.state[p], adam_again.state[q]
        same &= torch.equal(p.to_local(), q.to_local()) and float(s["step"]) == float(t["step"])
        for moment in ("exp_avg", "exp_avg_sq"):
            same &= torch.equal(s[moment].to_local(), t[moment].to_local())
    verdict = "OK" if same else "DIFFERENT"
    print(f"rank {rank}: saved to megatron's layout and loaded back: {verdict}")
    dist.destroy_process_group()
    if not (loaded and same):
        sys.exit(1)


if __name__ == "__main__":
    main()
