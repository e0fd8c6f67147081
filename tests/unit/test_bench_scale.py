"""`bench_scale`'s layouts describe valid shardings, and its runner never hangs."""

from __future__ import annotations

import math
import sys
from collections import defaultdict

import pytest

from benchmarks.bench_scale import _run_capped
from benchmarks.scale_layouts import LAYOUTS, make_layout


def _records_by_key(layout):
    by_key = defaultdict(list)
    for r in range(layout.world):
        for rec in layout.iter_records(r):
            by_key[rec.key].append((r, rec))
    return by_key


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("ranks", [64, 256])
def test_layout_main_replicas_tile_each_global_shape_exactly_once(name, ranks):
    layout = make_layout(name, ranks)
    for key, entries in _records_by_key(layout).items():
        global_shape = entries[0][1].global_shape
        mains = set()
        for r, rec in entries:
            assert rec.global_shape == global_shape, (key, r)
            assert len(rec.global_offset) == len(rec.local_shape) == len(global_shape)
            for off, size, full in zip(rec.global_offset, rec.local_shape, global_shape):
                assert 0 <= off and off + size <= full and off % size == 0, (key, r, rec)
            if rec.is_main_replica:
                box = (rec.global_offset, rec.local_shape)
                assert box not in mains, f"{key}: chunk {box} has two main replicas"
                mains.add(box)
        assert sum(math.prod(s) for _, s in mains) == math.prod(global_shape), key
        # every replica copies a chunk that has a main replica
        assert {(rec.global_offset, rec.local_shape) for _, rec in entries} == mains, key


@pytest.mark.parametrize("rank", [0, 1, 8, 8191, 16383])
def test_gpt_layout_has_about_300_entries_per_rank_at_16384(rank):
    layout = make_layout("tp8-pp16-dp128", 16384)
    assert (layout.tp, layout.pp, layout.dp) == (8, 16, 128)
    assert 280 <= len(layout.rank_records(rank)) <= 310


def test_moe_layout_splits_expert_keys_over_the_expert_parallel_group():
    layout = make_layout("moe-tp4-pp8-ep8-dp512", 256)  # tp4 pp8 dp8, ep8
    assert layout.ep == 8 and layout.num_experts == 8 * layout.local_experts
    key = "model.decoder.layers.mlp.experts.linear_fc1.weight"
    held = {}
    for dp_rank in range(layout.dp):  # tp 0, pp 0: one rank per EP rank
        rank = layout.tp * dp_rank
        experts = {rec.global_offset[1] for rec in layout.iter_records(rank) if rec.key == key}
        assert len(experts) == layout.local_experts
        held[dp_rank] = experts
    assert all(held[a].isdisjoint(held[b]) for a in held for b in held if a < b)
    assert set().union(*held.values()) == set(range(layout.num_experts))


def test_layout_rejects_a_world_that_does_not_fit():
    with pytest.raises(ValueError, match="multiple of TP"):
        make_layout("tp8-pp16-dp128", 12)


def test_runner_reports_a_timeout_instead_of_hanging():
    out = _run_capped([sys.executable, "-c", "import time; time.sleep(60)"], 1.0, 2**34)
    assert out["timed_out"] is True and out["wall_s"] < 30


def test_runner_keeps_the_last_partial_result_of_a_failed_child():
    code = "import json; print(json.dumps({'partial': {'x': 1}}), flush=True); raise SystemExit(3)"
    out = _run_capped([sys.executable, "-c", code], 30.0, 2**34)
    assert out["x"] == 1 and out["timed_out"] is False and "exit 3" in out["error"]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_dcp_peer_plans_a_small_layout_and_keeps_one_chunk_per_main_replica(name):
    from benchmarks import scale_dcp

    layout = make_layout(name, 32)
    partials = []
    out = scale_dcp.run(layout, partials.append)  # DCP's own global-plan validation passes
    mains = {
        (rec.key, rec.global_offset)
        for r in range(layout.world)
        for rec in layout.iter_records(r)
        if rec.is_main_replica
    }
    assert out["unique_chunks"] == len(mains)
    assert out["max_recv_bytes"] >= out["gather_pickled_bytes"] > 0
    assert out["warm_max_recv_bytes"] < out["max_recv_bytes"]
    assert out["load_open_plan_s"] > 0 and partials
