"""`hf_model.load` of a megatron GPTModel checkpoint into an FSDP2 transformers model on 2
ranks, against the offline path (`export_hf`, then `from_pretrained` on every rank, then
`fully_shard`), in the same run: time and peak RSS growth per rank.

A Llama-shaped checkpoint of about --size-mib (fp32, megatron-core's layer-stacked keys)
is made once, saved by 2 ranks with megatron-core's TP=2 sharding (`_make_tp2`): one chunk
per layer and rank, fused QKV rows and fc2 / proj columns split in two, fc1's gate and up
halves each split in two (megatron's SwiGLU layout), the vocabulary split by rows, norms
written by rank 0. Each method then runs once in a fresh 2-rank gloo
world (its peak RSS is its own), the page cache dropped before each when this process may
(root). `online`: the model is built on the meta device, sharded by `fully_shard`,
materialized (`to_empty`) and filled by `hf_model.load`. `offline`: rank 0 exports, both
ranks `from_pretrained` the whole model, then `fully_shard`. Peak growth is counted from
before the model exists, so it includes the rank's own shard. Needs transformers:

    PYTHONPATH=. python -m benchmarks.bench_hf_model --size-mib 1024 --dir /tmp/bench_hf_model
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from typing import Any, Dict

from benchmarks._common import drop_page_cache, free_port, print_table
from benchmarks.bench_hf import CONFIG, FFN, GROUPS, HEADS, HIDDEN, VOCAB

WORLD = 2


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _tp2_shards(rank: int, size_mib: int) -> Dict[str, Any]:
    """This TP rank's `ShardedTensor`s of the checkpoint, as megatron-core's GPTModel at
    TP=2 saves them (each layer its own chunk, under the layer-stacked key)."""
    import torch

    import dist_checkpointing as dc

    d, tp = HIDDEN // HEADS, WORLD
    # (shape of one layer, the axis TP splits (None: replicated), SwiGLU's two halves)
    per_layer = {
        "self_attention.linear_qkv.layer_norm_weight": ((HIDDEN,), None),
        "self_attention.linear_qkv.weight": (((HEADS + 2 * GROUPS) * d, HIDDEN), 0),
        "self_attention.linear_proj.weight": ((HIDDEN, HIDDEN), 1),
        "mlp.linear_fc1.layer_norm_weight": ((HIDDEN,), None),
        "mlp.linear_fc1.weight": ((2 * FFN, HIDDEN), "swiglu"),
        "mlp.linear_fc2.weight": ((HIDDEN, FFN), 1),
    }
    layer_bytes = 4 * sum(math.prod(shape) for shape, _ in per_layer.values())
    layers = max(1, (size_mib * 2**20 - 8 * VOCAB * HIDDEN) // layer_bytes)
    gen = torch.Generator().manual_seed(rank)
    sd: Dict[str, Any] = {}
    for name, (shape, axis) in per_layer.items():
        key = f"decoder.layers.{name}"
        for layer in range(layers):
            at = (0, layer, layers)  # the prepended layer axis
            if axis is None:
                data = torch.randn(shape, generator=gen)
                sd[f"{key} {layer}"] = dc.ShardedTensor.from_rank_offsets(
                    key, data, at, replica_id=rank, prepend_axis_num=1
                )
            elif axis == "swiglu":  # gate rows, then up rows, each split across TP
                half = (shape[0] // (2 * tp), shape[1])
                for part in (0, 1):
                    data = torch.randn(half, generator=gen)
                    rows = (1, part * tp + rank, 2 * tp)
                    sd[f"{key} {layer} {part}"] = dc.ShardedTensor.from_rank_offsets(
                        key, data, at, rows, prepend_axis_num=1
                    )
            else:
                local = list(shape)
                local[int(axis)] //= tp
                data = torch.randn(local, generator=gen)
                sd[f"{key} {layer}"] = dc.ShardedTensor.from_rank_offsets(
                    key, data, at, (1 + int(axis), rank, tp), prepend_axis_num=1
                )
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        data = torch.randn(VOCAB // tp, HIDDEN, generator=gen)  # vocabulary-parallel
        sd[key] = dc.ShardedTensor.from_rank_offsets(key, data, (0, rank, tp))
    key = "decoder.final_layernorm.weight"
    sd[key] = dc.ShardedTensor.from_rank_offsets(key, torch.randn(HIDDEN), replica_id=rank)
    return sd


def _make_tp2(rank: int, port: int, ckpt: str, size_mib: int) -> None:
    """Spawned rank `rank` of 2: saves its TP=2 shards into `ckpt`."""
    import torch.distributed as dist

    import dist_checkpointing as dc

    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    dc.save(_tp2_shards(rank, size_mib), ckpt)
    dist.destroy_process_group()


def _worker(rank: int, port: int, method: str, ckpt: str, out: str, layers: int) -> None:
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dist_checkpointing import hf_model
    from dist_checkpointing.tools import export_hf

    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=GROUPS,
        head_dim=HIDDEN // HEADS,
        tie_word_embeddings=False,
    )

    def shard(model: Any) -> None:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

    # transformers imports its model classes lazily (seconds, tens of MiB of code): both
    # methods would pay that inside the timed part, so it happens before it
    llama, auto = transformers.LlamaForCausalLM, transformers.AutoModelForCausalLM
    base = _peak_rss()
    dist.barrier()
    start = time.perf_counter()
    if method == "online":
        with torch.device("meta"):
            model = llama(config)
        shard(model)
        model.to_empty(device="cpu")
        hf_model.load(model, ckpt)
    else:
        if rank == 0:
            export_hf(ckpt, out, config=CONFIG)
        dist.barrier()
        model = auto.from_pretrained(out, dtype=torch.float32)
        shard(model)
    dist.barrier()
    seconds = time.perf_counter() - start
    with open(f"{out}.{method}.{rank}.json", "w") as f:
        json.dump({"seconds": seconds, "peak_bytes": _peak_rss() - base}, f)
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    import dist_checkpointing as dc

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--dir", default="/tmp/bench_hf_model")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    ckpt, out = os.path.join(args.dir, "ckpt"), os.path.join(args.dir, "hf")
    os.makedirs(ckpt)
    mp.spawn(_make_tp2, (free_port(), ckpt, args.size_mib), nprocs=WORLD)
    size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
    stored = dc.load_tensors_metadata(ckpt)
    layers = stored["decoder.layers.mlp.linear_fc1.weight"].global_shape[0]
    stacked = [t for k, t in stored.items() if k.startswith("decoder.layers.")]
    layer_bytes = sum(4 * math.prod(t.global_shape[1:]) for t in stacked)  # fp32
    rows = []
    for method in ("online", "offline"):
        cold = drop_page_cache()
        mp.spawn(_worker, (free_port(), method, ckpt, out, layers), nprocs=WORLD)
        for rank in range(WORLD):
            with open(f"{out}.{method}.{rank}.json") as f:
                r = json.load(f)
            rows.append(
                {
                    "method": method,
                    "rank": rank,
                    "seconds": r["seconds"],
                    "peak RSS growth GiB": r["peak_bytes"] / 2**30,
                    "shard + 1 layer GiB": (size / WORLD + layer_bytes) / 2**30,
                    "cold cache": cold,
                }
            )
    shutil.rmtree(args.dir, ignore_errors=True)
    online = max(r["seconds"] for r in rows if r["method"] == "online")
    offline = max(r["seconds"] for r in rows if r["method"] == "offline")
    title = (
        f"{size / 2**30:.2f} GiB megatron checkpoint into an FSDP2 transformers model on "
        f"{WORLD} ranks, one run: offline / online time = {offline / online:.2f}"
    )
    columns = ["method", "rank", "seconds", "peak RSS growth GiB", "shard + 1 layer GiB"]
    print_table(title, rows, columns + ["cold cache"])


if __name__ == "__main__":
    main()
