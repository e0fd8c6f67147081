"""Where each row of a `transformers` Llama / Mixtral parameter lives in a megatron-core
GPTModel checkpoint: pure functions (no I/O, no process group) for `hf_model`.

A stored megatron tensor is global whatever split saved it. A homogeneous decoder stacks its
layers (and experts) on leading axes of one key; `index_stored` finds, for every
(megatron name, layer, expert), the stored key and its offsets on those axes. `source`
maps an HF parameter name to the stored tensor(s) it comes from, and `row_pieces` maps a
range of the parameter's rows (axis 0, the axis FSDP2 shards) to contiguous row ranges of
the stored tensor: fused QKV rows are per query group (its query heads, then one key and one
value head), fc1 is `[gate; up]`. Stored rows past the HF rows (megatron's padded
vocabulary) are never read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .errors import CheckpointingException
from .mapping import ShardedTensor
from .tools import hf_map

__all__ = [
    "Stored",
    "Source",
    "Heads",
    "index_stored",
    "source",
    "row_pieces",
    "expected_shape",
    "local_rows",
    "resharded",
    "requests",
    "by_layer",
    "split",
    "fuse",
]

_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
#: transformers 4 names of one expert's weights, and transformers 5's stacked expert tensors
_HF_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123]\.weight)")
_HF_STACKED_EXPERTS = {"mlp.experts.gate_up_proj": "linear_fc1.weight"}
_HF_STACKED_EXPERTS["mlp.experts.down_proj"] = "linear_fc2.weight"
#: HF name in a layer -> (megatron names that may hold it, part of the fused tensor)
_FROM_HF: Dict[str, Tuple[List[str], int]] = {}
for _meg, _hfs in hf_map.LAYER.items():
    for _part, _hf in enumerate(_hfs):
        _FROM_HF.setdefault(_hf, ([], _part))[0].append(_meg)
_FROM_HF["mlp.gate.weight"] = (["mlp.router.weight"], 0)  # transformers 5's Mixtral router
_FROM_EXPERT = {
    hf: (meg, part) for meg, hfs in hf_map.EXPERT.items() for part, hf in enumerate(hfs)
}


@dataclass(frozen=True)
class Stored:
    """One layer's (expert's) tensor inside a stored megatron key.

    Attributes:
        key: the stored key (with any `optimizer.state.<name>.` prefix).
        lead: offsets on the key's stacked (layer, expert) axes.
        global_shape: the stored key's whole shape (stacked axes included).
    """

    key: str
    lead: Tuple[int, ...]
    global_shape: Tuple[int, ...]

    @property
    def shape(self) -> Tuple[int, ...]:
        """The shape of this layer's (expert's) tensor."""
        return self.global_shape[len(self.lead) :]


@dataclass(frozen=True)
class Heads:
    """What the fused QKV layout depends on (HF config names)."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


@dataclass(frozen=True)
class Source:
    """Where an HF parameter comes from.

    Attributes:
        name: the megatron name (`GLOBAL` key, `LAYER` name or `experts.<EXPERT name>`).
        part: which of the fused tensor's HF parts (q/k/v, gate/up) the parameter is.
        stored: the stored tensor; for transformers 5's stacked expert tensors one per expert.
        stacked: whether the parameter's axis 0 runs over `stored` (experts).
    """

    name: str
    part: int
    stored: Tuple[Stored, ...]
    stacked: bool = False


Index = Dict[Tuple[str, int, int], Stored]


def index_stored(shapes: Mapping[str, Sequence[int]], prefix: str = "") -> Index:
    """`{(megatron name, layer, expert): Stored}` for the stored keys under `prefix`
    (layer/expert -1 where the name has none; experts' names are `experts.<name>`)."""
    out: Index = {}
    for full, shape in shapes.items():
        if full.startswith(prefix):
            shape = tuple(int(s) for s in shape)
            for name, layer, expert, lead in hf_map.stored_layers(full[len(prefix) :], shape) or []:
                out[(name, layer, expert)] = Stored(full, lead, shape)
    return out


def _find(index: Index, names: Sequence[str], layer: int, expert: int) -> Optional[Stored]:
    for name in names:
        if (name, layer, expert) in index:
            return index[(name, layer, expert)]
    return None


def source(hf_name: str, index: Index, num_experts: int = 0) -> Tuple[Optional[Source], str]:
    """The source of HF parameter `hf_name`, or None and why (unmapped name, or the
    checkpoint lacks it). `lm_head.weight` falls back to the (tied) embedding."""
    glob = {v: k for k, v in hf_map.GLOBAL.items()}
    if hf_name in glob:
        names = [glob[hf_name]]
        if hf_name == "lm_head.weight":  # megatron does not store a tied output layer
            names.append("embedding.word_embeddings.weight")
        st = _find(index, names, -1, -1)
        return (Source(names[0], 0, (st,)), "") if st else (None, f"no stored {names[0]!r}")
    m = _HF_LAYER.fullmatch(hf_name)
    if m is None:
        return None, "no megatron-core GPTModel name"
    layer, rest = int(m[1]), m[2]
    e = _HF_EXPERT.fullmatch(rest)
    if e is not None:
        meg, part = _FROM_EXPERT[e[2]]
        st = _find(index, [f"experts.{meg}"], layer, int(e[1]))
        if st is None:
            return None, f"no stored expert {e[1]} {meg}"
        return Source(meg, part, (st,)), ""
    if rest in _HF_STACKED_EXPERTS:
        meg = _HF_STACKED_EXPERTS[rest]
        found = [_find(index, [f"experts.{meg}"], layer, x) for x in range(num_experts)]
        if not found or any(f is None for f in found):
            return None, f"no stored experts' {meg} for layer {layer}"
        return Source(meg, 0, tuple(f for f in found if f is not None), stacked=True), ""
    if rest not in _FROM_HF:
        return None, "no megatron-core GPTModel name"
    names, part = _FROM_HF[rest]
    st = _find(index, names, layer, -1)
    return (Source(names[0], part, (st,)), "") if st else (None, f"no stored {names[0]!r}")


def expected_shape(src: Source, heads: Heads) -> Tuple[Tuple[int, ...], bool]:
    """The HF shape `src` gives, and whether axis 0 may be shorter (padded vocabulary)."""
    shape = src.stored[0].shape
    if src.stacked:
        return (len(src.stored), *shape), False
    if src.name.endswith("linear_qkv.weight"):
        n = heads.num_attention_heads if src.part == 0 else heads.num_key_value_heads
        return (n * heads.head_dim, *shape[1:]), False
    if src.name.endswith("linear_fc1.weight"):
        return (shape[0] // 2, *shape[1:]), False
    return shape, src.name in hf_map.GLOBAL and len(shape) == 2


def row_pieces(src: Source, heads: Heads, start: int, stop: int) -> List[Tuple[int, int, int]]:
    """Rows `[start, stop)` of the HF parameter as `(stored row, HF row, count)` ranges of
    `src.stored[0]` (not for stacked experts, whose rows are whole experts)."""
    if src.name.endswith("linear_qkv.weight"):
        d = heads.head_dim
        per = heads.num_attention_heads // heads.num_key_value_heads
        width = per * d if src.part == 0 else d  # this part's rows in one group
        first = (0, per * d, (per + 1) * d)[src.part]  # where they start in the group
        out = []
        for g in range(start // width, (stop + width - 1) // width if stop > start else 0):
            a, b = max(start, g * width), min(stop, (g + 1) * width)
            out.append((g * (per + 2) * d + first + a - g * width, a, b - a))
        return out
    if src.name.endswith("linear_fc1.weight") and not src.stacked and src.part == 1:
        half = src.stored[0].shape[0] // 2
        return [(half + start, start, stop - start)] if stop > start else []
    return [(start, start, stop - start)] if stop > start else []


def split(name: str, t: torch.Tensor, heads: int, groups: int) -> List[torch.Tensor]:
    """megatron's fused `t` (one layer, one expert) -> its HF tensors (q, k, v; gate, up;
    else `t` itself), by `row_pieces`: the one place that knows the fused layouts."""
    n = 3 if name.endswith("linear_qkv.weight") else 2 if name.endswith("linear_fc1.weight") else 1
    if n == 1:
        return [t]
    layout = Heads(heads, groups, t.shape[0] // (heads + 2 * groups))
    out = []
    for part in range(n):
        src = Source(name, part, (Stored("", (), tuple(t.shape)),))
        rows = expected_shape(src, layout)[0][0]
        pieces = [t.narrow(0, s, c) for s, _, c in row_pieces(src, layout, 0, rows)]
        out.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
    return out


def fuse(name: str, parts: Sequence[torch.Tensor], heads: int, groups: int) -> torch.Tensor:
    """The inverse of `split`: HF tensors -> megatron's fused tensor."""
    if len(parts) == 1:
        return parts[0]
    total = sum(p.shape[0] for p in parts)
    layout = Heads(heads, groups, total // (heads + 2 * groups))
    out = parts[0].new_empty((total, *parts[0].shape[1:]))
    for part, p in enumerate(parts):
        src = Source(name, part, (Stored("", (), tuple(out.shape)),))
        for s, h, c in row_pieces(src, layout, 0, p.shape[0]):
            out[s : s + c] = p[h : h + c]
    return out


def check_heads(heads: Heads) -> None:
    """Raises unless the query heads divide into the key/value groups."""
    h, g = heads.num_attention_heads, heads.num_key_value_heads
    if g <= 0 or h % g or heads.head_dim <= 0:
        raise CheckpointingException(
            f"num_attention_heads={h} is not a multiple of num_key_value_heads={g} "
            f"(head_dim={heads.head_dim})"
        )


def local_rows(name: str, t: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """This rank's rows of parameter (or state) `t` and the global index of the first."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(t, DTensor):
        return t.detach(), 0
    shards = [p for p in t.placements if isinstance(p, Shard)]
    others = [p for p in t.placements if not isinstance(p, (Shard, Replicate))]
    if others or len(shards) > 1 or any(p.dim != 0 for p in shards):
        raise CheckpointingException(
            f"parameter {name!r}: placements {t.placements} are not supported "
            "(Shard(0) on one mesh dimension, Replicate on others, as fully_shard makes)"
        )
    local = t.to_local().detach()
    if local.dim() == 0 or local.shape[0] == 0:
        return local, 0
    chunks = t.__create_chunk_list__()  # the public description DCP plans with
    if len(chunks) != 1 or any(chunks[0].offsets[1:]) or tuple(chunks[0].sizes) != local.shape:
        raise CheckpointingException(f"parameter {name!r}: unexpected local chunks {chunks}")
    return local, int(chunks[0].offsets[0])


def resharded(model: torch.nn.Module) -> None:
    """Puts FSDP2's sharded parameters back in place (a forward without backward leaves the
    root's unsharded), so `named_parameters` gives the DTensors the optimizer holds."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def requests(
    prefix: str,
    name: str,
    src: Source,
    heads: Heads,
    t: torch.Tensor,
    replica_id: Any = 0,
) -> Dict[str, ShardedTensor]:
    """One request per stored row range of this rank's rows of `t` (views of its data)."""
    local, row0 = local_rows(name, t)
    out: Dict[str, ShardedTensor] = {}
    if local.dim() == 0 or local.shape[0] == 0:
        return out
    n = local.shape[0]
    if src.stacked:  # axis 0 runs over experts, each a whole stored tensor
        parts = [(src.stored[row0 + j], 0, j, 1) for j in range(n)]
        squeeze = True
    else:
        st = src.stored[0]
        parts = [(st, s, h - row0, c) for s, h, c in row_pieces(src, heads, row0, row0 + n)]
        squeeze = False
    for i, (st, srow, lrow, count) in enumerate(parts):
        st = st if prefix == "" else Stored(prefix + st.key, st.lead, st.global_shape)
        data = local[lrow] if squeeze else local.narrow(0, lrow, count)
        rest = (0,) * (data.dim() - 1)
        offset = (*st.lead, srow, *rest) if data.dim() else st.lead
        out[f"{prefix}{name}/{i}"] = ShardedTensor(
            st.key,
            data,
            data.dtype,
            tuple(data.shape),
            st.global_shape,
            offset,
            None,
            replica_id,
            prepend_axis_num=len(st.lead),
        )
    return out


def by_layer(
    requests: Dict[str, ShardedTensor], shapes: Dict[str, Any]
) -> List[Dict[str, ShardedTensor]]:
    """The requests in one batch per layer of the layer-stacked keys (then the rest).

    What a load stages (the stored-dtype copy of a request converted to a narrower dtype,
    the scratch of reads that share a checksum block) is bounded by its batch: one layer
    per batch bounds it to one layer; the count of batches comes from the stored shapes,
    the same on every rank.
    """

    def layer_axis(key: str) -> bool:  # whether axis 0 of stored `key` is the layer
        rest = re.sub(r"^optimizer\.state\.[^.]+\.", "", key)
        m = hf_map.LAYER_KEY.fullmatch(rest)
        return m is not None and m[1] is None

    layers = max((s[0] for k, (s, _) in shapes.items() if layer_axis(k) and s), default=0)
    batches: List[Dict[str, ShardedTensor]] = [{} for _ in range(layers + 1)]
    for name, sh in requests.items():
        stacked = sh.prepend_axis_num > 0 and layer_axis(sh.key)
        batches[sh.global_offset[0] if stacked else layers][name] = sh
    return batches
