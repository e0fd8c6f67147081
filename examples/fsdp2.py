"""FSDP2: save a `fully_shard` model and its Adam state as DCP's `get_state_dict` gives
them, load them into a fresh model and optimizer, and check every value.

The second layer has 5 output rows, so its shards are uneven (3 + 2 rows on 2 ranks). The
state dict goes in as it is: DTensors, Adam's `step` tensors and `param_groups`.

    torchrun --standalone --nproc-per-node 2 examples/fsdp2.py [CKPT_ROOT]

Running it again reuses CKPT_ROOT (default: a temporary directory): the example removes its
old checkpoint first, because `save` never overwrites a complete checkpoint.
"""

from __future__ import annotations

import shutil

import torch
import torch.distributed as dist
from _output import output_dir  # examples/_output.py
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dist_checkpointing as dc


def build(seed: int) -> tuple:
    """A two-layer model under FSDP2 on all ranks, and Adam."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ckpt = output_dir("fsdp2") / "step_1"
    if rank == 0 and ckpt.exists():
        shutil.rmtree(ckpt)  # save() refuses to overwrite a complete checkpoint
    dist.barrier()

    model, optim = build(seed=0)
    model(torch.randn(4, 16)).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    dc.save({"model": msd, "optim": osd}, ckpt)  # collective: every rank calls it

    # a fresh model and optimizer (another world size or mesh loads the same way)
    model2, optim2 = build(seed=1)
    msd2, osd2 = get_state_dict(model2, optim2)
    loaded = dc.load({"model": msd2, "optim": osd2}, ckpt)  # DTensors filled in place
    set_state_dict(
        model2, optim2, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )

    after, after_optim = get_state_dict(model2, optim2)
    for name, value in msd.items():  # full_tensor() gathers: every rank calls it
        assert torch.equal(value.full_tensor(), after[name].full_tensor()), name
    for name, state in osd["state"].items():
        for k, v in state.items():
            got = after_optim["state"][name][k]
            v, got = (x.full_tensor() if hasattr(x, "full_tensor") else x for x in (v, got))
            assert torch.equal(v, got), (name, k)
    if rank == 0:
        print(f"saved and loaded the FSDP2 model and Adam state from {ckpt}: OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
