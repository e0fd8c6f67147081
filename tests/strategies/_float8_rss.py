"""Run as a script: `save CKPT N` writes N quantized weights (float8 data of 16 MiB, per-row
scales; tests/_quant.py's wrapper subclass); `load CKPT N` loads them into allocated
destinations and prints the peak RSS growth over the destinations in bytes (JSON), after a
one-weight warm-up load (imports, reader threads)."""

import json
import sys

import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from tests._quant import QTensor
from tests._rss import current, peak

ROWS, COLS = 4096, 4096


def _weights(n: int, fill: bool) -> dict:
    out = {}
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        bits = torch.randint(0, 120, (ROWS, COLS), dtype=torch.uint8, generator=g)
        qdata = (bits if fill else torch.zeros_like(bits)).view(torch.float8_e4m3fn)
        scale = torch.rand(ROWS, 1, generator=g) if fill else torch.zeros(ROWS, 1)
        out[f"w{i}"] = QTensor(qdata, scale, torch.bfloat16)
    return out


def _state(weights: dict) -> dict:
    return {k: ShardedTensor.from_rank_offsets(k, w) for k, w in weights.items()}


if __name__ == "__main__":
    mode, ckpt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "save":
        dc.save(_state(_weights(n, True)), ckpt)
    else:
        dests = _weights(n, False)
        dc.load(_state({"w0": dests["w0"]}), ckpt)
        base = max(current(), peak())
        loaded = dc.load(_state(dests), ckpt)
        growth = peak() - base  # before anything else is allocated
        same = all(loaded[k] is dests[k] for k in dests)
        want = _weights(n, True)
        bits = all(
            torch.equal(dests[k].qdata.view(torch.uint8), want[k].qdata.view(torch.uint8))
            and torch.equal(dests[k].scale, want[k].scale)
            for k in dests
        )
        print(json.dumps({"growth": growth, "in_place": same, "bit_for_bit": bits}))
