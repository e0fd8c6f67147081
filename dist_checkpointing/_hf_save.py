"""`hf_model.save`: a live `transformers` model (plain or FSDP2) and its Adam state written as
a megatron-core GPTModel `torch_dist` checkpoint, each rank writing its own rows.

The reverse of `hf_model.load` with the same row mapping (`_hf_layout`): the megatron
tensors' global shapes come from the model's config (layer-stacked keys, megatron-core
0.16's names, as `import-hf` writes them), each rank's rows of each parameter become
`ShardedTensor`s at their offsets in the fused tensors, and replicas (plain models on
several ranks, `Replicate` mesh dimensions) are written once.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch

from . import _dist, _hf_layout, serialization
from .errors import CheckpointingException
from .hf_model import (
    _MOMENTS,
    DESCRIPTION_KEY,
    _check_architecture,
    _config,
)
from .mapping import ShardedObject
from .tools import hf_map

__all__ = ["save"]

logger = logging.getLogger(__name__)

#: the fields megatron's optimizer wrappers match saved param groups by (0.16's four; 0.19
#: adds `max_lr` and `min_lr`, written from the torch group below)
_IDENTIFIERS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


def _megatron_shapes(cfg: Dict[str, Any]) -> Dict[str, Tuple[int, ...]]:
    """The global shapes megatron-core's GPTModel stores for HF config `cfg`."""
    layers, hidden, vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    h, g, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    ffn, experts = cfg["intermediate_size"], int(cfg.get("num_local_experts") or 0)
    pre = "decoder.layers."
    shapes: Dict[str, Tuple[int, ...]] = {
        "embedding.word_embeddings.weight": (vocab, hidden),
        "decoder.final_layernorm.weight": (hidden,),
        pre + "self_attention.linear_qkv.layer_norm_weight": (layers, hidden),
        pre + "self_attention.linear_qkv.weight": (layers, (h + 2 * g) * d, hidden),
        pre + "self_attention.linear_proj.weight": (layers, hidden, h * d),
        pre + "mlp.linear_fc1.layer_norm_weight": (layers, hidden),
    }
    if not cfg.get("tie_word_embeddings"):
        shapes["output_layer.weight"] = (vocab, hidden)
    if experts:
        shapes[pre + "mlp.router.weight"] = (layers, experts, hidden)
        shapes[pre + "mlp.experts.experts.linear_fc1.weight"] = (layers, experts, 2 * ffn, hidden)
        shapes[pre + "mlp.experts.experts.linear_fc2.weight"] = (layers, experts, hidden, ffn)
    else:
        shapes[pre + "mlp.linear_fc1.weight"] = (layers, 2 * ffn, hidden)
        shapes[pre + "mlp.linear_fc2.weight"] = (layers, hidden, ffn)
    return shapes


def _replica(t: torch.Tensor, rank: int) -> Any:
    """0 for the copy that is written: a plain tensor on rank 0, a DTensor at coordinate 0
    of every `Replicate` mesh dimension."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return rank
    coordinate: List[int] = list(t.device_mesh.get_coordinate() or [])
    repl = [c for c, p in zip(coordinate, t.placements) if isinstance(p, Replicate)]
    return tuple(repl) if repl else 0


def _optimizer_state(
    optimizer: Any, params: Mapping[str, torch.Tensor]
) -> Tuple[Dict[str, Dict[str, torch.Tensor]], float]:
    """`{param name: {moment: state}}` and the one Adam step; raises on anything else."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise CheckpointingException(
            f"optimizer {type(optimizer).__name__}: only torch.optim.Adam / AdamW state is "
            "saved in megatron's layout"
        )
    if any(g.get("amsgrad") for g in optimizer.param_groups):
        raise CheckpointingException("amsgrad=True: megatron's layout has no max_exp_avg_sq")
    names = {id(p): n for n, p in params.items()}
    out, steps = {}, set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                raise CheckpointingException("the optimizer holds a tensor that is no parameter")
            state = optimizer.state.get(p) or {}
            if any(m not in state for m in (*_MOMENTS, "step")):
                raise CheckpointingException(
                    f"no Adam state for {name!r} (take a step, or load one, first)"
                )
            steps.add(float(state["step"]))
            out[name] = {m: state[m] for m in _MOMENTS}
    if len(steps) != 1:
        raise CheckpointingException(
            f"the parameters have {len(steps)} distinct Adam steps {sorted(steps)}: megatron "
            "stores one `common_step`"
        )
    return out, steps.pop()


def _megatron_group_of(name: str, p: torch.Tensor, ep: int) -> Tuple[float, bool]:
    """`(wd_mult, is_expert_parallel)` of the group megatron-core's default grouping puts
    parameter `name` in: no weight decay for biases and 1-D parameters (norms), experts
    apart from the rest when expert-parallel (at EP=1 megatron all-reduces their gradients
    like any other's and groups them with the rest)."""
    no_decay = p.dim() == 1 or name.endswith(".bias")  # a DTensor's `dim` is its global one
    return (0.0 if no_decay else 1.0), ep > 1 and ".experts." in name


def _megatron_groups(
    optimizer: Any, params: Mapping[str, torch.Tensor], ep: int
) -> List[Dict[str, Any]]:
    """The optimizer's param groups regrouped as megatron-core's default `_get_param_groups`
    groups a GPTModel (its optimizer's `load_state_dict` needs the same number of groups,
    matched by their identifying fields), each with the hyperparameters of the torch groups
    its parameters come from; raises where those differ within one megatron group, or where
    a torch group's own megatron field contradicts megatron's grouping."""
    names = {id(p): n for n, p in params.items()}
    merged: Dict[Tuple[float, bool], Dict[str, Any]] = {}
    first: Dict[Tuple[float, bool], str] = {}  # the parameter each group's values came from
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            name = names[id(p)]
            key = _megatron_group_of(name, p, ep)
            fields = {"wd_mult": key[0], "lr_mult": 1.0, "is_expert_parallel": key[1]}
            fields["is_decoupled_lr"] = False
            for field in _IDENTIFIERS:
                if field in hyper and hyper[field] != fields[field]:
                    raise CheckpointingException(
                        f"parameter {name!r}: its optimizer group has {field}={hyper[field]!r}, "
                        f"megatron-core's default grouping gives it {fields[field]!r}"
                    )
            values = {**hyper, **fields}
            if key not in merged:
                merged[key], first[key] = values, name
                continue
            for field in sorted(set(values) | set(merged[key])):
                a, b = merged[key].get(field), values.get(field)
                if a != b:
                    raise CheckpointingException(
                        f"parameters {first[key]!r} and {name!r} share one megatron-core param "
                        f"group (wd_mult={key[0]}, is_expert_parallel={key[1]}) but their "
                        f"optimizer groups differ in {field!r} ({a!r} and {b!r})"
                    )
    groups = []
    # megatron's order: groups without overrides (weight decay) first, then by appearance;
    # its `load_state_dict` matches groups by their fields, so the order is cosmetic
    for key in sorted(merged, key=lambda k: k[0] == 0.0):
        group = merged[key]
        # megatron-core 0.19 also matches groups by `max_lr` (its optimizer config's `lr`)
        # and `min_lr` (None unless configured: left out, a torch group may carry one)
        group.setdefault("max_lr", group.get("initial_lr", group.get("lr")))
        groups.append(group)
    return groups


def _state_dict(
    model: torch.nn.Module,
    optimizer: Any,
    common_state: Dict[str, Any],
    split: Tuple[int, int, int],
    description: Dict[str, Any],
) -> Dict[str, Any]:
    cfg = _config(model)
    _check_architecture(cfg)
    _hf_layout.resharded(model)
    as_export = {**cfg, "model_type": "mixtral" if cfg["model_type"] == "mixtral" else "llama"}
    desc = {**hf_map.megatron_description(as_export, *split), **description}
    heads = _hf_layout.Heads(
        cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    )
    _hf_layout.check_heads(heads)
    index = _hf_layout.index_stored(_megatron_shapes(cfg))
    experts = int(cfg.get("num_local_experts") or 0)
    params = dict(model.named_parameters())
    rank = _dist.get_rank()
    sd: Dict[str, Any] = {}
    sources, bad = {}, []
    for name, p in params.items():
        src, why = _hf_layout.source(name, index, experts)
        if src is None or tuple(p.shape) != _hf_layout.expected_shape(src, heads)[0]:
            bad.append(f"{name} {tuple(p.shape)} ({why or 'not the shape its config gives'})")
            continue
        sources[name] = src
        sd.update(_hf_layout.requests("", name, src, heads, p, _replica(p, rank)))
    if bad:
        raise CheckpointingException(
            f"{len(bad)} parameter(s) have no place in a megatron-core GPTModel: " + ", ".join(bad)
        )
    if optimizer is not None:
        moments, step = _optimizer_state(optimizer, params)
        for name, states in moments.items():
            for moment, t in states.items():
                prefix = f"optimizer.state.{moment}."
                replica = _replica(t, rank)
                sd.update(_hf_layout.requests(prefix, name, sources[name], heads, t, replica))
        groups = _megatron_groups(optimizer, params, split[2])
        common_step = torch.tensor(step, dtype=torch.float32)
        sd["optimizer"] = {"param_groups": groups, "state": {"common_step": common_step}}
    # megatron's linear layers save an `_extra_state` object per layer (and expert) and its
    # load asks for them: written as a newly built model (local layer spec) holds them
    layers = cfg["num_hidden_layers"]
    mlp = "mlp.experts.experts." if experts else "mlp."
    linears = ["self_attention.linear_qkv", "self_attention.linear_proj"]
    for name in linears + [f"{mlp}linear_fc{i}" for i in (1, 2)]:
        grid = (layers, experts) if "experts" in name else (layers,)
        for pos in itertools.product(*(range(n) for n in grid)):
            key = f"decoder.layers.{name}._extra_state"
            data = [None] if len(grid) > 1 else None
            sd[f"{key} {pos}"] = ShardedObject(key, data, grid, pos, replica_id=rank)
    sd[DESCRIPTION_KEY] = ShardedObject(DESCRIPTION_KEY, desc, (1,), (0,), replica_id=rank)
    clash = sorted(set(common_state) & set(sd))
    if clash:
        raise CheckpointingException(f"common_state keys {clash} are taken by the model state")
    sd.update(common_state)
    return sd


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
    """See `dist_checkpointing.hf_model.save`."""
    ckpt = Path(checkpoint_dir)
    with torch.no_grad():
        sd = _dist.run_collectively(
            f"hf_model.save: mapping the model onto {ckpt}",
            _state_dict,
            model,
            optimizer,
            dict(common_state or {}),
            (tp, pp, ep),
            megatron_layout,
        )
        serialization.save(sd, ckpt)
    logger.info("hf_model.save: wrote %s", ckpt)
