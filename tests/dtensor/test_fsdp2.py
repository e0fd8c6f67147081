"""FSDP2 (`fully_shard`) state dicts from DCP's `get_state_dict(model, optimizer)` saved and
loaded as they are, on real gloo worlds: bit for bit at the same mesh, at other world sizes
(2 -> 1, 2 -> 4), on a 2-D HSDP mesh and under FSDP over tensor parallelism, through
`set_state_dict`; through async save, the fully parallel wrappers, the ('local', N) backend
and the CheckpointManager; and the leaves that cannot be placed refused on every rank within
seconds instead of hanging."""

from __future__ import annotations

import pytest

from tests.dtensor import _fns

pytestmark = pytest.mark.timeout(300)


def test_fsdp2_state_dict_round_trips_bitwise_at_the_same_mesh(world_factory, tmp_path):
    got = world_factory(2).run_ok(_fns.save_and_load_same, str(tmp_path / "c"), timeout=120)
    # and the ranks' equal `step` tensors are not gathered for a comparison of common state
    assert got == [([], 0), ([], 0)]


def test_fsdp2_state_dict_loads_bitwise_at_other_world_sizes_and_meshes(world_factory, tmp_path):
    ckpt = str(tmp_path / "c2")
    want = world_factory(2).run_ok(_fns.save_trained, (2,), ckpt, timeout=120)[0]
    for got in world_factory(1).run_ok(_fns.load_into, (1,), ckpt, timeout=120):
        assert _fns.same_values(want, got) == []
    world4 = world_factory(4)
    for mesh, tp in (((4,), False), ((2, 2), False), ((2, 2), True)):
        for got in world4.run_ok(_fns.load_into, mesh, ckpt, tp, timeout=120):
            assert _fns.same_values(want, got) == [], (mesh, tp)
    # HSDP (Replicate, Shard) and FSDP over TP (_StridedShard) layouts saved, loaded on 2 ranks
    for mesh, tp in (((2, 2), False), ((2, 2), True)):
        ckpt = str(tmp_path / f"c4-{tp}")
        want = world4.run_ok(_fns.save_trained, mesh, ckpt, tp, timeout=120)[0]
        for got in world_factory(2).run_ok(_fns.load_into, (2,), ckpt, timeout=120):
            assert _fns.same_values(want, got) == [], (mesh, tp)


def test_fsdp2_state_dict_round_trips_through_async_fully_parallel_local_and_manager(
    world_factory, tmp_path
):
    for got in world_factory(2).run_ok(_fns.wrappers, str(tmp_path), timeout=180):
        assert got == {name: [] for name in ("async", "fully_parallel", "local", "manager")}


@pytest.mark.parametrize(
    "case, phrase",
    [
        ("subclass", "Cannot place 'odd'"),
        ("per_rank_tensor", "plain tensors differ between ranks: ['step']"),
        ("partial", "DTensor 'p' has a Partial placement"),
        ("tuple", "Cannot place 't.0'"),
    ],
)
def test_unplaceable_leaves_are_refused_on_every_rank_within_seconds(
    world_factory, tmp_path, case, phrase
):
    outcomes = world_factory(2).run_ok(_fns.refusal, case, str(tmp_path), timeout=60)
    for text, seconds in outcomes:
        assert phrase in text, text
        assert seconds < 15, seconds


def test_stateful_objects_dtensor_lists_and_plain_values_load_as_dcp_loads_them(
    world_factory, tmp_path
):
    for got in world_factory(2).run_ok(_fns.stateful_lists_and_plain, str(tmp_path), timeout=120):
        assert got["stateful_returned"] and got["stateful"] == []
        assert got["list"] and got["plain_in_place"] and got["plain_into_dtensor"]
        assert "not in the checkpoint" in got["missing"] and "'lr'" in got["missing"]
        assert "Cannot place 'odd'" in got["odd_request"]
        assert "The list at 'mixed' holds DTensors and plain values" in got["mixed"]


def test_fsdp2_model_and_adam_cross_between_stock_dcp_and_us_through_set_state_dict(
    world_factory, tmp_path
):
    from tests.dtensor import _stock_fns

    for bad in world_factory(2).run_ok(_stock_fns.both_ways, str(tmp_path), timeout=120):
        assert bad == {"stock -> ours": [], "ours -> stock": []}
