"""Quantized tensor subclasses as ShardedTensor data via `__tensor_flatten__`: torchao's
Float8Tensor and MXTensor and Transformer Engine's Float8Tensor, importing neither library.

Each inner tensor (data, scales) is stored under `<key>::<name>`, sharded like the outer
tensor divided by its block (local shape outer / b along an axis: blocks of b); a split
through a block is refused. Swizzled scales (a truthy ctx entry named like "swizzl") are
tiles, not positions: stored whole under `<key>::<name>[<slices>]`, only that piece loads
them. Loads fill the destination's inner tensors in place. Nothing lives under the plain
`<key>`, so a reader unaware of this layout fails instead of reading data without its
scales; loading into a plain tensor is opt-in (`dequantize_on_load`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from dataclasses import replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from ._flat import in_place_factory
from .dict_utils import dict_list_map_inplace
from .errors import CheckpointingException
from .mapping import ShardedTensor, ShardedTensorFactory

__all__ = [
    "SEP",
    "is_quantized",
    "dequantize_on_load",
    "dequantizing",
    "expand_quantized",
    "stored_form_hint",
    "block_hint",
]

logger = logging.getLogger(__name__)

#: between a quantized tensor's key and the name of one of its inner tensors
SEP = "::"

_dequantize: contextvars.ContextVar[bool] = contextvars.ContextVar("dequantize", default=False)


def is_quantized(t: Any) -> bool:
    """Whether `t` is a wrapper tensor subclass that flattens into inner tensors."""
    return isinstance(t, torch.Tensor) and hasattr(type(t), "__tensor_flatten__")


@contextlib.contextmanager
def dequantize_on_load(allow: bool = True) -> Iterator[None]:
    """Within the block (this thread), a plain destination of a key stored quantized is filled
    with data times scales (via temporary tensors) instead of raising."""
    token = _dequantize.set(allow)
    try:
        yield
    finally:
        _dequantize.reset(token)


def dequantizing() -> bool:
    """Whether `dequantize_on_load` is in effect."""
    return _dequantize.get()


def _blocks(key: str, name: str, outer: Sequence[int], inner: Sequence[int]) -> List[int]:
    if len(inner) != len(outer) or any(i == 0 or o % i for o, i in zip(outer, inner)):
        raise CheckpointingException(
            f"{key!r}: inner tensor {name!r} of shape {tuple(inner)} does not tile the "
            f"tensor's shape {tuple(outer)} in whole blocks"
        )
    return [o // i for o, i in zip(outer, inner)]


def _piece(sh: ShardedTensor, name: str, inner: Any, dtype: Any, blocks: List[int]) -> Any:
    """The ShardedTensor of one inner tensor of `sh`, covering blocks of `blocks`."""
    p = sh.prepend_axis_num
    offsets, ends = sh.global_offset[p:], sh.global_shape[p:]
    for axis, (o, n, b) in enumerate(zip(offsets, sh.local_shape, blocks)):
        if o % b or (n % b and o + n != ends[axis]):
            raise CheckpointingException(
                f"{sh.key!r}: the split at offset {o} (length {n}) of axis {axis} cuts "
                f"through a scaling block of {b} (inner tensor {name!r}, blocks "
                f"{tuple(blocks)}); split at multiples of the block size"
            )
    return replace(
        sh,
        key=f"{sh.key}{SEP}{name}",
        data=inner,
        dtype=dtype,
        local_shape=tuple(math.ceil(n / b) for n, b in zip(sh.local_shape, blocks)),
        global_shape=(*sh.global_shape[:p], *(math.ceil(g / b) for g, b in zip(ends, blocks))),
        global_offset=(*sh.global_offset[:p], *(o // b for o, b in zip(offsets, blocks))),
        axis_fragmentations=None,
    )


def _swizzled(ctx: Any) -> bool:
    """Whether flatten metadata `ctx` has a truthy "swizzl" entry (scales laid out in tiles)."""
    entries = ctx if isinstance(ctx, dict) else getattr(ctx, "__dict__", {})
    return any(
        "swizzl" in str(k).lower() and not isinstance(v, torch.Tensor) and bool(v)
        for k, v in entries.items()
    )


def _tiled_piece(sh: ShardedTensor, name: str, inner: torch.Tensor) -> ShardedTensor:
    """A swizzled inner tensor, stored whole under its piece's key (`w::scale[0:64,0:256]`):
    another split asks for a missing key instead of reading tiles as positions."""
    p = sh.prepend_axis_num
    where = ",".join(f"{o}:{o + n}" for o, n in zip(sh.global_offset[p:], sh.local_shape))
    return replace(
        sh,
        key=f"{sh.key}{SEP}{name}[{where}]",
        data=inner,
        dtype=inner.dtype,
        local_shape=tuple(inner.shape),
        global_shape=(*sh.global_shape[:p], *inner.shape),
        global_offset=(*sh.global_offset[:p], *(0,) * inner.dim()),
        axis_fragmentations=None,
    )


def _as_factory(sh: ShardedTensor) -> ShardedTensorFactory:
    """A factory saving `sh`'s inner tensors and loading into them in place."""
    outer = sh.data
    assert outer is not None
    names, ctx = outer.__tensor_flatten__()  # type: ignore[attr-defined]
    pieces: Dict[str, ShardedTensor] = {}
    for name in names:
        inner = getattr(outer, name)
        if is_quantized(inner):
            raise CheckpointingException(f"{sh.key!r}: nested tensor subclass {name!r}")
        if _swizzled(ctx) and tuple(inner.shape) != tuple(sh.local_shape):
            pieces[name] = _tiled_piece(sh, name, inner)
            continue
        if inner.dim() != len(sh.local_shape) and inner.numel() == 1:  # a per-tensor scale
            inner = inner.view((1,) * len(sh.local_shape))
        blocks = _blocks(sh.key, name, sh.local_shape, inner.shape)
        pieces[name] = _piece(sh, name, inner, inner.dtype, blocks)

    return in_place_factory(sh, outer, pieces)


def _dequantizing_factory(sh: ShardedTensor, stored: Dict[str, Any]) -> ShardedTensorFactory:
    """A factory loading a quantized key's stored pieces into a plain destination."""
    p = sh.prepend_axis_num
    found = {k[len(sh.key) + len(SEP) :]: md for k, md in stored.items()}
    if any("[" in n for n in found):
        raise CheckpointingException(
            f"{sh.key!r} is stored with swizzled scales ({', '.join(found)}): tiles cannot be "
            "dequantized without their library; load it into a quantized tensor of its type"
        )
    blocks = {
        n: _blocks(sh.key, n, sh.global_shape[p:], md.global_shape[p:]) for n, md in found.items()
    }
    data = [n for n, b in blocks.items() if set(b) == {1} and found[n].dtype.is_floating_point]
    if len(data) != 1 or not all(found[n].dtype.is_floating_point for n in found):
        raise CheckpointingException(
            f"{sh.key!r}: cannot dequantize inner tensors "
            f"{ {n: (str(md.dtype), tuple(blocks[n])) for n, md in found.items()} } as data "
            "times scales; load it into a quantized tensor of the type it was saved from"
        )
    pieces = {n: _piece(sh, n, None, found[n].dtype, blocks[n]) for n in found}

    def merge(loaded: Dict[str, torch.Tensor]) -> torch.Tensor:
        value = loaded[data[0]].to(torch.float32)
        for name in found.keys() - {data[0]}:
            scale = loaded[name].to(torch.float32)
            for axis, b in enumerate(blocks[name]):
                scale = scale.repeat_interleave(b, axis).narrow(axis, 0, value.shape[axis])
            value = value * scale
        out = sh.data if sh.data is not None else torch.empty(sh.local_shape, dtype=sh.dtype)
        return out.copy_(value)

    logger.info("dequantizing %r on load (%s)", sh.key, ", ".join(found))
    return ShardedTensorFactory(sh.key, sh.data, lambda *_: dict(pieces), merge, sh.replica_id)


def expand_quantized(tree: Any, stored: Optional[Dict[str, Any]] = None) -> Any:
    """Replaces in place every quantized ShardedTensor in `tree` by a factory of its inner
    tensors; with `stored` (metadata, when dequantizing), also plain ones stored quantized."""

    def convert(x: Any) -> Any:
        if not isinstance(x, ShardedTensor) or x.flattened_range is not None:
            return x
        if is_quantized(x.data):
            return _as_factory(x)
        if stored is not None and x.key not in stored:
            prefix = x.key + SEP
            pieces = {k: md for k, md in stored.items() if k.startswith(prefix)}
            return _dequantizing_factory(x, pieces) if pieces else x
        return x

    return dict_list_map_inplace(convert, tree) if isinstance(tree, (dict, list)) else tree


def stored_form_hint(key: str, stored_keys: Sequence[str]) -> str:
    """Why `key` is missing from `stored_keys` if quantized or swizzled on one side; else ''."""
    base, _, name = key.partition(SEP)
    if not name and any(k.startswith(key + SEP) for k in stored_keys):
        return (
            "; it is stored quantized (as its inner tensors): load it into a quantized tensor "
            "of the type it was saved from, or opt in to dequantizing with "
            "dist_checkpointing.quantized.dequantize_on_load()"
        )
    if name and base in stored_keys:
        return f"; {base!r} is stored unquantized and is never quantized on load"
    inner = name.partition("[")[0]
    tiled = sorted(k for k in stored_keys if k.startswith(f"{base}{SEP}{inner}["))
    if name and tiled:
        return (
            f"; {inner!r} of quantized {base!r} is stored swizzled (in tiles, not by position)"
            f" as {', '.join(map(repr, tiled[:4]))}{' ...' * bool(tiled[4:])}: only the piece "
            f"of {base!r} it was saved with loads it, into a swizzled destination"
        )
    if inner != name and f"{base}{SEP}{inner}" in stored_keys:
        return f"; {inner!r} of quantized {base!r} is stored by position (not swizzled)"
    return ""


def block_hint(
    key: str, stored: Sequence[int], requested: Sequence[int], metadata: Callable[[], Any]
) -> str:
    """Why inner tensor `key` is stored with another shape than `requested`: both sides'
    blocks, in elements of the largest positional inner tensor in `metadata()`; else ''."""
    base, _, name = key.partition(SEP)
    try:  # a hint never hides the error it explains
        entries = metadata().state_dict_metadata.items() if name else ()
    except Exception:
        entries = ()
    sizes = {  # the other inner tensors of base, by position (not swizzled)
        k: tuple(md.size)
        for k, md in entries
        if k.startswith(base + SEP) and "[" not in k and len(getattr(md, "size", ())) == len(stored)
    }
    data = max(sizes, key=lambda k: math.prod(sizes[k]), default=None)
    if data is None or sizes[data] == tuple(stored):
        return ""
    got, want = ([-(-f // max(n, 1)) for f, n in zip(sizes[data], s)] for s in (stored, requested))
    return (
        f" ({name!r} of quantized {base!r} has one value per scaling block: blocks of "
        f"{tuple(got)} in the checkpoint, {tuple(want)} in the destination, in elements of "
        f"{data!r}; a per-tensor or per-block scale loads only into blocks of its saved size)"
    )
