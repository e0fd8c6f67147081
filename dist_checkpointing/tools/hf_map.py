"""Names, layouts and configs of megatron-core's GPTModel vs transformers' Llama / Mixtral:
pure functions (no I/O) for `hf.py`. A homogeneous decoder stores all layers under one
layer-stacked key `decoder.layers.<name>` (layer axis, then expert axis); others use
`decoder.layers.<i>.<name>`. Fused layouts that transformers keeps apart:
- QKV: one `linear_qkv`; per query group its query heads, then its key and value heads.
- SwiGLU: one `linear_fc1` `[gate; up]` (any TP size) vs `gate_proj` / `up_proj` (`w1` / `w3`).
Which rows go where is `_hf_layout.row_pieces`'s job (`split` / `fuse` here use it).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import CheckpointingException

__all__ = [
    "GLOBAL",
    "LAYER",
    "EXPERT",
    "LAYER_KEY",
    "stored_layers",
    "hf_config",
    "megatron_description",
    "split",
    "fuse",
]

logger = logging.getLogger(__name__)

#: megatron key -> HF name, outside the decoder layers
GLOBAL = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
#: name in a layer -> HF names in `model.layers.<i>.`: megatron-core 0.16's names (local and
#: TE specs, written on import), then the local spec's module names (only read).
LAYER: Dict[str, Tuple[str, ...]] = {
    "self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.weight": tuple(f"self_attn.{p}_proj.weight" for p in "qkv"),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "mlp.linear_fc1.layer_norm_weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
    "mlp.router.weight": ("block_sparse_moe.gate.weight",),
    "input_layernorm.weight": ("input_layernorm.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
}
#: expert weight -> HF names inside `model.layers.<i>.block_sparse_moe.experts.<e>.`
EXPERT: Dict[str, Tuple[str, ...]] = {
    "linear_fc1.weight": ("w1.weight", "w3.weight"),
    "linear_fc2.weight": ("w2.weight",),
}
DENSE_ONLY = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
#: decoder.layers.[<layer>.][mlp.experts.(experts.|local_experts.<expert>.)]<name>
LAYER_KEY = re.compile(
    r"decoder\.layers\.(?:(\d+)\.)?(mlp\.experts\.(?:experts\.|local_experts\.(\d+)\.))?(.+)"
)
#: what makes a GPTModel a Llama / Mixtral, in megatron's fields (also their defaults here)
_LLAMA_LIKE: Dict[str, Any] = {
    **dict(normalization="RMSNorm", gated_linear_unit=True, activation_func="silu"),
    **dict(position_embedding_type="rope", rotary_percent=1.0, rotary_interleaved=False),
    **dict(add_bias_linear=False, add_qkv_bias=False, qk_layernorm=False),
    **dict(moe_router_pre_softmax=False, moe_router_score_function="softmax"),
    "moe_shared_expert_intermediate_size": None,
}


def stored_layers(
    key: str, shape: Sequence[int]
) -> Optional[List[Tuple[str, int, int, Tuple[int, ...]]]]:
    """`(name, layer, expert, lead)` of every layer's (expert's) tensor in stored `key` of
    `shape`: `name` a `GLOBAL` key (layer and expert -1), a name in a layer, or
    `experts.<name>` (expert -1 outside experts); `lead` its offsets on the key's stacked
    (layer, then expert) axes. None for a key outside `GLOBAL` and the decoder layers."""
    if key in GLOBAL:
        return [(key, -1, -1, ())]
    m = LAYER_KEY.fullmatch(key)
    if m is None:
        return None
    expert = m[2] is not None
    name = f"experts.{m[4]}" if expert else m[4]
    layers = [int(m[1])] if m[1] else range(shape[0])
    experts: Sequence[int] = [-1]
    if expert:  # stacked experts: the axis after the layer axis (if the key has one)
        experts = [int(m[3])] if m[3] else range(shape[0 if m[1] else 1])
    out = []
    for i in layers:
        for e in experts:
            lead = (() if m[1] else (i,)) + ((e,) if expert and not m[3] else ())
            out.append((name, i, e, lead))
    return out


def split(name: str, t: torch.Tensor, heads: int, groups: int) -> List[torch.Tensor]:
    """megatron's fused `t` (one layer, one expert) -> the HF tensors of `LAYER`/`EXPERT`
    (the layouts live in `_hf_layout`, which `hf_model` maps rows with)."""
    from .. import _hf_layout  # imported here: `_hf_layout` builds on this module's tables

    return _hf_layout.split(name, t, heads, groups)


def fuse(name: str, parts: Sequence[torch.Tensor], heads: int, groups: int) -> torch.Tensor:
    """The inverse of `split`: HF tensors -> megatron's fused tensor."""
    from .. import _hf_layout

    return _hf_layout.fuse(name, parts, heads, groups)


def _get(desc: Dict[str, Any], field: str, default: Any = None) -> Any:
    value = desc.get(field)
    return default if value is None else value


def hf_config(
    desc: Dict[str, Any], shapes: Dict[str, Tuple[int, ...]], num_layers: int
) -> Dict[str, Any]:
    """transformers' `config.json` for GPTModel description `desc` (megatron's fields); sizes
    from `shapes` (of `GLOBAL` keys, one layer's `LAYER` names, `experts.<EXPERT name>`).

    Raises:
        CheckpointingException: a field missing, or one that makes it no Llama / Mixtral.
    """
    wrong = []
    for field, want in _LLAMA_LIKE.items():
        got = _get(desc, field, want)
        got = getattr(got, "__name__", got)  # a function, in a description made in Python
        if got != want and not (field == "activation_func" and got == "swiglu"):
            wrong.append(f"{field}={got!r} (needs {want!r})")
    heads = _get(desc, "num_attention_heads")
    if heads is None:
        wrong.append("num_attention_heads is not given (the checkpoint does not tell it)")
    if wrong:
        raise CheckpointingException("not a Llama / Mixtral-style GPTModel: " + "; ".join(wrong))
    emb = shapes["embedding.word_embeddings.weight"]
    head_dim = _get(desc, "kv_channels", shapes["self_attention.linear_proj.weight"][-1] // heads)
    moe = "mlp.router.weight" in shapes
    fc2 = shapes["experts.linear_fc2.weight" if moe else "mlp.linear_fc2.weight"]
    qkv_heads = shapes["self_attention.linear_qkv.weight"][0] // head_dim
    cfg = {
        "architectures": ["MixtralForCausalLM" if moe else "LlamaForCausalLM"],
        "model_type": "mixtral" if moe else "llama",
        "vocab_size": _get(desc, "vocab_size", emb[0]),
        "hidden_size": emb[1],
        "intermediate_size": fc2[-1],
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": (qkv_heads - heads) // 2,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": _get(desc, "max_sequence_length", 4096),
        "rms_norm_eps": _get(desc, "layernorm_epsilon", 1e-5),
        "rope_theta": float(_get(desc, "rotary_base", 10000)),
        "tie_word_embeddings": "output_layer.weight" not in shapes,
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    if moe:
        cfg["num_local_experts"] = shapes["mlp.router.weight"][0]
        cfg["num_experts_per_tok"] = _get(desc, "moe_router_topk", 2)
    else:
        cfg["mlp_bias"] = False
    return cfg


def megatron_description(cfg: Dict[str, Any], tp: int, pp: int, ep: int) -> Dict[str, Any]:
    """megatron's fields (TransformerConfig, GPTModel's) for HF `cfg`, checked for the split.

    Raises:
        CheckpointingException: not a Llama / Mixtral config, or sizes the split cannot divide.
    """
    kind, rope = cfg.get("model_type"), cfg.get("rope_parameters") or {}
    bad = [] if kind in ("llama", "mixtral") else [f"model_type={kind!r}"]
    for k in ("rope_scaling", "attention_bias", "mlp_bias", "sliding_window"):
        bad += [f"{k}={cfg[k]!r}"] if cfg.get(k) else []
    bad += [] if cfg.get("hidden_act", "silu") == "silu" else [f"hidden_act={cfg['hidden_act']!r}"]
    bad += [] if rope.get("rope_type", "default") == "default" else [f"rope_parameters={rope}"]
    if bad:
        raise CheckpointingException("not a Llama / Mixtral-style model: " + ", ".join(bad))
    heads = cfg["num_attention_heads"]
    desc: Dict[str, Any] = {
        **{k: v for k, v in _LLAMA_LIKE.items() if not k.startswith("moe_")},
        "num_layers": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"],
        "ffn_hidden_size": cfg["intermediate_size"],
        "num_attention_heads": heads,
        "num_query_groups": cfg.get("num_key_value_heads") or heads,
        "kv_channels": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "layernorm_epsilon": cfg.get("rms_norm_eps", 1e-6),
        "rotary_base": rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        "vocab_size": cfg["vocab_size"],
        "max_sequence_length": cfg.get("max_position_embeddings", 4096),
        "share_embeddings_and_output_weights": bool(cfg.get("tie_word_embeddings", False)),
        **dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
        "expert_model_parallel_size": ep,
    }
    if kind == "mixtral":
        desc["num_moe_experts"] = cfg["num_local_experts"]
        desc["moe_router_topk"] = cfg.get("num_experts_per_tok", 2)
    sizes = [
        ("num_attention_heads", heads, tp),
        ("num_key_value_heads", desc["num_query_groups"], tp),
        ("intermediate_size", desc["ffn_hidden_size"], tp),
        ("vocab_size", desc["vocab_size"], tp),
        ("num_hidden_layers", desc["num_layers"], pp),
        ("num_local_experts", desc.get("num_moe_experts", ep), ep),
    ]
    bad = [f"{name}={n} is not divisible by {by}" for name, n, by in sizes if n % by]
    if bad:
        raise CheckpointingException(f"cannot split at tp={tp} pp={pp} ep={ep}: " + "; ".join(bad))
    return desc
