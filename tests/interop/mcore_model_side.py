"""Megatron-core's own GPTModel and Adam state on our package, in ONE interpreter (2 gloo ranks).

Usage: python mcore_model_side.py MODE WORKDIR KINDS [OPTIMIZER]

Run with an interpreter that has megatron-core installed and this repository on PYTHONPATH
(so `import dist_checkpointing` is ours and `import megatron.core` is megatron's). KINDS is a
comma-separated subset of `dense,moe`. For each kind a GPTModel (local layer spec,
`use_cpu_initialization=True`, TP=2) takes one Adam step; its sharded state dict (model plus
optimizer state) is then saved and loaded. OPTIMIZER says how the optimizer state is built:
- `adam` (default): a `torch.optim.Adam`, its state made sharded with the
  `dist_checkpointing.optimizer` helpers, as megatron's optimizer wrappers do;
- `fp32`: megatron's own `FP32Optimizer` around that Adam, stepped with `FP32Optimizer.step()`
  and asked for `sharded_state_dict(model_sd, is_loading=...)` (its shared `common_step`
  included). It allocates a CUDA tensor in `__init__`, so this needs a GPU: both ranks use
  `cuda:0` and still talk over gloo; the model and optimizer tensors stay on the CPU. Every
  loaded optimizer state is also handed to `FP32Optimizer.load_state_dict` and the result
  (`state_dict()`, per-parameter steps restored) compared with megatron's too.

Modes:
- `megatron`: megatron's objects handed to our functions. Megatron saves `WORKDIR/<kind>/mc`,
  we save the same objects to `WORKDIR/<kind>/ours_objects`; megatron's own loads of `mc`
  at TP=2 and TP=1 (resharded) are the reference (written to `ref_tp*.pt`); we load `mc`, and
  megatron and we load `ours_objects`, at both TP sizes.
- `installed`: `dist_checkpointing.megatron_compat.install()` first, so megatron's model code
  builds our objects and `megatron.core.dist_checkpointing.save/load` are ours. We save
  `WORKDIR/<kind>/ours_installed` and load it and `mc` at both TP sizes.
- `megatron_load`: megatron (real) loads `ours_installed` at both TP sizes.

Every loaded tree is compared leaf by leaf with the reference: tensors with `torch.equal`,
other values with `==`. Each rank writes `WORKDIR/result.<rank>.json` holding
`{check name: "ok" | failure description}`.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from typing import Any, Dict, List, Tuple

TP_SIZES = (2, 1)
OPTIMIZERS = ("adam", "fp32")
#: set from the command line (module-level: spawned ranks re-read it from their arguments)
OPTIMIZER = "adam"


def flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    """Leaves of a nested dict/list by key path; tensors cloned (loads write in place)."""
    import torch

    out: Dict[str, Any] = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for k, v in items:
        path = f"{prefix}/{k}"
        if isinstance(v, (dict, list)):
            out.update(flatten(v, path))
        else:
            out[path] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return out


def compare(got: Dict[str, Any], ref: Dict[str, Any]) -> str:
    """'ok', or what differs."""
    import torch

    if got.keys() != ref.keys():
        return f"keys differ: only got {sorted(got.keys() - ref.keys())[:5]}, only ref {sorted(ref.keys() - got.keys())[:5]}"
    bad: List[str] = []
    for k, r in ref.items():
        g = got[k]
        if isinstance(r, torch.Tensor):
            same = isinstance(g, torch.Tensor) and g.dtype == r.dtype and torch.equal(g, r)
        else:
            same = type(g) is type(r) and g == r
        if not same:
            bad.append(k)
    return "ok" if not bad else f"{len(bad)} of {len(ref)} leaves differ: {bad[:5]}"


def build(kind: str, tp: int, seed: int) -> Tuple[Any, Any]:
    """A GPTModel at tensor parallel size `tp` and an Adam optimizer after one step."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    moe = kind == "moe"
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        num_moe_experts=4 if moe else None,
        moe_router_topk=2 if moe else 2,
        moe_grouped_gemm=False,
        add_bias_linear=not moe,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(num_experts=4 if moe else None),
        vocab_size=64,
        max_sequence_length=16,
    )
    if OPTIMIZER == "fp32":
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer.optimizer import FP32Optimizer

        # megatron's param-group identifiers: FP32Optimizer.load_state_dict matches on them
        group = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False}
        adam = torch.optim.Adam(
            [{"params": list(model.parameters()), **group, "is_decoupled_lr": False}], lr=1e-2
        )
        # clip_grad=0: no gradient-norm reduction (it is not what this test is about)
        config = OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0)
        optim: Any = FP32Optimizer(adam, config, _init_adam_state)
    else:
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss = sum(
        (p.float() * torch.linspace(-1, 1, p.numel()).view_as(p)).sum() for p in model.parameters()
    )
    loss.backward()
    optim.step()
    return model, optim


def _init_adam_state(adam: Any, config: Any = None) -> None:
    """Adam state for parameters without any (FP32Optimizer calls this before loading)."""
    import torch

    for group in adam.param_groups:
        for p in group["params"]:
            if not adam.state[p]:
                adam.state[p]["exp_avg"] = torch.zeros_like(p.data)
                adam.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)


def sharded_state(
    model: Any, optim: Any, dc_optimizer: Any, is_loading: bool = False
) -> Dict[str, Any]:
    """Model + optimizer sharded state dict, built as megatron's optimizer wrappers do.

    With `OPTIMIZER == "fp32"`, `optim` is megatron's FP32Optimizer and builds its own part.
    """
    model_sd = model.sharded_state_dict()
    if OPTIMIZER == "fp32":
        optim_sd = optim.sharded_state_dict(model_sd, is_loading=is_loading)
        return {"model": model_sd, "optimizer": optim_sd, "iteration": 7}
    params = [p for group in optim.param_groups for p in group["params"]]
    id_map = dc_optimizer.get_param_id_to_sharded_param_map(model_sd, params)
    optim_sd = optim.state_dict()
    dc_optimizer.optim_state_to_sharding_state(optim_sd, id_map, exclude_keys="step")
    return {"model": model_sd, "optimizer": optim_sd, "iteration": 7}


_TARGETS: Dict[Tuple[str, int], Tuple[Any, Any]] = {}


def _reinit_parallel_state(tp: int) -> None:
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() != tp:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


def request(kind: str, tp: int, dc_optimizer: Any) -> Dict[str, Any]:
    """A load request at TP=`tp` whose destination tensors hold a sentinel (not the saved values)."""
    import torch

    from dist_checkpointing.dict_utils import nested_values as our_nested_values

    if (kind, tp) not in _TARGETS:
        _TARGETS.clear()  # one model at a time: building one resets the parallel state
        _TARGETS[(kind, tp)] = build(kind, tp, seed=1000 + tp)
    else:
        _reinit_parallel_state(tp)
    model, optim = _TARGETS[(kind, tp)]
    sd = sharded_state(model, optim, dc_optimizer, is_loading=True)
    for leaf in our_nested_values(sd):
        data = getattr(leaf, "data", None)
        if isinstance(data, torch.Tensor) and hasattr(leaf, "global_shape"):
            with torch.no_grad():
                data.fill_(-7)
    return sd


def observe(kind: str, tp: int, loaded: Dict[str, Any]) -> Dict[str, Any]:
    """What is compared after a load at TP=`tp`: the loaded tree's leaves, and with
    `OPTIMIZER == "fp32"` also megatron's FP32Optimizer state after `load_state_dict` of it."""
    out = flatten(loaded)
    if OPTIMIZER == "fp32":
        _model, optim = _TARGETS[(kind, tp)]
        optim.load_state_dict(copy.deepcopy(loaded["optimizer"]))
        out.update(flatten(optim.state_dict(), "/applied"))
    return out


def worker(
    rank: int, world: int, port: int, mode: str, workdir: str, kinds: List[str], optimizer: str
) -> None:
    global OPTIMIZER
    OPTIMIZER = optimizer
    import torch
    import torch.distributed as dist

    if OPTIMIZER == "fp32" and torch.cuda.is_available():
        # FP32Optimizer's own CUDA tensor: every rank shares the one GPU (no NCCL involved)
        torch.cuda.set_device(0)
    # megatron-core calls these on CPU paths (see the interop tests' README notes); in
    # this test process only, never in the library
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    if mode == "installed":
        from dist_checkpointing import megatron_compat

        megatron_compat.install()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing import optimizer as m_optimizer

    import dist_checkpointing as ours

    results: Dict[str, str] = {}

    def check(name: str, fn: Any) -> None:
        try:
            results[name] = fn()
        except Exception as e:  # recorded and reported by the test
            import traceback

            results[name] = f"raised {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"

    for kind in kinds:
        base = os.path.join(workdir, kind)
        mc, ours_objects, ours_installed = (
            os.path.join(base, n) for n in ("mc", "ours_objects", "ours_installed")
        )
        if rank == 0:
            os.makedirs(base, exist_ok=True)
        dist.barrier()
        if mode == "installed":
            # megatron's model code built our objects through the alias
            model, optim = build(kind, 2, seed=1)
            sd = sharded_state(model, optim, m_optimizer)
            if OPTIMIZER == "fp32":
                results[f"{kind}: optimizer state built by megatron's FP32Optimizer"] = (
                    "ok"
                    if type(optim).__name__ == "FP32Optimizer"
                    and "common_step" in sd["optimizer"]["state"]
                    else f"got {type(optim).__name__}, {sorted(sd['optimizer']['state'])[:3]}"
                )
            leaf = next(v for v in sd["model"].values() if hasattr(v, "global_shape"))
            results[f"{kind}: model code builds our ShardedTensor"] = (
                "ok"
                if type(leaf).__module__ == "dist_checkpointing.mapping" and mdc.save is ours.save
                else f"got {type(leaf).__module__}"
            )
            check(
                f"{kind}: installed save",
                lambda sd=sd, path=ours_installed: (mdc.save(sd, path), "ok")[1],
            )
            loads = {"mc": mc, "ours_installed": ours_installed}
            loader = mdc.load  # ours, through the alias
        elif mode == "megatron":
            model, optim = build(kind, 2, seed=1)
            sd = sharded_state(model, optim, m_optimizer)
            if OPTIMIZER == "fp32":
                results[f"{kind}: optimizer state built by megatron's FP32Optimizer"] = (
                    "ok"
                    if type(optim).__name__ == "FP32Optimizer"
                    and "common_step" in sd["optimizer"]["state"]
                    else f"got {type(optim).__name__}, {sorted(sd['optimizer']['state'])[:3]}"
                )
            if rank == 0:
                os.makedirs(mc, exist_ok=True)
            dist.barrier()
            mdc.save(sd, mc)
            # megatron's save reshapes data in place: hand ours a fresh state dict
            _reinit_parallel_state(2)
            sd = sharded_state(model, optim, m_optimizer)
            check(
                f"{kind}: our save of megatron objects",
                lambda sd=sd, path=ours_objects: (ours.save(sd, path), "ok")[1],
            )
            for tp in TP_SIZES:
                ref = observe(kind, tp, mdc.load(request(kind, tp, m_optimizer), mc))
                torch.save(ref, os.path.join(base, f"ref_tp{tp}.{rank}.pt"))
                untouched = [
                    k
                    for k, v in ref.items()
                    if isinstance(v, torch.Tensor) and bool((v == -7).all())
                ]
                results[f"{kind}: megatron's reference load at tp{tp} filled every tensor"] = (
                    "ok" if not untouched and len(ref) > 50 else f"sentinel left in {untouched[:5]}"
                )
            loads = {"mc": mc, "ours_objects": ours_objects}
            loader = None
        else:  # megatron_load
            loads = {"ours_installed": ours_installed}
            loader = mdc.load
        for name, path in loads.items():
            for tp in TP_SIZES:
                ref = torch.load(os.path.join(base, f"ref_tp{tp}.{rank}.pt"), weights_only=False)
                if mode == "megatron":
                    # ours loads megatron's objects; megatron loads what we saved
                    fns = (
                        {"ours": ours.load}
                        if name == "mc"
                        else {"ours": ours.load, "megatron": mdc.load}
                    )
                else:
                    fns = {"ours" if mode == "installed" else "megatron": loader}
                for who, fn in fns.items():
                    check(
                        f"{kind}: {who} loads {name} at tp{tp}",
                        lambda fn=fn, path=path, tp=tp, ref=ref, kind=kind: compare(
                            observe(kind, tp, fn(request(kind, tp, m_optimizer), path)), ref
                        ),
                    )
    with open(os.path.join(workdir, f"result.{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from _side_spawn import spawn_two

    mode, workdir, kinds = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    optimizer = sys.argv[4] if len(sys.argv) > 4 else "adam"
    assert optimizer in OPTIMIZERS, optimizer
    spawn_two(worker, mode, workdir, kinds, optimizer)
