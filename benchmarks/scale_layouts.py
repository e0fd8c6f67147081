"""Parallel layouts for `bench_scale`: each simulated rank's shard metadata, generated on demand.

Pure Python (no torch), so that the megatron-core side script can import it in its own venv.
A layout is a function of the world size; `layout.rank_records(rank)` returns that rank's
records `(key, dtype, global_shape, global_offset, local_shape, is_main_replica)`, every
shape and offset over the full global rank (the layer and expert axes megatron prepends are
ordinary leading axes here, with local extent 1). Nothing is kept per rank: 16,384 ranks x
~300 records are never all alive unless a caller keeps them.

Layouts (`--layout`), named by their parallelism at full scale (16,384 ranks):

- `tp8-pp16-dp128`: a GPT-3-175B-like model (hidden 12,288, FFN 49,152, vocabulary 51,200,
  6 layers per pipeline stage; megatron's GPT layer keys, one entry per layer with the
  layer as a leading axis). Column-parallel weights (QKV, FC1, embeddings, output layer)
  split on dim 0 over TP, row-parallel weights (proj, FC2) on dim 1; layernorms and
  row-parallel biases replicated over TP (main on TP rank 0). Model parameters (bf16) and
  Adam state (fp32 master `fp32_param`, `exp_avg`, `exp_avg_sq`), all sharded like the
  parameter and replicated over the 128 data-parallel ranks (main on DP rank 0):
  288 records on a middle stage, 296 on the first, 300 on the last.
- `moe-tp4-pp8-ep8-dp512`: a Mixtral/DeepSeek-like MoE (hidden 4,096, expert FFN 14,336,
  4 layers per stage, 8 local experts per rank, so 8 x EP experts). Dense weights as above
  (TP 4); experts split over the EP group (EP ranks are consecutive DP ranks) and over TP,
  replicated over the expert-data-parallel ranks (DP / EP, main where that index is 0);
  the router is replicated over TP and DP. 336-344 records per rank.

Smaller worlds (`--ranks N`) keep TP and shrink DP first, then PP, and keep the per-rank
work constant (layers per stage and local experts per rank are fixed; the model's depth and
expert count follow PP and EP):

| N | tp8-pp16-dp128 | moe-tp4-pp8-ep8-dp512 |
|---|---|---|
| 64 | tp8 pp8 dp1 (48 layers) | tp4 pp8 dp2 ep2 (16 experts) |
| 256 | tp8 pp16 dp2 | tp4 pp8 dp8 ep8 |
| 1,024 | tp8 pp16 dp8 | tp4 pp8 dp32 ep8 |
| 4,096 | tp8 pp16 dp32 | tp4 pp8 dp128 ep8 |
| 16,384 | tp8 pp16 dp128 | tp4 pp8 dp512 ep8 |

`resharded(layout)` is the same model at half the TP: the load benchmarks plan a rank's
reads for both.

Rank order is megatron's default (TP fastest, then DP, then PP):
`rank = tp + TP * (dp + DP * pp)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, NamedTuple, Tuple

__all__ = ["LAYOUTS", "Layout", "Record", "make_layout", "resharded"]


class Record(NamedTuple):
    """One shard entry of one rank (a plain tuple to whoever does not know the names)."""

    key: str
    dtype: str
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    local_shape: Tuple[int, ...]
    is_main_replica: bool


# Adam state next to each parameter: (key prefix, dtype).
_STATES = (
    ("model.", "bfloat16"),
    ("optimizer.state.fp32_param.", "float32"),
    ("optimizer.state.exp_avg.", "float32"),
    ("optimizer.state.exp_avg_sq.", "float32"),
)

# How a parameter is split over TP: on dim 0 (column parallel), dim 1 (row parallel),
# or not at all (replicated over TP, main on TP rank 0).
COL, ROW, REP = 0, 1, None


@dataclass(frozen=True)
class _Param:
    name: str
    shape: Tuple[int, ...]  # the whole parameter (one layer, one expert)
    split: object  # COL, ROW or REP
    expert: bool = False


@dataclass(frozen=True)
class Layout:
    """A parallel layout at one world size (see the module docstring)."""

    family: str
    world: int
    tp: int
    pp: int
    dp: int
    ep: int
    layers_per_stage: int
    layer_params: Tuple[_Param, ...]
    first_params: Tuple[_Param, ...]  # first pipeline stage only (embeddings)
    last_params: Tuple[_Param, ...]  # last pipeline stage only (final norm, output layer)
    local_experts: int = 0

    @property
    def parallelism(self) -> str:
        ep = f"-ep{self.ep}" if self.local_experts else ""
        return f"tp{self.tp}-pp{self.pp}{ep}-dp{self.dp}"

    @property
    def num_layers(self) -> int:
        return self.layers_per_stage * self.pp

    @property
    def num_experts(self) -> int:
        return self.local_experts * self.ep

    def coords(self, rank: int) -> Tuple[int, int, int]:
        """(tp, dp, pp) ranks of `rank`."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside a world of {self.world}")
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def rank_records(self, rank: int) -> List[Record]:
        """Every shard entry of `rank`, model parameters then Adam state."""
        return list(self.iter_records(rank))

    def iter_records(self, rank: int) -> Iterator[Record]:
        tp_rank, dp_rank, pp_rank = self.coords(rank)
        ep_rank, edp_rank = dp_rank % self.ep, dp_rank // self.ep
        entries: List[Tuple[_Param, Tuple[int, ...]]] = []  # (param, leading offsets)
        if pp_rank == 0:
            entries += [(p, ()) for p in self.first_params]
        for i in range(self.layers_per_stage):
            layer = pp_rank * self.layers_per_stage + i
            for p in self.layer_params:
                if p.expert:
                    first = ep_rank * self.local_experts
                    entries += [(p, (layer, first + e)) for e in range(self.local_experts)]
                else:
                    entries.append((p, (layer,)))
        if pp_rank == self.pp - 1:
            entries += [(p, ()) for p in self.last_params]
        for prefix, dtype in _STATES:
            for p, lead in entries:
                yield self._record(prefix, dtype, p, lead, tp_rank, dp_rank, edp_rank)

    def _record(
        self,
        prefix: str,
        dtype: str,
        p: _Param,
        lead: Tuple[int, ...],
        tp_rank: int,
        dp_rank: int,
        edp_rank: int,
    ) -> Record:
        if p.split is REP:
            local, offset, tp_main = p.shape, (0,) * len(p.shape), tp_rank == 0
        else:
            axis = int(p.split)  # type: ignore[call-overload]
            piece = p.shape[axis] // self.tp
            local = p.shape[:axis] + (piece,) + p.shape[axis + 1 :]
            offset = tuple(tp_rank * piece if d == axis else 0 for d in range(len(p.shape)))
            tp_main = True
        if p.expert:
            global_shape = (self.num_layers, self.num_experts) + p.shape
            dp_main = edp_rank == 0
        elif lead:
            global_shape = (self.num_layers,) + p.shape
            dp_main = dp_rank == 0
        else:
            global_shape = p.shape
            dp_main = dp_rank == 0
        ones = (1,) * len(lead)
        return Record(
            prefix + p.name,
            dtype,
            global_shape,
            lead + offset,
            ones + local,
            tp_main and dp_main,
        )


def _split_world(world: int, tp: int, pp_max: int) -> Tuple[int, int]:
    """(pp, dp): DP shrinks first, then PP (a power of two dividing world / tp)."""
    if world < tp or world % tp:
        raise ValueError(f"--ranks {world}: must be a multiple of TP={tp}")
    rest = world // tp
    pp = pp_max
    while pp > 1 and rest % pp:
        pp //= 2
    pp = min(pp, rest)
    while rest % pp:
        pp -= 1
    return pp, rest // pp


def _gpt(world: int) -> Layout:
    h, ffn, vocab, seq, tp = 12288, 49152, 51200, 2048, 8
    pp, dp = _split_world(world, tp, 16)
    layer = (
        _Param("decoder.layers.input_layernorm.weight", (h,), REP),
        _Param("decoder.layers.input_layernorm.bias", (h,), REP),
        _Param("decoder.layers.self_attention.linear_qkv.weight", (3 * h, h), COL),
        _Param("decoder.layers.self_attention.linear_qkv.bias", (3 * h,), COL),
        _Param("decoder.layers.self_attention.linear_proj.weight", (h, h), ROW),
        _Param("decoder.layers.self_attention.linear_proj.bias", (h,), REP),
        _Param("decoder.layers.pre_mlp_layernorm.weight", (h,), REP),
        _Param("decoder.layers.pre_mlp_layernorm.bias", (h,), REP),
        _Param("decoder.layers.mlp.linear_fc1.weight", (ffn, h), COL),
        _Param("decoder.layers.mlp.linear_fc1.bias", (ffn,), COL),
        _Param("decoder.layers.mlp.linear_fc2.weight", (h, ffn), ROW),
        _Param("decoder.layers.mlp.linear_fc2.bias", (h,), REP),
    )
    first = (
        _Param("embedding.word_embeddings.weight", (vocab, h), COL),
        _Param("embedding.position_embeddings.weight", (seq, h), REP),
    )
    last = (
        _Param("decoder.final_layernorm.weight", (h,), REP),
        _Param("decoder.final_layernorm.bias", (h,), REP),
        _Param("output_layer.weight", (vocab, h), COL),
    )
    return Layout("tp8-pp16-dp128", world, tp, pp, dp, 1, 6, layer, first, last)


def _moe(world: int) -> Layout:
    h, ffn, vocab, tp, local_experts = 4096, 14336, 32768, 4, 8
    pp, dp = _split_world(world, tp, 8)
    ep = 1
    while ep < 8 and dp % (ep * 2) == 0:
        ep *= 2
    layer = (
        _Param("decoder.layers.input_layernorm.weight", (h,), REP),
        _Param("decoder.layers.self_attention.linear_qkv.weight", (3 * h, h), COL),
        _Param("decoder.layers.self_attention.linear_proj.weight", (h, h), ROW),
        _Param("decoder.layers.pre_mlp_layernorm.weight", (h,), REP),
        _Param("decoder.layers.mlp.router.weight", (local_experts * ep, h), REP),
        _Param("decoder.layers.mlp.experts.linear_fc1.weight", (2 * ffn, h), COL, True),
        _Param("decoder.layers.mlp.experts.linear_fc2.weight", (h, ffn), ROW, True),
    )
    first = (_Param("embedding.word_embeddings.weight", (vocab, h), COL),)
    last = (
        _Param("decoder.final_layernorm.weight", (h,), REP),
        _Param("output_layer.weight", (vocab, h), COL),
    )
    return Layout(
        "moe-tp4-pp8-ep8-dp512", world, tp, pp, dp, ep, 4, layer, first, last, local_experts
    )


LAYOUTS: Dict[str, Callable[[int], Layout]] = {
    "tp8-pp16-dp128": _gpt,
    "moe-tp4-pp8-ep8-dp512": _moe,
}


def resharded(layout: Layout) -> Layout:
    """The same model with half the TP ranks (every TP-split shard twice as large, so a load
    reads parts of two saved shards): a job resumed at a different layout."""
    if layout.tp < 2:
        raise ValueError(f"{layout.parallelism}: TP {layout.tp} cannot be halved")
    return dataclasses.replace(layout, tp=layout.tp // 2, world=layout.world // 2)


def make_layout(name: str, world: int) -> Layout:
    """The layout `name` (a key of `LAYOUTS`) at `world` ranks."""
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; choose from {sorted(LAYOUTS)}")
    return LAYOUTS[name](world)
