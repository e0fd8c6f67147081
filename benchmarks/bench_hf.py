"""`export_hf` against a plain read of the checkpoint plus a plain write of its bytes as
safetensors, in the same run, with each one's peak memory.

A Llama-shaped GPTModel checkpoint (fp32, megatron-core's layer-stacked keys, written by our
`save`) of about --size-mib is made once. Then, --repeats times, in turns:
- `plain`: `load_plain_tensors` (every tensor whole, all at once), then
  `safetensors.torch.save_file` of those tensors into one file, fsync'd;
- `export`: `export_hf` (QKV and fc1 split, streamed one layer at a time), fsync'd.
Each runs in a fresh process (its peak RSS is its own); the page cache is dropped before
each when this process may (root). The ratio is plain time / export time (>= 0.8 wanted);
the memory bound of export is max(2 GiB, 2x the largest tensor).

    python -m benchmarks.bench_hf --size-mib 1024 --repeats 3 --dir /tmp/bench_hf
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from benchmarks._common import drop_page_cache, fsync_tree, median, print_table

HIDDEN, HEADS, GROUPS, FFN, VOCAB = 1024, 16, 4, 4096, 32000
CONFIG = {"num_attention_heads": HEADS, "num_query_groups": GROUPS}


def make(path: str, size_mib: int) -> int:
    """Writes the checkpoint; returns the largest stored tensor's bytes."""
    import torch

    import dist_checkpointing as dc

    d = HIDDEN // HEADS
    per_layer = {
        "self_attention.linear_qkv.layer_norm_weight": (HIDDEN,),
        "self_attention.linear_qkv.weight": ((HEADS + 2 * GROUPS) * d, HIDDEN),
        "self_attention.linear_proj.weight": (HIDDEN, HIDDEN),
        "mlp.linear_fc1.layer_norm_weight": (HIDDEN,),
        "mlp.linear_fc1.weight": (2 * FFN, HIDDEN),
        "mlp.linear_fc2.weight": (HIDDEN, FFN),
    }
    layer_bytes = 4 * sum(torch.Size(s).numel() for s in per_layer.values())
    layers = max(1, (size_mib * 2**20 - 8 * VOCAB * HIDDEN) // layer_bytes)
    shapes = {f"decoder.layers.{k}": (layers, *s) for k, s in per_layer.items()}
    shapes["embedding.word_embeddings.weight"] = shapes["output_layer.weight"] = (VOCAB, HIDDEN)
    shapes["decoder.final_layernorm.weight"] = (HIDDEN,)
    sd = {k: dc.ShardedTensor.from_rank_offsets(k, torch.randn(s)) for k, s in shapes.items()}
    dc.save(sd, path)
    return max(t.data.nbytes for t in sd.values())


def _peak_rss() -> int:
    """This process' peak RSS (VmHWM: unlike ru_maxrss, not inherited from the parent)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def child(method: str, ckpt: str, out: str) -> None:
    """One timed run in this (fresh) process; prints seconds and peak RSS growth."""
    import torch  # noqa: F401  (imported before the baseline RSS is taken)

    import dist_checkpointing as dc
    from dist_checkpointing.tools import export_hf

    base = _peak_rss()
    start = time.perf_counter()
    if method == "plain":
        from safetensors.torch import save_file

        tensors = dc.load_plain_tensors(ckpt)
        os.makedirs(out)
        save_file(tensors, os.path.join(out, "model.safetensors"))
    else:
        export_hf(ckpt, out, config=CONFIG)
    fsync_tree(out)
    seconds = time.perf_counter() - start
    peak = _peak_rss() - base
    print(json.dumps({"seconds": seconds, "peak_bytes": peak}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/bench_hf")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    shutil.rmtree(args.dir, ignore_errors=True)
    ckpt, out = os.path.join(args.dir, "ckpt"), os.path.join(args.dir, "out")
    largest = make(ckpt, args.size_mib)
    size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
    runs: dict = {"plain": [], "export": []}
    for turn in range(args.repeats):
        for method in ("plain", "export") if turn % 2 == 0 else ("export", "plain"):
            shutil.rmtree(out, ignore_errors=True)
            cold = drop_page_cache()
            cmd = [sys.executable, "-m", "benchmarks.bench_hf", "--child", method, ckpt, out]
            text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[method].append({**json.loads(text.strip().splitlines()[-1]), "cold": cold})
    shutil.rmtree(args.dir, ignore_errors=True)
    rows = []
    for method, rs in runs.items():
        seconds = median([r["seconds"] for r in rs])
        rows.append(
            {
                "method": method,
                "seconds": seconds,
                "GB/s": size / seconds / 1e9,
                "peak RSS GiB": max(r["peak_bytes"] for r in rs) / 2**30,
                "cold cache": all(r["cold"] for r in rs),
            }
        )
    ratio = rows[0]["seconds"] / rows[1]["seconds"]
    bound = max(2 * 2**30, 2 * largest) / 2**30
    title = (
        f"export_hf of a {size / 2**30:.2f} GiB checkpoint, median of {args.repeats}: "
        f"export speed / plain speed = {ratio:.2f}; memory bound {bound:.2f} GiB"
    )
    print_table(title, rows, ["method", "seconds", "GB/s", "peak RSS GiB", "cold cache"])


if __name__ == "__main__":
    main()
