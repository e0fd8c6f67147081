"""One rank of FSDP2 on CUDA (NCCL for the model, gloo for the library): the whole
`get_state_dict(model, optimizer)` output saved sync and async, loaded into a fresh model
(bit for bit, then `set_state_dict`), and read back by stock `dcp.load`. Prints OK.

    python tests/dtensor/_fsdp2_cuda.py DIR
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dist_checkpointing as dc
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from tests.dtensor._fns import full_values, make_model, same_values


def _cuda_model(seed: int):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (1,))
    with torch.device("cuda"):
        model, optim = make_model(mesh, seed)
    torch.manual_seed(1234)
    model(torch.randn(3, 4, device="cuda")).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def main(root: str) -> None:
    dist.init_process_group(
        "cpu:gloo,cuda:nccl", init_method=f"file://{root}/store", rank=0, world_size=1
    )
    torch.cuda.set_device(0)
    model, optim = _cuda_model(0)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    want = full_values(state)
    assert msd and all(v.device.type == "cuda" for v in msd.values())
    dc.save(state, f"{root}/sync")
    queue = AsyncCallsQueue()
    queue.schedule_async_request(dc.save(state, f"{root}/async", async_sharded_save=True))
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    for name in ("sync", "async"):
        other, other_optim = _cuda_model(7)
        m2, o2 = get_state_dict(other, other_optim)
        loaded = dc.load({"model": m2, "optim": o2}, f"{root}/{name}")
        bad = same_values(want, full_values(loaded))
        assert bad == [], (name, bad)
        set_state_dict(
            other, other_optim, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
        )
        m3, o3 = get_state_dict(other, other_optim)
        assert same_values(want, full_values({"model": m3, "optim": o3})) == [], name
    other, other_optim = _cuda_model(9)
    m4, o4 = get_state_dict(other, other_optim)
    stock = {"model": m4, "optim": o4}
    dcp.load(stock, checkpoint_id=f"{root}/sync")
    assert same_values(want, full_values(stock)) == [], "stock dcp.load"
    dist.destroy_process_group()
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
