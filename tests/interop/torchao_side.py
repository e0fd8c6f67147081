"""torchao's quantized weights through our package, on 2 gloo ranks (tests/interop/test_torchao.py).

Usage: python torchao_side.py WORKDIR RESULT_JSON

Run with an interpreter that has torchao (`DIST_CKPT_TORCHAO_PYTHON`) and this repository on
PYTHONPATH. Models quantized with `Float8WeightOnlyConfig` (torchao's Float8Tensor, per-row
float32 scales) and `MXDynamicActivationMXWeightConfig` (MXTensor, 1x32 float8_e8m0fnu
scales) are saved row-split and loaded: same split, into the full tensor, through the
manager's replicated local tier after one node's files are lost, and with the replica of
the lost node's part damaged (nvidia-resiliency-ext#349: never loaded, the persistent tier
is used). Every check records True when type, `qdata` and `scale` match bit for bit.

An MX weight with `is_swizzled_scales=True` (scales in cuBLAS tiles, not by position) is saved
row-split with torch_dist and the fully parallel wrappers: it loads bit for bit into the same
split, and into the full tensor or a column split it is refused with an error naming the key
and the swizzled layout (a check records the message when that does not hold).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path


def _models():
    """A Float8WeightOnlyConfig weight and an MX weight (torchao's MXTensor.to_mx: the MX
    config swizzles its scales into tiles, a layout that is not positional; see
    docs/quantized.md)."""
    import torch
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    out = {}
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 64, bias=False).to(torch.bfloat16)
    quantize_(model, Float8WeightOnlyConfig())
    out["f8"] = model.weight
    out["mx"] = MXTensor.to_mx(torch.randn(64, 256, dtype=torch.bfloat16), torch.float8_e4m3fn, 32)
    return out


def _same(a, b) -> bool:
    import torch

    def bits(t):
        return t.contiguous().view(torch.uint8)

    return type(a) is type(b) and all(
        torch.equal(bits(getattr(a, n)), bits(getattr(b, n))) for n in ("qdata", "scale")
    )


def _rows(w, rank: int, world: int):
    """Rank's rows of `w`, as torchao quantizes a row-split weight (per-row scales slice)."""
    names, ctx = w.__tensor_flatten__()
    n = w.shape[0] // world
    inner = {k: getattr(w, k)[rank * n : (rank + 1) * n].clone() for k in names}
    return type(w).__tensor_unflatten__(inner, ctx, (n, *w.shape[1:]), None)


def _zeros(w):
    import torch

    names, ctx = w.__tensor_flatten__()
    inner = {k: torch.zeros_like(getattr(w, k)) for k in names}
    return type(w).__tensor_unflatten__(inner, ctx, w.shape, None)


def _swizzled(rank: int, world: int, workdir: str) -> dict:
    """Swizzled MX scales: the same split loads bit for bit, other splits are refused."""
    import torch
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    import dist_checkpointing as dc
    from dist_checkpointing import ShardedTensor
    from dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )
    from dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
    )

    g = torch.Generator().manual_seed(1)
    hp = torch.randn(256, 256, generator=g) * torch.exp2(
        torch.randint(-8, 9, (256, 256), generator=g)
    )

    def mx(rows: slice, cols: slice):
        part = hp[rows, cols].to(torch.bfloat16).contiguous()
        return MXTensor.to_mx(part, torch.float8_e4m3fn, 32, is_swizzled_scales=True)

    def load(ckpt, strategy, want, *offsets):
        rid = 0 if offsets else rank
        sh = ShardedTensor.from_rank_offsets("w", _zeros(want), *offsets, replica_id=rid)
        try:
            return _same(dc.load({"w": sh}, ckpt, strategy)["w"], want)
        except dc.CheckpointingException as e:
            return str(e)

    def refused(got):  # True for the refusal, else what happened
        if isinstance(got, str):
            return "'scale' of quantized 'w' is stored swizzled" in got or got
        return "loaded, " + ("bit for bit" if got else "with other values")

    n, every = 256 // world, slice(None)
    mine = slice(rank * n, (rank + 1) * n)
    ok = {}
    fp_save = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1))
    fp_load = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy())
    for name, save, strategy in (("torch_dist", None, None), ("fully_parallel", fp_save, fp_load)):
        ckpt = os.path.join(workdir, f"swizzled_{name}")
        w = mx(mine, every)
        dc.save({"w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world))}, ckpt, save)
        ok[f"mxsw_{name}_same_split"] = load(ckpt, strategy, w, (0, rank, world))
        full = load(ckpt, strategy, mx(every, every))
        ok[f"mxsw_{name}_full_tensor_refused"] = refused(full)
        cols = load(ckpt, strategy, mx(every, mine), (1, rank, world))
        ok[f"mxsw_{name}_columns_refused"] = refused(cols)
    return ok


def worker(rank: int, world: int, port: int, workdir: str, result: str) -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    import dist_checkpointing as dc
    from dist_checkpointing import CheckpointManager, CheckpointManagerOptions, ShardedTensor
    from dist_checkpointing.local.replication.strategies import CliqueReplicationStrategy

    full = _models()
    mine = {k: _rows(w, rank, world) for k, w in full.items()}

    def state(src, split: bool = True):
        return {
            k: ShardedTensor.from_rank_offsets(
                k, v, *([(0, rank, world)] if split else []), replica_id=0 if split else rank
            )
            for k, v in src.items()
        }

    ok = {}
    ckpt = os.path.join(workdir, "ckpt")
    dc.save(state(mine), ckpt)
    out = dc.load(state({k: _zeros(v) for k, v in mine.items()}), ckpt)
    ok.update({f"{k}_same_split": _same(out[k], mine[k]) for k in mine})
    out = dc.load(state({k: _zeros(v) for k, v in full.items()}, split=False), ckpt)
    ok.update({f"{k}_full_tensor": _same(out[k], full[k]) for k in full})

    repl = CliqueReplicationStrategy.from_replication_params(
        replication_jump=1, replication_factor=2
    )
    for case in ("node_lost", "replica_damaged"):
        root, local = Path(workdir, case, "p"), Path(workdir, case, "l")
        opts = CheckpointManagerOptions(
            save_interval=2, local_root=str(local), local_save_interval=1, replication=repl
        )
        manager = CheckpointManager(root, opts)
        for step in (2, 3):  # persistent 2, local (replicated) 3
            manager.save(step, {**state(mine), "step": step})
        manager.close()
        dist.barrier()
        if rank == 1:  # node 1's disk is gone: its own part and the replica it held
            for p in (local / "dist_ckpt" / "1").iterdir():
                p.unlink()
        if case == "replica_damaged" and rank == 0:  # node 0's copy of rank 1's part
            part = local / "dist_ckpt" / "0" / "iter_0000003_1_local.pt"
            raw = bytearray(part.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            part.write_bytes(bytes(raw))
        dist.barrier()
        manager = CheckpointManager(root, opts)
        loaded, step = manager.load(state({k: _zeros(v) for k, v in mine.items()}))
        tier = manager.last_restore.tier
        manager.close()
        want = (3, "local") if case == "node_lost" else (2, "persistent")
        ok[f"{case}_tier"] = (step, tier) == want
        ok.update({f"{k}_{case}": _same(loaded[k], mine[k]) for k in mine})

    ok.update(_swizzled(rank, world, workdir))
    with open(f"{result}.{rank}", "w") as f:
        json.dump(ok, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from _side_spawn import spawn_two

    workdir, result = sys.argv[1:3]
    spawn_two(worker, workdir, result, result=result)
