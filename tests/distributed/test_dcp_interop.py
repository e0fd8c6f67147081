"""Stock PyTorch DCP both ways, on 2 gloo ranks: a checkpoint written by `dcp.save` loads
through our entry points (resharded, bit-exact, its non-tensor values where the state has
them), and stock `dcp.load` restores everything in ours, non-tensor values included."""

from __future__ import annotations

import pytest
import torch

from tests._sharding import bitwise_equal
from tests.distributed import _dcp_fns as fns

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def world(world_factory):
    return world_factory(fns.WORLD)


def _check_loaded(result, rank):
    full = fns.full_tensors()
    loaded = result["loaded"]
    assert bitwise_equal(loaded["model"]["w"], full["model.w"][:, 2 * rank : 2 * rank + 2])
    assert bitwise_equal(loaded["model"]["b"], full["model.b"])
    moments = loaded["optim"]["state"]["model.w"]
    assert bitwise_equal(moments["exp_avg"], full["optim.state.model.w.exp_avg"])
    assert bitwise_equal(moments["step"], full["optim.state.model.w.step"])
    plain = fns.plain_values()
    assert loaded["step"] == plain["step"]
    assert loaded["optim"]["param_groups"] == plain["optim"]["param_groups"]
    assert loaded["meta"] == plain["meta"]


def test_stock_dcp_checkpoint_loads_resharded_with_its_plain_values(world, tmp_path, caplog):
    ckpt = str(tmp_path / "dcp")
    world.run_ok(fns.save_stock, ckpt)
    for rank, result in enumerate(world.run_ok(fns.load_ours, ckpt, True)):
        _check_loaded(result, rank)
        full = fns.full_tensors()
        assert result["tensors"] == {k: (tuple(v.shape), v.dtype) for k, v in full.items()}
        assert result["sharded"] == sorted(full)  # its byte items are values, not objects
        assert result["common"] == fns.plain_values()  # nested as planner_data records
        assert result["is_checkpoint"]


@pytest.mark.parametrize("how", ["sync", "async", "fully_parallel"])
def test_stock_dcp_load_restores_every_value_of_our_checkpoint(world, tmp_path, how):
    ckpt = str(tmp_path / "ours")
    world.run_ok(fns.save_ours, ckpt, how)
    full = fns.full_tensors()
    for state in world.run_ok(fns.load_stock, ckpt):
        assert bitwise_equal(state["model"]["w"], full["model.w"])
        assert bitwise_equal(state["model"]["b"], full["model.b"])
        moments = state["optim"]["state"]["model.w"]
        assert bitwise_equal(moments["exp_avg"], full["optim.state.model.w.exp_avg"])
        assert bitwise_equal(moments["step"], full["optim.state.model.w.step"])
        plain = fns.plain_values()
        assert state["step"] == plain["step"]
        assert state["optim"]["param_groups"] == plain["optim"]["param_groups"]
        assert state["meta"] == plain["meta"]
    # and we still read it as before: tensors and the common state from common.pt
    for rank, result in enumerate(world.run_ok(fns.load_ours, ckpt, False)):
        _check_loaded(result, rank)
        # the plain tensor is recorded for DCP readers; for us it is common state
        assert set(result["tensors"]) == set(full) - {"optim.state.model.w.step"}
        assert result["sharded"] == sorted(result["tensors"])
        common = result["common"]
        assert bitwise_equal(common["optim"]["state"]["model.w"]["step"], torch.tensor(12.0))


def test_plain_value_named_like_another_ranks_tensor_is_refused_on_every_rank(world, tmp_path):
    ckpt = str(tmp_path / "clash")
    outcomes = world.run(fns.save_colliding, ckpt)
    for outcome in outcomes:
        assert outcome.error is not None, outcome
        assert "'plain.x'" in str(outcome.error) and "plain value" in str(outcome.error)
