"""Safe loading accepts the types real training state holds, and nothing that runs code.

Each accepted type (`dist_checkpointing._safe_load`) round-trips in the common state and
in ShardedObjects, on `torch_dist` and on local checkpoints; a malicious payload wrapped in
each of them is refused (`UnsafeCheckpointError` with the allowlisting hint) and never runs.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.errors import UnsafeCheckpointError
from dist_checkpointing.local._image import decode_image, finish_image, start_image
from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
from tests.strategies._safe_values import (
    MARKER_ENV,
    benign_values,
    malicious_values,
    same,
    save_and_load_values,
)

BENIGN = sorted(benign_values())
MALICIOUS = sorted(malicious_values())


@pytest.fixture
def marker(tmp_path, monkeypatch):
    path = tmp_path / "pwned"
    monkeypatch.setenv(MARKER_ENV, str(path))
    yield path
    assert not path.exists(), "a planted pickle ran"


def _torch_dist_round_trip(value: Any, ckpt: Any) -> Any:
    dc.save(
        {
            "w": ShardedTensor.from_rank_offsets("w", torch.ones(2)),
            "o": ShardedObject("o", value, (1,), (0,)),
            "common": value,
        },
        ckpt,
    )
    return dc.load({"o": ShardedObject("o", None, (1,), (0,))}, ckpt)


def _local_image_round_trip(value: Any) -> Any:
    state = BasicTensorAwareStateDict({"t": torch.arange(3.0), "value": value})
    image = finish_image(start_image(state, (1, 0, "s"), state.tensor_names()))
    return decode_image(image.buffer, "mem")[1]


@pytest.mark.parametrize("name", BENIGN)
def test_allowlisted_type_loads_from_common_state_and_sharded_object(name, tmp_path):
    value = benign_values()[name]
    loaded = _torch_dist_round_trip(value, tmp_path / "c")
    assert same(loaded["o"], value) and same(loaded["common"], value)
    assert same(dc.load_common_state_dict(tmp_path / "c")["common"], value)


@pytest.mark.parametrize("name", BENIGN)
def test_allowlisted_type_loads_from_local_checkpoint_header(name):
    value = benign_values()[name]
    state = _local_image_round_trip(value)
    assert same(state["value"], value)


def test_allowlisted_types_load_even_after_the_user_clears_torch_allowlist(tmp_path):
    torch.serialization.clear_safe_globals()
    loaded = _torch_dist_round_trip(benign_values()["namespace"], tmp_path / "c")
    assert same(loaded["common"], benign_values()["namespace"])


@pytest.mark.parametrize("backend", ["torch_dist", "local"])
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.timeout(240)
def test_allowlisted_types_round_trip_on_every_rank(backend, world_size, world_factory, tmp_path):
    results = world_factory(world_size).run_ok(
        save_and_load_values, str(tmp_path / "c"), backend, timeout=180
    )
    for rank, per_value in enumerate(results):
        assert per_value and all(per_value.values()), (rank, per_value)


@pytest.mark.parametrize("name", MALICIOUS)
def test_payload_wrapped_in_allowlisted_type_is_refused_in_torch_dist(name, tmp_path, marker):
    value = malicious_values()[name]
    ckpt = tmp_path / "c"
    dc.save(
        {
            "w": ShardedTensor.from_rank_offsets("w", torch.ones(2)),
            "o": ShardedObject("o", value, (1,), (0,)),
        },
        ckpt,
    )
    with pytest.raises(UnsafeCheckpointError, match="add_safe_globals") as e:
        dc.load({"o": ShardedObject("o", None, (1,), (0,))}, ckpt)
    assert "'o/shard_0_1'" in str(e.value)
    dc.save({"common": value}, tmp_path / "c2")
    with pytest.raises(UnsafeCheckpointError, match="add_safe_globals"):
        dc.load_common_state_dict(tmp_path / "c2")
    with pytest.raises(UnsafeCheckpointError, match="common.pt"):
        dc.load({}, tmp_path / "c2")


@pytest.mark.parametrize("name", MALICIOUS)
def test_payload_wrapped_in_allowlisted_type_is_refused_in_local_header(name, marker):
    with pytest.raises(UnsafeCheckpointError, match="add_safe_globals"):
        _local_image_round_trip(malicious_values()[name])


def test_refusal_names_what_was_refused(tmp_path, marker):
    dc.save({"common": malicious_values()["numpy_object_array"]}, tmp_path / "c")
    with pytest.raises(UnsafeCheckpointError, match="numpy dtype 'O8'"):
        dc.load_common_state_dict(tmp_path / "c")
    dc.save({"common": io.StringIO("text")}, tmp_path / "d")  # not allowlisted: refused
    with pytest.raises(UnsafeCheckpointError, match=r"_io.StringIO.*add_safe_globals"):
        dc.load_common_state_dict(tmp_path / "d")
