"""Peak memory of loading torchao float8 weights into quantized destinations (no scratch copy).

Run with a python that has torchao, this repository on PYTHONPATH:
    PYTHONPATH=$PWD .venv-torchao/bin/python -m benchmarks.bench_quantized --total-mib 1024

One process saves `--total-mib` of Float8Tensor weights (float8_e4m3fn `qdata`, per-row
float32 `scale`, built with `__tensor_unflatten__` so no high-precision copy exists). A
fresh process allocates the destinations (zeros, touched), loads one weight (imports and
the reader's threads), notes its peak RSS (`ru_maxrss`, which only grows), loads all, and
notes the peak again: the growth is what the load needed beyond the destinations. The bound
checked (exit status 1 when exceeded): the destinations plus one read chunk, the reader's
request size (`reader.READ_REQUEST`): stored bytes are read in place into the destinations'
inner tensors, a request at a time. A bfloat16 scratch copy of the weights would add 2x.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import tempfile
import time
from typing import Any, Dict

ROWS, COLS = 4096, 4096  # 16 MiB of float8 per weight


def _weights(n: int, fill: bool) -> Dict[str, Any]:
    import torch
    from torchao.quantization import Float8Tensor

    ctx = Float8Tensor.from_hp(torch.ones(2, COLS)).__tensor_flatten__()[1]  # per row
    ctx["block_size"] = [1, COLS]
    out = {}
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        qdata = (
            torch.randint(0, 120, (ROWS, COLS), dtype=torch.uint8, generator=g)
            if fill
            else torch.zeros(ROWS, COLS, dtype=torch.uint8)
        ).view(torch.float8_e4m3fn)
        scale = torch.rand(ROWS, 1, generator=g) if fill else torch.zeros(ROWS, 1)
        inner = {"qdata": qdata, "scale": scale}
        out[f"w{i}"] = Float8Tensor.__tensor_unflatten__(inner, ctx, (ROWS, COLS), None)
    return out


def _state(weights: Dict[str, Any]) -> Dict[str, Any]:
    from dist_checkpointing import ShardedTensor

    return {k: ShardedTensor.from_rank_offsets(k, w) for k, w in weights.items()}


def _save(ckpt: str, n: int) -> None:
    import dist_checkpointing as dc

    dc.save(_state(_weights(n, True)), ckpt)


def _load(ckpt: str, n: int, out: Any) -> None:
    import dist_checkpointing as dc

    def peak() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    dests = _weights(n, False)
    # a first load of one weight pays the imports and the reader's thread pool, not data
    dc.load(_state({"w0": dests["w0"]}), ckpt)
    before = peak()
    start = time.perf_counter()
    loaded = dc.load(_state(dests), ckpt)
    seconds = time.perf_counter() - start
    same = all(loaded[k] is dests[k] for k in dests)
    out.put((before, peak(), seconds, same))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    args = parser.parse_args()
    n = max(1, args.total_mib // 16)
    from dist_checkpointing.strategies.torch_dist.reader import READ_REQUEST

    spawn = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        proc = spawn.Process(target=_save, args=(f"{tmp}/ckpt", n))
        proc.start()
        proc.join()
        queue = spawn.Queue()
        proc = spawn.Process(target=_load, args=(f"{tmp}/ckpt", n, queue))
        proc.start()
        before, after, seconds, same = queue.get()
        proc.join()
    mib = 1 << 20
    weights = n * ROWS * (COLS + 4)
    bound = before + READ_REQUEST
    print(f"| float8 weights | {weights / mib:.0f} MiB ({n} x {ROWS}x{COLS} + per-row scales) |")
    print(f"| peak RSS with destinations allocated | {before / mib:.0f} MiB |")
    print(f"| peak RSS after the load | {after / mib:.0f} MiB |")
    print(f"| growth during the load | {(after - before) / mib:.1f} MiB |")
    print(
        f"| bound: destinations + one read chunk (READ_REQUEST) | {before / mib:.0f} + "
        f"{READ_REQUEST / mib:.0f} = {bound / mib:.0f} MiB: {'met' if after <= bound else 'EXCEEDED'} |"
    )
    print(f"| a bfloat16 scratch copy would add | {2 * n * ROWS * COLS / mib:.0f} MiB |")
    print(f"| load time | {seconds:.2f} s; results are the destinations: {same} |")
    if after > bound or not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
