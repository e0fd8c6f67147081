"""Pure parts of local checkpointing: cliques, retrieval plans, byte images, tensor-aware dicts."""

from __future__ import annotations

import io
import pickle
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_checkpointing.errors import (
    CheckpointCorruptedError,
    CheckpointingException,
    UnsafeCheckpointError,
)
from dist_checkpointing.local._image import decode_image, finish_image, start_image
from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
from dist_checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
from dist_checkpointing.local.replication.strategies import (
    NoReplicasAvailableError,
    ReplicationStrategy,
    clique_ranks,
    plan_retrieval,
)


def test_cliques_follow_jump_and_factor():
    assert clique_ranks(32, 8, 2)[:3] == [[0, 8], [1, 9], [2, 10]]
    assert clique_ranks(32, 8, 2)[8] == [16, 24]
    assert clique_ranks(4, 1, 2) == [[0, 1], [2, 3]]
    assert clique_ranks(4, 2, 2) == [[0, 2], [1, 3]]
    assert clique_ranks(6, 1, 3) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(CheckpointingException, match="not divisible"):
        clique_ranks(6, 2, 2)
    with pytest.raises(CheckpointingException, match="replication_factor"):
        clique_ranks(4, 1, 0)


@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 3))
def test_cliques_partition_the_world(jump, factor, blocks):
    world = jump * factor * blocks
    cliques = clique_ranks(world, jump, factor)
    assert sorted(r for c in cliques for r in c) == list(range(world))
    assert all(len(c) == factor and all(b - a == jump for a, b in zip(c, c[1:])) for c in cliques)


def test_retrieval_plan_prefers_own_copy_and_balances_senders():
    ids = {r: (7, r, "") for r in range(4)}
    available = {0: [ids[0], ids[1]], 1: [], 2: [ids[2], ids[3], ids[1]], 3: [ids[3]]}
    plan = plan_retrieval(available, {r: [ids[r]] for r in range(4)})
    assert (0, 0, ids[0]) in plan.transfers and (3, 3, ids[3]) in plan.transfers
    # rank 1 lost its part: the least loaded holder sends it
    assert [t for t in plan.transfers if t[1] == 1] == [(0, 1, ids[1])]
    with pytest.raises(NoReplicasAvailableError, match="iteration 7, rank 1"):
        plan_retrieval({0: [ids[0]], 1: []}, {0: [ids[0]], 1: [ids[1]]})


def _state():
    return BasicTensorAwareStateDict(
        {
            "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "nested": [torch.ones(2, dtype=torch.bfloat16), {"k": torch.tensor(True)}, "text"],
            "n": 5,
        }
    )


def test_image_round_trip_restores_values_and_leaves_the_source_intact():
    sd = _state()
    image = finish_image(start_image(sd, (1, 0, "s"), sd.tensor_names()))
    assert not sd.is_hollow
    ckpt_id, back = decode_image(image.buffer, "mem")
    assert ckpt_id == (1, 0, "s")
    assert all(torch.equal(x, y) for x, y in zip(back.tensors, sd.tensors))
    assert back.state_dict["n"] == 5 and back.state_dict["nested"][2] == "text"


def test_image_corruption_names_the_tensor_and_range():
    sd = _state()
    image = finish_image(start_image(sd, (1, 0, "s"), sd.tensor_names()))
    image.buffer[5] ^= 0xFF  # inside tensor "a"
    with pytest.raises(CheckpointCorruptedError, match=r"tensor a \(bytes 0-48\)"):
        decode_image(image.buffer, "mem")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_damaged_images_raise_checkpointing_errors_only(data):
    """Damage is either detected (a CheckpointingException) or harmless (alignment padding):
    never another exception, never a wrong value."""
    sd = _state()
    raw = finish_image(start_image(sd, (1, 0, "s"))).buffer.clone()
    kind = data.draw(st.sampled_from(["truncate", "flip", "garbage"]))
    if kind == "truncate":
        raw = raw[: data.draw(st.integers(0, raw.numel() - 1))].clone()
    elif kind == "flip":
        pos = data.draw(st.integers(0, raw.numel() - 1))
        raw[pos] ^= 1 << data.draw(st.integers(0, 7))
    else:
        raw = torch.frombuffer(
            bytearray(data.draw(st.binary(max_size=300))) or bytearray(1), dtype=torch.uint8
        )
    try:
        _, back = decode_image(raw, "mem")
    except CheckpointingException:
        return
    assert all(torch.equal(x, y) for x, y in zip(back.tensors, sd.tensors))
    assert back.state_dict["n"] == 5 and back.state_dict["nested"][2] == "text"


def test_planted_header_pickle_does_not_run(monkeypatch):
    import dist_checkpointing.local._image as image_mod

    ran = []

    class Evil:
        def __reduce__(self):
            return (ran.append, ("ran",))

    real_save = torch.save

    def evil_save(obj, f):
        # what an attacker could write: a header whose pickle calls a function
        f.write(pickle.dumps(Evil(), protocol=2)) if isinstance(f, io.BytesIO) else real_save(
            obj, f
        )

    monkeypatch.setattr(image_mod.torch, "save", evil_save)
    image = finish_image(start_image(_state(), (1, 0, "s")))
    monkeypatch.setattr(image_mod.torch, "save", real_save)
    with pytest.raises((UnsafeCheckpointError, CheckpointCorruptedError)):
        decode_image(image.buffer, "mem")
    assert ran == []


def test_basic_state_dict_pop_insert_and_errors():
    sd = _state()
    tensors = sd.pop_tensors()
    assert sd.is_hollow and len(tensors) == 3
    with pytest.raises(CheckpointingException, match="hollow"):
        sd.pop_tensors()
    with pytest.raises(CheckpointingException, match="expected"):
        sd.insert_tensors([torch.zeros(2), tensors[1], tensors[2]])
    sd.insert_tensors(tensors)
    assert sd.tensor_names() == ["a", "nested/0", "nested/1/k"]
    sd.copy_tensors_to_cpu()  # a snapshot: later changes to the originals do not reach it
    tensors[0].add_(1)
    assert not torch.equal(sd.tensors[0], tensors[0])
    sd.restore_tensor_device()
    hollow = _state()
    hollow.pop_tensors()
    hollow.init_tensors()
    assert [t.shape for t in hollow.tensors] == [t.shape for t in tensors]
    with pytest.raises(CheckpointingException, match="dict or list"):
        BasicTensorAwareStateDict(torch.zeros(1))


class _RecordingReplication(ReplicationStrategy):
    """Keeps a fake copy of a part 'from rank 9', and records what the manager calls."""

    def __init__(self) -> None:
        self.calls: list = []

    def prepare(self) -> None:
        self.calls.append(("prepare", threading.current_thread().name))

    def replicate_images(self, image, id_):
        self.calls.append(("replicate_images", threading.current_thread().name))
        return [((id_[0], 9, id_[2]), image.clone())]


def test_replication_strategy_must_implement_replicate_images():
    class Incomplete(ReplicationStrategy):
        pass

    with pytest.raises(TypeError, match="replicate_images"):
        Incomplete()  # type: ignore[abstract]


def test_manager_calls_prepare_in_caller_then_replicate_images_in_background(tmp_path):
    repl = _RecordingReplication()
    manager = LocalCheckpointManager(tmp_path, "s", repl)
    manager.save(_state(), 3)
    caller = threading.current_thread().name
    assert [name for name, _ in repl.calls] == ["prepare", "replicate_images"]
    assert repl.calls[0][1] == caller and repl.calls[1][1] != caller
    assert sorted(i[1] for i in manager._my_ckpt_ids()) == [0, 9]
