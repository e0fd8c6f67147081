"""A megatron-core GPTModel `torch_dist` checkpoint straight into a live `transformers`
Llama / Mistral / Mixtral-style causal LM, plain or sharded by FSDP2 (`fully_shard`).

Trade-off taken: every rank asks only for the rows of its own parameter shards. For each
parameter (and Adam moment) the rows this rank holds are mapped to contiguous row ranges of
the stored megatron tensors (`_hf_layout`), one `ShardedTensor` request per range whose data
is a view of the local tensor, and one `dist_checkpointing.load` per layer fills them in
place: no full tensor, no intermediate files, memory at the rank's shard plus one layer.
The price is many small requests for fused QKV tensors (one per query group a shard
touches) and one load call per layer; the reader reads only those rows' bytes (whole
4 MiB checksum blocks where it verifies). Everything that can be wrong with the model or the
checkpoint is found before any tensor byte is read, and raised on every rank.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from . import _dist, _hf_layout, serialization
from .errors import CheckpointingException
from .mapping import ShardedObject, ShardedTensor
from .tools import hf_map

__all__ = ["load", "save"]

logger = logging.getLogger(__name__)

#: the description `dist-ckpt import-hf` stores (megatron's field names)
DESCRIPTION_KEY = "megatron_config"
#: Adam moments in megatron's model-space optimizer state: `optimizer.state.<name>.<key>`
_MOMENTS = ("exp_avg", "exp_avg_sq")
#: fields that decide the fused layout or the forward, HF name -> megatron name
_COMPARED = {
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_query_groups",
    "head_dim": "kv_channels",
    "rms_norm_eps": "layernorm_epsilon",
    "rope_theta": "rotary_base",
    "num_experts_per_tok": "moe_router_topk",
}
#: the config field behind each axis of an HF parameter (by name suffix)
_FIELDS = {
    "q_proj.weight": ("num_attention_heads", "hidden_size"),
    "k_proj.weight": ("num_key_value_heads", "hidden_size"),
    "v_proj.weight": ("num_key_value_heads", "hidden_size"),
    "o_proj.weight": ("hidden_size", "num_attention_heads"),
    "gate_proj.weight": ("intermediate_size", "hidden_size"),
    "up_proj.weight": ("intermediate_size", "hidden_size"),
    "down_proj.weight": ("hidden_size", "intermediate_size"),
    "embed_tokens.weight": ("vocab_size", "hidden_size"),
    "lm_head.weight": ("vocab_size", "hidden_size"),
    "gate.weight": ("num_local_experts", "hidden_size"),
    "gate_up_proj": ("num_local_experts", "intermediate_size", "hidden_size"),
    "down_proj": ("num_local_experts", "hidden_size", "intermediate_size"),
    "norm.weight": ("hidden_size",),
    "layernorm.weight": ("hidden_size",),
}


def _config(model: Any) -> Dict[str, Any]:
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        raise CheckpointingException(
            f"{type(model).__name__} has no transformers config: hf_model.load needs a "
            "transformers causal LM"
        )
    out = dict(cfg.to_dict())
    rope = out.get("rope_parameters") or {}
    out.setdefault("rope_theta", rope.get("rope_theta"))
    if out.get("rope_theta") is None:
        out["rope_theta"] = rope.get("rope_theta", 10000.0)
    out["head_dim"] = out.get("head_dim") or out["hidden_size"] // out["num_attention_heads"]
    out["num_key_value_heads"] = out.get("num_key_value_heads") or out["num_attention_heads"]
    return out


def _check_architecture(cfg: Dict[str, Any]) -> None:
    """Raises unless the model is Llama / Mistral (no sliding window) / Mixtral-like."""
    kind = cfg.get("model_type")
    if kind not in ("llama", "mistral", "mixtral"):
        raise CheckpointingException(
            f"model_type={kind!r} is not supported by hf_model (llama, mistral, mixtral)"
        )
    as_export = {**cfg, "model_type": "mixtral" if kind == "mixtral" else "llama"}
    hf_map.megatron_description(as_export, 1, 1, 1)  # raises naming what makes it another model


def _read_checkpoint(ckpt: Path) -> Tuple[Dict[str, Any], Dict[str, Any], bool]:
    """Stored tensors' `(shape, dtype)`, the common state, and whether a description is stored."""
    tensors = serialization.load_tensors_metadata(ckpt)
    shapes = {k: (tuple(v.global_shape), v.dtype) for k, v in tensors.items()}
    # Megatron-LM stores its arguments as an argparse.Namespace: a plain attribute bag
    with torch.serialization.safe_globals([argparse.Namespace]):
        common = serialization.load_common_state_dict(ckpt)
    keys = serialization.load_sharded_metadata(ckpt).keys()
    has_description = any(k.split("/")[0] == DESCRIPTION_KEY for k in keys)
    return shapes, common, has_description


def _description(common: Dict[str, Any], stored: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """megatron's fields: what import-hf stored, else megatron's `args`, else {}."""
    if isinstance(stored, dict):
        return stored
    args = common.get("args")
    if isinstance(args, argparse.Namespace):
        return dict(vars(args))
    return dict(args) if isinstance(args, dict) else {}


def _heads(cfg: Dict[str, Any], desc: Dict[str, Any], index: _hf_layout.Index) -> Any:
    """The checkpoint's QKV layout: heads from the stored shapes at the model's head_dim
    (shapes alone cannot tell head_dim), checked against its description when it has one."""
    shapes = {name: st.shape for (name, _, _), st in index.items()}
    if "embedding.word_embeddings.weight" not in shapes or (
        "self_attention.linear_qkv.weight" not in shapes
    ):
        raise CheckpointingException("not a GPTModel checkpoint: no embedding or linear_qkv")
    d = int(cfg["head_dim"])
    qkv_rows = shapes["self_attention.linear_qkv.weight"][0]
    q_rows = shapes.get("self_attention.linear_proj.weight", (0, qkv_rows // 3))[-1]
    heads = _hf_layout.Heads(q_rows // d, (qkv_rows - q_rows) // (2 * d), d)
    _hf_layout.check_heads(heads)
    if not desc:
        return heads
    layers = len({layer for (_, layer, _) in index if layer >= 0})
    ckpt_cfg = hf_map.hf_config(desc, shapes, layers)  # raises for another architecture
    wrong = []
    for hf_field, meg_field in _COMPARED.items():
        always = hf_field in ("num_attention_heads", "num_key_value_heads", "head_dim")
        if not always and desc.get(meg_field) is None:
            continue  # a default of megatron's is no statement about this checkpoint
        want, got = ckpt_cfg.get(hf_field), cfg.get(hf_field)
        if want is None or got is None:
            continue
        if not math.isclose(float(want), float(got), rel_tol=1e-6):
            wrong.append(f"{hf_field}: model {got}, checkpoint {want} ({meg_field})")
    if wrong:
        raise CheckpointingException(
            "the model's config does not match the checkpoint's description: " + "; ".join(wrong)
        )
    return heads


def _field(name: str, axis: int) -> str:
    for suffix, fields in _FIELDS.items():
        if name.endswith(suffix) and axis < len(fields):
            return fields[axis]
    return "num_hidden_layers" if axis < 0 else f"axis {axis}"


def _plan(
    model: Any,
    optimizer: Any,
    shapes: Dict[str, Any],
    common: Dict[str, Any],
    stored_desc: Optional[Dict[str, Any]],
) -> Tuple[Dict[str, ShardedTensor], List[Any]]:
    """The load requests, and `(param, step)` of the optimizer state to create; raises on
    every mismatch (all of them listed) before anything is read or changed."""
    cfg = _config(model)
    _check_architecture(cfg)
    _hf_layout.resharded(model)
    index = _hf_layout.index_stored({k: s for k, (s, _) in shapes.items()})
    heads = _heads(cfg, _description(common, stored_desc), index)
    experts = int(cfg.get("num_local_experts") or 0)
    params = dict(model.named_parameters())
    if cfg.get("tie_word_embeddings") and "output_layer.weight" in shapes:
        if "lm_head.weight" not in params:
            raise CheckpointingException(
                "the checkpoint has an untied output_layer.weight but the model ties lm_head "
                "to the embedding (tie_word_embeddings=True): set tie_word_embeddings=False"
            )
    unmapped, wrong, sources = [], [], {}
    for name, p in params.items():
        src, why = _hf_layout.source(name, index, experts)
        if src is None:
            unmapped.append(f"{name} ({why})")
            continue
        want, may_be_shorter = _hf_layout.expected_shape(src, heads)
        got = tuple(p.shape)
        fits = got == want or (
            may_be_shorter and got[1:] == want[1:] and len(got) == len(want) and got[0] <= want[0]
        )
        if not fits:
            axes = [a for a, (g, w) in enumerate(zip(got, want)) if g != w] or [-1]
            wrong.append(
                f"{name}: model {got}, checkpoint {want} (stored {src.stored[0].key!r}; "
                f"{_field(name, axes[0])} differs)"
            )
        sources[name] = src
    if unmapped:
        raise CheckpointingException(
            f"{len(unmapped)} parameter(s) have no source in the megatron-core GPTModel "
            "checkpoint: " + ", ".join(unmapped)
        )
    if wrong:
        raise CheckpointingException("parameter shapes do not fit: " + "; ".join(wrong))
    requests: Dict[str, ShardedTensor] = {}
    for name, src in sources.items():
        requests.update(_hf_layout.requests("", name, src, heads, params[name]))
    states: List[Any] = []
    if optimizer is not None:
        states = _optimizer_plan(optimizer, params, sources, shapes, common)
        names = {id(p): n for n, p in params.items()}
        for p, moments, _ in states:
            for moment, t in moments.items():
                prefix = f"optimizer.state.{moment}."
                requests.update(
                    _hf_layout.requests(prefix, names[id(p)], sources[names[id(p)]], heads, t)
                )
    return requests, states


def _common_step(common: Any) -> List[Any]:
    """Every `common_step` megatron's optimizer wrappers stored in the common state."""
    if isinstance(common, dict):
        found = [common["common_step"]] if "common_step" in common else []
        return found + [s for v in common.values() for s in _common_step(v)]
    if isinstance(common, (list, tuple)):
        return [s for v in common for s in _common_step(v)]
    return []


def _optimizer_plan(
    optimizer: Any,
    params: Dict[str, torch.Tensor],
    sources: Dict[str, _hf_layout.Source],
    shapes: Dict[str, Any],
    common: Dict[str, Any],
) -> List[Tuple[torch.Tensor, Dict[str, torch.Tensor], torch.Tensor]]:
    """`(param, {moment: new zero state}, step)` per optimized parameter; raises on an
    optimizer other than Adam/AdamW, AMSGrad, or state the checkpoint lacks."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise CheckpointingException(
            f"optimizer {type(optimizer).__name__}: only torch.optim.Adam / AdamW state is "
            "loaded from megatron's optimizer state"
        )
    if any(g.get("amsgrad") for g in optimizer.param_groups):
        raise CheckpointingException("amsgrad=True: megatron's checkpoints hold no max_exp_avg_sq")
    names = {id(p): n for n, p in params.items()}
    missing = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                raise CheckpointingException("the optimizer holds a tensor that is no parameter")
            for moment, st in itertools.product(_MOMENTS, sources[name].stored):
                if f"optimizer.state.{moment}.{st.key}" not in shapes:
                    missing.append(f"optimizer.state.{moment}.{st.key}")
    if missing:
        keys = sorted(set(missing))
        raise CheckpointingException(
            f"the checkpoint lacks {len(keys)} optimizer state tensor(s) the optimizer needs, "
            "e.g. " + ", ".join(keys[:3])
        )
    steps = {float(s) for s in _common_step(common)}
    if len(steps) != 1:
        raise CheckpointingException(
            f"the checkpoint holds {len(steps)} distinct Adam steps {sorted(steps)} "
            "(megatron's optimizer wrappers store one `common_step`); cannot restore Adam's step"
        )
    out = []
    for group in optimizer.param_groups:
        on = "cpu"  # where torch's Adam keeps `step`, unless capturable or fused
        for p in group["params"]:
            if group.get("capturable") or group.get("fused"):
                on = p.device
            moments = {
                m: torch.zeros_like(p, memory_format=torch.preserve_format) for m in _MOMENTS
            }
            out.append(
                (p, moments, torch.tensor(steps.copy().pop(), dtype=torch.float32, device=on))
            )
    return out


def load(
    model: torch.nn.Module,
    checkpoint_dir: Union[str, Path],
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    allow_lossy_dtype_conversion: bool = False,
) -> Dict[str, Any]:
    """Collective: loads a megatron-core GPTModel checkpoint into a transformers model.

    Steps: read the stored tensors' metadata, the common state and the model description
    (what `import-hf` stored, else megatron's `args`, else the model's config alone); map
    every parameter to its stored rows and check every shape (all mismatches named, on
    every rank, before anything is read); load this rank's rows, in place, with one
    `dist_checkpointing.load` per layer; with `optimizer`, Adam's moments and step alike.

    Args:
        model: a transformers Llama / Mistral / Mixtral-style causal LM, its parameters plain
            tensors or FSDP2 DTensors (`Shard(0)`, uneven last shards included).
        checkpoint_dir: a megatron-core GPTModel `torch_dist` checkpoint (any TP/PP/EP).
        optimizer: a `torch.optim.Adam` / `AdamW` over the model's parameters: its state is
            replaced by the checkpoint's (`optimizer.state.exp_avg.<key>`, `exp_avg_sq`,
            and the `common_step` megatron's optimizer wrappers store); its param groups
            (learning rate, ...) are kept.
        allow_lossy_dtype_conversion: load into parameters of a narrower dtype (a bf16
            model from fp32 tensors) rounding; without it such a load succeeds only where
            every value converts exactly, else raises `LossyDtypeConversionError` naming
            the key (possibly after earlier layers were filled).

    Returns:
        The checkpoint's common state (plain values: iteration, megatron's args, ...).

    Raises:
        CheckpointingException: another architecture, a parameter without a source, a shape
            that does not fit (parameter, both shapes and the config field named), missing
            optimizer state; on every rank.
    """
    ckpt = Path(checkpoint_dir)
    shapes, common, has_desc = _dist.run_collectively(
        f"hf_model.load: reading {ckpt}", _read_checkpoint, ckpt
    )
    stored_desc = None
    if has_desc:  # the same on every rank: each read the same metadata
        ask = {"d": ShardedObject(DESCRIPTION_KEY, None, (1,), (0,), replica_id=_dist.get_rank())}
        loaded = serialization.load(ask, ckpt)
        assert isinstance(loaded, dict)  # the default strict mode returns the state dict
        stored_desc = loaded["d"]
    with torch.no_grad():
        requests, states = _dist.run_collectively(
            f"hf_model.load: mapping the model onto {ckpt}",
            _plan,
            model,
            optimizer,
            shapes,
            common,
            stored_desc,
        )
        for batch in _hf_layout.by_layer(
            requests, shapes
        ):  # the same number of calls on every rank
            serialization.load(
                batch,
                ckpt,
                validate_access_integrity=False,
                allow_lossy_dtype_conversion=allow_lossy_dtype_conversion,
            )
    if optimizer is not None:
        for p, moments, step in states:
            optimizer.state[p] = {"step": step, **moments}
    logger.info("hf_model.load: %d tensor pieces from %s", len(requests), ckpt)
    return common


def save(
    model: torch.nn.Module,
    checkpoint_dir: Union[str, Path],
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    common_state: Optional[Dict[str, Any]] = None,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    **megatron_layout: Any,
) -> None:
    """Collective: writes a transformers model (and Adam state) as a megatron-core GPTModel
    checkpoint, each rank its own rows (`load` in reverse).

    The checkpoint holds megatron-core 0.16's layer-stacked keys with global shapes (so
    megatron loads it at any TP/PP/EP its sizes divide), the `_extra_state` objects
    megatron's load asks for, the description (`megatron_config`, as `import-hf` stores
    it) and, with `optimizer`, `optimizer.state.exp_avg.<key>` / `exp_avg_sq`, one
    `common_step` and the param groups of megatron-core's default grouping, valued from
    the torch groups (which must agree within each; docs/huggingface.md has the rule).
    The vocabulary is not padded.

    Args:
        model: a transformers Llama / Mistral / Mixtral-style causal LM, plain or FSDP2.
        checkpoint_dir: the checkpoint directory to write.
        optimizer: a `torch.optim.Adam` / `AdamW` over the model's parameters, stepped
            (every parameter with state, one step).
        common_state: plain values to store beside (e.g. `{"iteration": 100}`).
        tp, pp, ep: the split the description records (its sizes must divide); `ep` > 1
            also puts the experts in a param group of their own, as megatron does.
        **megatron_layout: further description fields (megatron's names).

    Raises:
        CheckpointingException: another architecture, a parameter without a megatron name,
            an optimizer or state that megatron's layout cannot hold; on every rank.
    """
    from . import _hf_save  # it builds on this module's helpers

    layout = dict(megatron_layout, tp=tp, pp=pp, ep=ep)
    _hf_save.save(model, checkpoint_dir, optimizer, common_state=common_state, **layout)
