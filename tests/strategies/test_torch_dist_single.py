"""torch_dist features in a single process (no process group): format, safety, maintenance."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dist_checkpointing as dc
from dist_checkpointing import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from dist_checkpointing.core import CheckpointingConfig, save_config
from dist_checkpointing.errors import (
    CheckpointCorruptedError,
    CheckpointingException,
    UnsafeCheckpointError,
)
from dist_checkpointing.serialization import get_default_load_sharded_strategy
from dist_checkpointing.strategies.common import TorchCommonLoadStrategy
from dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)


class Payload:
    """A user class: not loadable under weights_only unless allowlisted."""

    def __init__(self, v):
        self.v = v


class Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/dist_ckpt_pwned",))


def _state():
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.arange(12.0).reshape(3, 4)),
        "stack": ShardedTensor.from_rank_offsets(
            "stack", torch.ones(2, 2, dtype=torch.bfloat16), (0, 0, 1), prepend_axis_num=1
        ),
        "opt": {"o": ShardedObject("opt/o", {"lr": 0.1, "t": torch.tensor([1, 2])}, (1,), (0,))},
        "step": 3,
        "tmp": LocalNonpersistentObject("not saved"),
    }


def test_round_trip_common_objects_prepend_and_content_metadata(tmp_path):
    sd = _state()
    dc.save(sd, tmp_path / "c", content_metadata={"format": 2})
    assert (
        isinstance(sd["tmp"], LocalNonpersistentObject) and "content_metadata" not in sd
    )  # caller's dict untouched
    request = _state()
    request["w"] = ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4))
    request["tmp"] = LocalNonpersistentObject("local")
    out = dc.load(request, tmp_path / "c")
    assert torch.equal(out["w"], torch.arange(12.0).reshape(3, 4))
    assert out["stack"].dtype == torch.bfloat16 and out["stack"].shape == (2, 2)
    assert out["opt"]["o"]["lr"] == 0.1 and torch.equal(out["opt"]["o"]["t"], torch.tensor([1, 2]))
    assert out["step"] == 3 and out["tmp"] == "local"
    assert dc.load_content_metadata(tmp_path / "c") == {"format": 2}
    assert dc.load_common_state_dict(tmp_path / "c")["step"] == 3
    assert dc.load_tensors_metadata(tmp_path / "c")["stack"].global_shape == (1, 2, 2)
    assert isinstance(
        get_default_load_sharded_strategy(tmp_path / "c"), TorchDistLoadShardedStrategy
    )


def test_factories_round_trip(tmp_path):
    def build(key, data, replica_id, flattened_range):
        return [
            ShardedTensor.from_rank_offsets(f"{key}.{i}", data[i], replica_id=replica_id)
            for i in range(2)
        ]

    def merge(parts):
        return torch.stack(parts)

    dc.save(
        {"f": ShardedTensorFactory("f", torch.arange(6.0).reshape(2, 3), build, merge)},
        tmp_path / "c",
    )
    out = dc.load({"f": ShardedTensorFactory("f", torch.zeros(2, 3), build, merge)}, tmp_path / "c")
    assert torch.equal(out["f"], torch.arange(6.0).reshape(2, 3))


def test_load_plain_tensors_returns_whole_tensors(tmp_path):
    dc.save(_state(), tmp_path / "c")
    plain = dc.load_plain_tensors(tmp_path / "c")
    assert set(plain) == {"w", "stack"}
    assert plain["stack"].shape == (1, 2, 2) and torch.equal(
        plain["w"], torch.arange(12.0).reshape(3, 4)
    )


def test_stock_dcp_reads_our_checkpoint(tmp_path):
    dc.save(_state(), tmp_path / "c")
    target = {"w": torch.zeros(3, 4), "stack": torch.zeros(1, 2, 2, dtype=torch.bfloat16)}
    dcp.load(target, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert torch.equal(target["w"], torch.arange(12.0).reshape(3, 4)) and bool(
        (target["stack"] == 1).all()
    )


def test_we_read_and_reshard_a_stock_dcp_checkpoint(tmp_path):
    full = torch.randn(6, 4)
    dcp.save({"w": full}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    out = dc.load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 4), (0, 1, 3))},
        tmp_path / "c",
        validate_access_integrity=False,
    )
    assert torch.equal(out["w"], full[2:4])


def test_separation_hint_and_remove_sharded_tensors(tmp_path):
    sd = {
        "model": ShardedTensor.from_rank_offsets("model.w", torch.ones(4)),
        "optim": ShardedTensor.from_rank_offsets("optimizer.m", torch.zeros(4)),
    }
    dc.save(
        sd,
        tmp_path / "c",
        sharded_strategy=TorchDistSaveShardedStrategy(separation_hint="optimizer."),
    )
    assert any(f.startswith("optimizer.__0_") for f in os.listdir(tmp_path / "c"))
    dc.remove_sharded_tensors(tmp_path / "c", "optimizer.")
    assert not any(f.startswith("optimizer.") for f in os.listdir(tmp_path / "c"))
    assert set(dc.load_tensors_metadata(tmp_path / "c")) == {"model.w"}
    out = dc.load(
        {"model": ShardedTensor.from_rank_offsets("model.w", torch.zeros(4))}, tmp_path / "c"
    )
    assert torch.equal(out["model"], torch.ones(4))
    with pytest.raises(CheckpointingException, match="separation_hint"):
        dc.remove_sharded_tensors(tmp_path / "c", "nothing.")


def test_dtype_conversion_and_shape_mismatch_handling(tmp_path, caplog):
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, tmp_path / "c")
    out = dc.load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, dtype=torch.float64))},
        tmp_path / "c",
    )
    assert out["w"].dtype == torch.float64 and "lossy" not in caplog.text  # exact widening
    with pytest.raises(CheckpointingException, match="Global shape mismatch for 'w'"):
        dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6))}, tmp_path / "c")
    padded = ShardedTensor.from_rank_offsets("w", torch.full((6,), -1.0), allow_shape_mismatch=True)
    out = dc.load({"w": padded}, tmp_path / "c")
    assert out["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 0.0, 0.0]  # zeros past the stored end


def test_saving_all_replicas_keeps_one_copy(tmp_path):
    sd = {
        "a": ShardedTensor.from_rank_offsets("w", torch.ones(2), replica_id=0),
        "b": ShardedTensor.from_rank_offsets("w", torch.ones(2), replica_id=1),
    }
    dc.save(
        sd,
        tmp_path / "c",
        sharded_strategy=TorchDistSaveShardedStrategy(keep_only_main_replica=False),
    )
    assert torch.equal(dc.load_plain_tensors(tmp_path / "c")["w"], torch.ones(2))


def test_unsafe_common_state_is_refused_unless_opted_in(tmp_path):
    dc.save(
        {"w": ShardedTensor.from_rank_offsets("w", torch.ones(1)), "p": Payload(5)}, tmp_path / "c"
    )
    with pytest.raises(UnsafeCheckpointError, match="add_safe_globals"):
        dc.load({}, tmp_path / "c")
    out = dc.load({}, tmp_path / "c", common_strategy=TorchCommonLoadStrategy(weights_only=False))
    assert out["p"].v == 5
    torch.serialization.add_safe_globals([Payload])
    try:
        assert dc.load({}, tmp_path / "c")["p"].v == 5
    finally:
        torch.serialization.clear_safe_globals()


def test_planted_pickles_never_run(tmp_path):
    marker = "/tmp/dist_ckpt_pwned"
    if os.path.exists(marker):
        os.remove(marker)
    dc.save(
        {
            "w": ShardedTensor.from_rank_offsets("w", torch.ones(1)),
            "o": ShardedObject("o", Evil(), (1,), (0,)),
        },
        tmp_path / "c",
    )
    with pytest.raises(UnsafeCheckpointError):
        dc.load({"o": ShardedObject("o", None, (1,), (0,))}, tmp_path / "c")
    torch.save({"x": Evil()}, tmp_path / "c" / "common.pt")
    # a replaced file fails its checksum first; without checksums.json the allowlist refuses it
    with pytest.raises(CheckpointCorruptedError, match="checksum"):
        dc.load_common_state_dict(tmp_path / "c")
    os.remove(tmp_path / "c" / "checksums.json")
    with pytest.raises(UnsafeCheckpointError):
        dc.load_common_state_dict(tmp_path / "c")
    with open(tmp_path / "c" / ".metadata", "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.raises(UnsafeCheckpointError, match="posix.system|os.system|refusing"):
        dc.load_tensors_metadata(tmp_path / "c")
    assert not os.path.exists(marker)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_damaged_dcp_metadata_is_corruption(tmp_path, damage):
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(3))}, tmp_path / "c")
    path = tmp_path / "c" / ".metadata"
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2] if damage == "truncate" else b"\x80\x04garbage")
    with pytest.raises(CheckpointCorruptedError, match=".metadata"):
        dc.load_tensors_metadata(tmp_path / "c")  # loads of given keys read the index instead


def test_truncated_data_file_is_corruption(tmp_path):
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(1000))}, tmp_path / "c")
    data = next(
        p for p in (tmp_path / "c").iterdir() if p.suffix == ".distcp" and p.stat().st_size > 0
    )
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointCorruptedError, match="truncated"):
        dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(1000))}, tmp_path / "c")


def test_finalize_recovers_when_coordinator_lost_its_plan_cache(tmp_path):
    strategy = TorchDistSaveShardedStrategy()

    def sd():
        return {"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}

    dc.save(sd(), tmp_path / "a", sharded_strategy=strategy)
    strategy._finalizer.reports.clear()  # e.g. rank 0 replaced its strategy object, others did not
    strategy._finalizer.files_cache = None
    dc.save(sd(), tmp_path / "b", sharded_strategy=strategy)
    assert torch.equal(dc.load_plain_tensors(tmp_path / "b")["w"], torch.arange(4.0))


def test_non_contiguous_chunks_from_other_writers_still_load(tmp_path):
    # stock DCP saves a transposed tensor with its strides; our direct reader must fall back
    full = torch.arange(24.0).reshape(4, 6).t()
    dcp.save({"w": full}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    torch.save({}, tmp_path / "c" / "common.pt")
    save_config(CheckpointingConfig("torch_dist", 1), tmp_path / "c")
    whole = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6, 4))}, tmp_path / "c")
    part = dc.load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6, 2), (1, 1, 2))},
        tmp_path / "c",
        validate_access_integrity=False,
    )
    assert torch.equal(whole["w"], full) and torch.equal(part["w"], full[:, 2:])


def test_our_chunks_take_the_direct_read_path(tmp_path):
    """Every tensor item we write is parsed without torch.load (a regression here costs 2x on loads)."""
    from dist_checkpointing.strategies.torch_dist.metadata_file import read_metadata
    from dist_checkpointing.strategies.torch_dist.reader import open_range
    from dist_checkpointing.strategies.torch_dist.zipformat import chunk_layout

    sd = {
        f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.ones(7, 5, dtype=dtype))
        for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.int64, torch.bool])
    }
    dc.save(sd, tmp_path / "c")
    md = read_metadata(tmp_path / "c")
    for index, info in md.storage_data.items():
        with open_range(tmp_path / "c" / info.relative_path, info) as stream:
            layout = chunk_layout(stream.raw)
        assert layout is not None and layout.shape == (7, 5), index.fqn


@pytest.mark.parametrize("offset,shape", [((0, 0), (4, 6)), ((1, 1), (2, 4)), ((3, 0), (1, 6))])
def test_megatron_013_flat_layout_loads_any_region_of_the_original_shape(tmp_path, offset, shape):
    """megatron-core <= 0.13's reformulated layout (here written by hand, without megatron):
    a (4, 6) tensor in (2, 2) pieces stored as (2, 3, 4), each cell's flat run in two chunks."""
    full = torch.arange(24.0).reshape(4, 6)
    cells = full.reshape(2, 2, 3, 2).permute(0, 2, 1, 3).reshape(2, 3, 4)
    sd = {
        f"{i}{j}{a}": ShardedTensor(
            "k",
            cells[i, j, a:b].reshape(1, 1, -1).clone(),
            torch.float32,
            (1, 1, b - a),
            (2, 3, 4),
            (i, j, a),
            None,
        )
        for i in range(2)
        for j in range(3)
        for a, b in [(0, 1), (1, 4)]
    }
    dc.save(sd, tmp_path, validate_access_integrity=False)
    md = pickle.loads((tmp_path / ".metadata").read_bytes())
    md.mcore_data = {"k": {"nd_reformulated_orig_global_shape": (4, 6)}}
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    (tmp_path / ".metadata.index").unlink()  # megatron writes none
    strategy = TorchDistLoadShardedStrategy(verify_checksums=False)  # .metadata was rewritten
    assert dc.load_tensors_metadata(tmp_path, strategy)["k"].global_shape == (4, 6)
    req = {"x": ShardedTensor("k", torch.zeros(shape), torch.float32, shape, (4, 6), offset, None)}
    got = dc.load(req, tmp_path, strategy, validate_access_integrity=False)["x"]
    assert torch.equal(
        got, full[offset[0] : offset[0] + shape[0], offset[1] : offset[1] + shape[1]]
    )
