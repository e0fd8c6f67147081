"""Run as a script: `save CKPT` writes `w`, 4 layers of 2048 x 1024 fp32 (8 MiB, two 4 MiB
checksum blocks per layer), and a small `s`; `load CKPT` loads `s` whole (warm-up: imports,
reader threads, checksum files), then one row of `w` in the middle of a block, and prints
the peak RSS growth of that load in bytes (JSON) and whether the row came back exact."""

import json
import sys

import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from tests._rss import current, peak

SHAPE = (4, 2048, 1024)


def _load(ckpt: str, key: str, shape: tuple, offsets: tuple, lengths: tuple) -> torch.Tensor:
    dest = torch.zeros(lengths)
    req = {"r": ShardedTensor(key, dest, torch.float32, lengths, shape, offsets, None)}
    strategy = TorchDistLoadShardedStrategy(verify_checksums=True)
    return dc.load(req, ckpt, strategy, validate_access_integrity=False)["r"]


if __name__ == "__main__":
    mode, ckpt = sys.argv[1], sys.argv[2]
    w = torch.arange(4 * 2048 * 1024, dtype=torch.float32).reshape(SHAPE)
    if mode == "save":
        s = torch.ones(1024)
        state = {k: ShardedTensor.from_rank_offsets(k, t) for k, t in (("w", w), ("s", s))}
        dc.save(state, ckpt)
    else:
        _load(ckpt, "s", (1024,), (0,), (1024,))
        base = max(current(), peak())
        # row 512 of layer 2: 2 MiB into checksum block 4, 2 + 2 MiB of which are outside it
        row = _load(ckpt, "w", SHAPE, (2, 512, 0), (1, 1, 1024))
        growth = peak() - base
        print(json.dumps({"growth": growth, "exact": torch.equal(row[0, 0], w[2, 512])}))
