"""A minimal quantized wrapper subclass (the `__tensor_flatten__` protocol that torchao's and
Transformer Engine's Float8Tensor follow) and rank functions for the quantized tests.

`quantize(kind, ...)` quantizes one deterministic global tensor with per-row, per-tensor,
1x32 MX-like (float8_e8m0fnu scales) or blockwise scales, then `piece` takes a rank's piece:
the piece's inner tensors are slices of the global ones, as a sharded quantized weight holds.
`swizzle` lays a tensor's scales out in tiles (flatten metadata `is_swizzled_scales=True`, as
torchao's MX tensors for cuBLAS), keeping their shape: only the piece it was made for can
read its scales back, which shapes alone do not show.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)

SHAPE = (8, 64)
#: scaling block of each kind (rows, columns); "tensor": one scale for the whole tensor
BLOCKS = {"row": (1, 64), "tensor": SHAPE, "mx": (1, 32), "block": (4, 32)}


class QTensor(torch.Tensor):
    """Quantized data and a scale; holds nothing else and computes nothing."""

    @staticmethod
    def __new__(
        cls, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, swizzled: bool = False
    ) -> Any:
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=dtype)

    def __init__(
        self, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, swizzled: bool = False
    ) -> None:
        self.qdata, self.scale, self.swizzled = qdata, scale, swizzled

    def __tensor_flatten__(self) -> Tuple[List[str], Dict[str, Any]]:
        return ["qdata", "scale"], {"dtype": self.dtype, "is_swizzled_scales": self.swizzled}

    @classmethod
    def __tensor_unflatten__(cls, inner: Dict[str, Any], ctx: Dict[str, Any], *_: Any) -> Any:
        return cls(inner["qdata"], inner["scale"], ctx["dtype"], ctx["is_swizzled_scales"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"QTensor does not compute ({func})")


def quantize(kind: str, dtype: torch.dtype) -> QTensor:
    """The global tensor of `kind`, quantized to `dtype` (deterministic)."""
    g = torch.Generator().manual_seed(7)
    # magnitudes spread over 2^-8..2^8, so that blocks get distinct scales (MX: powers of two)
    hp = torch.randn(SHAPE, generator=g) * torch.exp2(torch.randint(-8, 9, SHAPE, generator=g))
    br, bc = BLOCKS[kind]
    amax = hp.reshape(SHAPE[0] // br, br, SHAPE[1] // bc, bc).abs().amax((1, 3))
    scale = amax / torch.finfo(dtype).max
    if kind == "mx":  # powers of two, stored as float8_e8m0fnu
        scale = torch.exp2(torch.ceil(torch.log2(scale))).to(torch.float8_e8m0fnu)
    full = scale.float().repeat_interleave(br, 0).repeat_interleave(bc, 1)
    return QTensor((hp / full).to(dtype), scale, torch.bfloat16)


def piece(q: QTensor, kind: str, axis: int, rank: int, world: int) -> QTensor:
    """Rank `rank`'s piece of `q` split along `axis` in `world` (its scales' blocks with it;
    a split through a block keeps the block's scale on both sides)."""
    n = SHAPE[axis] // world
    b = BLOCKS[kind][axis]
    lo, hi = rank * n // b, ((rank + 1) * n - 1) // b + 1
    return QTensor(
        q.qdata.narrow(axis, rank * n, n).clone(),
        q.scale[lo:hi] if axis == 0 else q.scale[:, lo:hi],
        torch.bfloat16,
    )


def swizzle(p: QTensor) -> QTensor:
    """`p` with its scales in tiles of 4 rows, each tile stored column by column (same shape)."""
    rows, cols = p.scale.shape
    tiles = p.scale.view(torch.uint8).reshape(rows // 4, 4, cols).transpose(1, 2)
    scale = tiles.reshape(rows, cols).view(p.scale.dtype)
    return QTensor(p.qdata, scale, torch.bfloat16, swizzled=True)


def empty_like_piece(p: QTensor) -> QTensor:
    """A destination of `p`'s type and shapes, filled with zeros."""
    zeros = torch.zeros_like
    return QTensor(zeros(p.qdata), zeros(p.scale), torch.bfloat16, p.swizzled)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same(a: QTensor, b: QTensor) -> bool:
    """Same type, data and scales bit for bit."""
    return type(a) is type(b) and all(
        torch.equal(bits(getattr(a, n)), bits(getattr(b, n))) for n in ("qdata", "scale")
    )


def strategies(backend: str) -> Tuple[Any, Any]:
    """The (save, load) strategies of `backend` as `dc.save` / `dc.load` take them."""
    if backend == "fully_parallel":
        return (
            FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1)),
            FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()),
        )
    return (("local", 2), None) if backend == "local" else (None, None)


def save_and_load(
    kind: str, dtype: torch.dtype, backend: str, save_axis: int, load_axis: Optional[int], root: str
) -> str:
    """Saves `kind` split along `save_axis` with `backend` ('torch_dist', 'async',
    'fully_parallel', 'local'), loads it split along `load_axis` (None: the full tensor on
    every rank); returns 'same' (bit for bit), 'differs', or the error's message."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q = quantize(kind, dtype)
    ckpt = os.path.join(root, f"node{rank}" if backend == "local" else "", "ckpt")
    save_strategy, load_strategy = strategies(backend)

    def state(p: QTensor, axis: Optional[int], dest: bool) -> Dict[str, Any]:
        offsets = () if axis is None else ((axis, rank, world),)
        data = empty_like_piece(p) if dest else p
        rid = rank if axis is None else 0  # every rank holds the full tensor: replicas
        return {"w": ShardedTensor.from_rank_offsets("w", data, *offsets, replica_id=rid)}

    mine = piece(q, kind, save_axis, rank, world)
    try:
        if backend == "async":
            queue = AsyncCallsQueue()
            queue.schedule_async_request(
                dc.save(state(mine, save_axis, False), ckpt, async_sharded_save=True)
            )
            queue.maybe_finalize_async_calls(blocking=True)
            queue.close()
        else:
            dc.save(state(mine, save_axis, False), ckpt, save_strategy)
        want = q if load_axis is None else piece(q, kind, load_axis, rank, world)
        out = dc.load(state(want, load_axis, True), ckpt, load_strategy)["w"]
    except dc.CheckpointingException as e:
        return str(e)
    return "same" if same(out, want) else "differs"


def run_cases(cases: List[Tuple[Any, ...]], root: str) -> List[str]:
    """`save_and_load(*case, root/<i>)` for each case, in order."""
    return [save_and_load(*c, os.path.join(root, str(i))) for i, c in enumerate(cases)]
