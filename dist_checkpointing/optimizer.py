"""Optimizer state sharded like its parameters (megatron-core's names and signatures): each
per-parameter state tensor (Adam's `exp_avg`, ...) gets its parameter's sharding."""

from __future__ import annotations

import logging
from copy import deepcopy
from dataclasses import replace
from typing import Any, Dict, Iterable, Sequence, Union

import torch

from . import _dist
from ._types import ShardedStateDict, StateDict
from .dict_utils import nested_values
from .errors import CheckpointingException
from .mapping import LocalNonpersistentObject, ShardedTensor, ShardedTensorFactory
from .utils import extract_sharded_tensors_and_factories

__all__ = [
    "KEEP_VARS_HINT",
    "get_optim_param_to_id_map",
    "get_param_id_to_sharded_param_map",
    "make_sharded_optimizer_tensor",
    "optim_state_to_sharding_state",
]

logger = logging.getLogger(__name__)

#: Appended to errors about parameters that cannot be matched to the model's sharded state.
KEEP_VARS_HINT = (
    " The model's state dict must hold the original torch.nn.Parameter objects, not copies:"
    " call `.state_dict(keep_vars=True)` (or `sharded_state_dict()`, which does). To save a"
    " transformed parameter, wrap it in a ShardedTensorFactory."
)

ShardedParam = Union[ShardedTensor, ShardedTensorFactory]


def _local(t: Any) -> Any:
    """The local tensor of a DTensor (FSDP2 parameters); anything else unchanged."""
    to_local = getattr(t, "to_local", None)
    if to_local is not None and type(t).__name__ == "DTensor":
        return to_local()
    return t


def get_optim_param_to_id_map(optim_params_iter: Iterable[torch.nn.Parameter]) -> Dict[int, int]:
    """Maps `id(param)` to its first position in the optimizer's parameters (in
    `param_groups` order)."""
    out: Dict[int, int] = {}
    for index, param in enumerate(optim_params_iter):
        out.setdefault(id(_local(param)), index)
    return out


def get_param_id_to_sharded_param_map(
    model_sharded_state_dict: ShardedStateDict, optim_params_iter: Iterable[torch.nn.Parameter]
) -> Dict[int, ShardedParam]:
    """Maps optimizer state ids (positions in `optim_params_iter`) to the model's
    ShardedTensors (or factories) whose `data` is that very parameter; unmatched parameters
    are absent (a warning on rank 0 when none matched)."""
    leaves, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    param_ids = get_optim_param_to_id_map(optim_params_iter)
    out: Dict[int, ShardedParam] = {}
    for leaf in nested_values(leaves):
        index = param_ids.get(id(leaf.data))
        if index is None:
            logger.debug("%s is not tracked by the optimizer", leaf)
        else:
            out[index] = leaf
    if not out:
        msg = "No model sharded tensor matches an optimizer parameter." + KEEP_VARS_HINT
        _dist.log_rank0(logger, logging.WARNING, msg)
    return out


def make_sharded_optimizer_tensor(
    model_param: ShardedParam, optim_param: torch.Tensor, prefix: str
) -> ShardedParam:
    """A copy of `model_param` keyed `<prefix>.<model key>` with `optim_param` (same local
    shape) as data, for one optimizer state tensor.

    Raises:
        CheckpointingException: the shapes differ (naming the key).
    """
    optim_param = _local(optim_param)
    key = f"{prefix}.{model_param.key}"
    if isinstance(model_param, ShardedTensorFactory):
        return replace(model_param, key=key, data=optim_param)
    if tuple(optim_param.shape) != tuple(model_param.local_shape):
        raise CheckpointingException(
            f"Optimizer state {key!r} has shape {tuple(optim_param.shape)}, its parameter "
            f"{model_param.key!r} has local shape {tuple(model_param.local_shape)}"
        )
    return replace(model_param, key=key, data=optim_param, dtype=optim_param.dtype)


def optim_state_to_sharding_state(
    optim_state_dict: StateDict,
    id_to_sharded_param_map: Dict[int, ShardedParam],
    exclude_keys: Union[str, Sequence[str]] = (),
) -> None:
    """Turns a `torch.optim` state dict into a sharded state dict, in place.

    `["state"][id][name]` becomes a ShardedTensor keyed `optimizer.state.<name>.<param key>`;
    the `params` lists of (deep-copied) `param_groups` become LocalNonpersistentObjects.

    Args:
        optim_state_dict: `{"state": {...}, "param_groups": [...]}`.
        id_to_sharded_param_map: from `get_param_id_to_sharded_param_map`.
        exclude_keys: state names left out (e.g. `"step"`).

    Raises:
        CheckpointingException: a state id has no sharded parameter.
    """
    sharded: Dict[int, Dict[str, ShardedParam]] = {}
    for param_id, param_state in optim_state_dict["state"].items():
        kept = {n: v for n, v in param_state.items() if n not in exclude_keys}
        if kept and param_id not in id_to_sharded_param_map:
            raise CheckpointingException(
                f"Optimizer state id {param_id} matches no model sharded parameter."
                + KEEP_VARS_HINT
            )
        sharded[param_id] = {
            name: make_sharded_optimizer_tensor(
                id_to_sharded_param_map[param_id], value, f"optimizer.state.{name}"
            )
            for name, value in kept.items()
        }
    groups = deepcopy(optim_state_dict["param_groups"])
    for group in groups:
        group["params"] = LocalNonpersistentObject(group["params"])
    optim_state_dict["param_groups"] = groups
    optim_state_dict["state"] = sharded
