"""Rank functions of the FSDP2 <-> stock DCP tests (every rank of a gloo world)."""

from __future__ import annotations

from typing import Any, Dict, List

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import dist_checkpointing as dc
from tests.dtensor._fns import _mesh, full_values, make_model, same_values, train_step


def _trained(seed: int) -> Any:
    model, optim = make_model(_mesh((2,)), seed=seed)
    train_step(model, optim)
    return model, optim


def _held(model: Any, optim: Any) -> Dict[str, Any]:
    msd, osd = get_state_dict(model, optim)
    return full_values({"model": msd, "optim": osd})


def both_ways(root: str) -> Dict[str, List[str]]:
    """The model and Adam state of an FSDP2 model: stock `dcp.save` -> our `load` and our
    `save` -> stock `dcp.load`, each into another model through `set_state_dict`. Returns,
    per direction, the flat names whose values the receiving model then holds differently."""
    model, optim = _trained(0)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    want = full_values(state)
    dcp.save(state, checkpoint_id=f"{root}/stock")
    dc.save(state, f"{root}/ours")
    bad: Dict[str, List[str]] = {}

    other, other_optim = _trained(5)
    m, o = get_state_dict(other, other_optim)
    loaded = dc.load({"model": m, "optim": o}, f"{root}/stock")
    set_state_dict(
        other, other_optim, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )
    bad["stock -> ours"] = same_values(want, _held(other, other_optim))

    other, other_optim = _trained(6)
    m, o = get_state_dict(other, other_optim)
    request = {"model": m, "optim": o}
    dcp.load(request, checkpoint_id=f"{root}/ours")
    set_state_dict(
        other, other_optim, model_state_dict=request["model"], optim_state_dict=request["optim"]
    )
    bad["ours -> stock"] = same_values(want, _held(other, other_optim))
    return bad
