"""Stock PyTorch DCP's side of our format, in one process: what our `.metadata` pickles (only
DCP's classes and plain values), `.metadata` of newer torch releases, stock DCP directories
that are not complete, the plain values we record for DCP readers, and the manager adopting
a stock DCP checkpoint."""

from __future__ import annotations

import enum
import io
import json
import pickle
from dataclasses import dataclass

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties

import dist_checkpointing as dc
from dist_checkpointing import CheckpointManager, CheckpointManagerOptions, ShardedObject
from dist_checkpointing.cli import main
from dist_checkpointing.errors import (
    CheckpointingException,
    NotACheckpointError,
    UnsafeCheckpointError,
)
from dist_checkpointing.mapping import ShardedTensor
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


class _DcpOnlyUnpickler(pickle.Unpickler):
    """What a restricted `.metadata` reader accepts: DCP's own classes, torch dtypes, sizes,
    layouts and memory formats, builtins; anything else is refused."""

    def find_class(self, module, name):
        if module.startswith("torch.distributed.checkpoint.") or module == "builtins":
            return super().find_class(module, name)
        if (module, name) in (("torch", "Size"), ("torch.serialization", "_get_layout")):
            return super().find_class(module, name)
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise pickle.UnpicklingError(f"not a DCP metadata global: {module}.{name}")


def _save_varied(ckpt):
    state = {
        "model": {
            "w": ShardedTensor.from_rank_offsets("model.w", torch.randn(4, 3)),
            "h": ShardedTensor.from_rank_offsets("model.h", torch.ones(2, dtype=torch.bfloat16)),
            "i": ShardedTensor.from_rank_offsets("model.i", torch.arange(3)),
            "s": ShardedTensor.from_rank_offsets("model.s", torch.tensor(2.0)),
        },
        "rng": ShardedObject("rng", {"seed": 1}, (1,), (0,)),
        "iteration": 9,
        "args": {"lr": 0.1, "betas": (0.9, 0.95), "name": None, "tags": ["a"]},
        "scale": torch.tensor([1.0, 2.0]),
        "groups": [{"params": ["model.w"], "lr": 1e-3}],
    }
    dc.save(state, ckpt, content_metadata={"format": "x"})
    return state


def test_our_metadata_pickles_only_dcp_classes_and_plain_values(tmp_path):
    _save_varied(tmp_path / "c")
    metadata = _DcpOnlyUnpickler(io.BytesIO((tmp_path / "c" / ".metadata").read_bytes())).load()
    assert isinstance(metadata, Metadata)
    assert metadata.planner_data["args.betas"] == ("args", "betas")
    assert metadata.planner_data["groups.0.params"] == ("groups", 0, "params")


def test_plain_values_are_recorded_where_stock_dcp_loads_them(tmp_path, capsys):
    saved = _save_varied(tmp_path / "c")
    target = {
        "model": {"w": torch.zeros(4, 3)},
        "iteration": 0,
        "args": {"lr": 0, "betas": 0, "name": 0, "tags": 0},
        "scale": torch.zeros(2),
        "groups": [{"params": 0, "lr": 0}],
        "content_metadata": {"format": ""},
    }
    dcp.load(target, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert torch.equal(target["model"]["w"], saved["model"]["w"].data)
    assert target["iteration"] == 9 and target["args"] == saved["args"]
    assert torch.equal(target["scale"], saved["scale"])
    assert target["groups"] == saved["groups"]
    assert target["content_metadata"] == {"format": "x"}
    # for us the plain values stay common state (common.pt), not tensors or objects
    assert set(dc.load_sharded_metadata(tmp_path / "c")) == {
        "model.w", "model.h", "model.i", "model.s", "rng/shard_0_1",
    }  # fmt: skip
    assert dc.load_common_state_dict(tmp_path / "c")["groups"] == saved["groups"]
    capsys.readouterr()
    assert main(["inspect", "--json", str(tmp_path / "c")]) == 0  # nor by the tools
    info = json.loads(capsys.readouterr().out)
    assert {t["key"] for t in info["tensors"]} == {"model.w", "model.h", "model.i", "model.s"}
    assert "args.betas" not in info["objects"] and "scale" in info["objects"]


def test_plain_values_are_not_recorded_when_the_strategy_says_so(tmp_path):
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2)), "step": 3}
    strategy = TorchDistSaveShardedStrategy(plain_values_for_dcp=False)
    dc.save(state, tmp_path / "c", sharded_strategy=strategy)
    stored = dcp.FileSystemReader(str(tmp_path / "c")).read_metadata().state_dict_metadata
    assert set(stored) == {"w"}
    assert dc.load_common_state_dict(tmp_path / "c") == {"step": 3}


@pytest.mark.parametrize(
    "state, name",
    [
        ({"a": {"b": 1}, "t": ShardedTensor.from_rank_offsets("a.b", torch.ones(2))}, "'a.b'"),
        ({"a.b": 1, "a": {"b": 2}}, "'a.b'"),
    ],
    ids=["plain value and tensor key", "two plain values"],
)
def test_a_flat_name_used_twice_is_refused_naming_it(tmp_path, state, name):
    with pytest.raises(CheckpointingException, match=name):
        dc.save(state, tmp_path / "c")
    assert not dc.check_is_distributed_checkpoint(tmp_path / "c")


def _with_newer_tensor_properties(path):
    """Rewrites a `.metadata` as torch releases after 2.14 pickle `TensorProperties`: six
    fields, `strides` last."""
    metadata = pickle.loads(path.read_bytes())
    five = TensorProperties.__getstate__

    def six(self):
        return (*five(self), (1,))

    TensorProperties.__getstate__ = six
    try:
        raw = pickle.dumps(metadata)
    finally:
        TensorProperties.__getstate__ = five
    with pytest.raises(ValueError):  # this torch's own reader refuses it
        pickle.loads(raw)
    path.write_bytes(raw)


def test_metadata_of_newer_torch_with_tensor_strides_is_read(tmp_path, capsys):
    ckpt = tmp_path / "c"
    full = torch.randn(6, 2)
    dcp.save({"w": full, "step": 4}, checkpoint_id=str(ckpt), no_dist=True)
    _with_newer_tensor_properties(ckpt / ".metadata")
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 2), (0, 1, 2))}
    out = dc.load(request, ckpt, validate_access_integrity=False)  # half of it, alone
    assert torch.equal(out["w"], full[3:]) and out["step"] == 4
    assert dc.load_tensors_metadata(ckpt)["w"].dtype == full.dtype
    assert main(["inspect", "--json", str(ckpt)]) == 0  # the tools' reader too
    assert [t["shape"] for t in json.loads(capsys.readouterr().out)["tensors"]] == [[6, 2]]


class _EnumsByName(pickle.Pickler):
    """Pickles as Python 3.12 (and 3.11.2) do: an Enum member as `getattr(EnumClass, name)`;
    `_Sneak` as `getattr(TensorProperties, '__init__')`, which no reader may follow."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        if isinstance(obj, _Sneak):
            return getattr, (TensorProperties, "__init__")
        return NotImplemented


class _Sneak:
    pass


def _repickle(path, **planner_data):
    metadata = pickle.loads(path.read_bytes())
    metadata.planner_data = {**(metadata.planner_data or {}), **planner_data}
    buf = io.BytesIO()
    _EnumsByName(buf).dump(metadata)
    assert b"getattr" in buf.getvalue()
    path.write_bytes(buf.getvalue())


def test_metadata_pickled_with_enums_by_name_is_read(tmp_path, capsys):
    ckpt = tmp_path / "c"
    full = torch.randn(6, 2)
    dcp.save({"w": full, "step": 4}, checkpoint_id=str(ckpt), no_dist=True)
    _repickle(ckpt / ".metadata")
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6, 2))}
    out = dc.load(request, ckpt, validate_access_integrity=False)
    assert torch.equal(out["w"], full) and out["step"] == 4
    assert main(["inspect", "--json", str(ckpt)]) == 0  # the tools' readers too
    assert [t["shape"] for t in json.loads(capsys.readouterr().out)["tensors"]] == [[6, 2]]


def test_getattr_in_metadata_reaches_nothing_but_enum_members(tmp_path):
    ckpt = tmp_path / "c"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(ckpt), no_dist=True)
    _repickle(ckpt / ".metadata", x=_Sneak())
    with pytest.raises(UnsafeCheckpointError, match=r"getattr\(\w+, '__init__'\)"):
        dc.load_tensors_metadata(ckpt)


def test_stock_dcp_directory_without_its_metadata_is_refused(tmp_path):
    ckpt = tmp_path / "c"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / ".metadata").unlink()  # as a save that did not finish leaves it
    assert not dc.check_is_distributed_checkpoint(ckpt)
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))}
    with pytest.raises(NotACheckpointError, match="no DCP .metadata"):
        dc.load(request, ckpt)
    with pytest.raises(NotACheckpointError, match="no DCP .metadata"):
        dc.load_common_state_dict(ckpt)


def test_stock_dcp_checkpoint_is_never_modified(tmp_path):
    ckpt = tmp_path / "c"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(ckpt), no_dist=True)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    with pytest.raises(CheckpointingException, match="stock PyTorch DCP"):
        dc.remove_sharded_tensors(ckpt, "__")
    with pytest.raises(CheckpointingException, match="complete checkpoint"):
        dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, ckpt)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before


@dataclass
class Recipe:
    """A value of a class no allowlist names."""

    name: str


def test_stock_dcp_value_outside_the_allowlist_is_refused_until_allowed(tmp_path):
    ckpt = tmp_path / "c"
    dcp.save({"w": torch.ones(2), "recipe": Recipe("x")}, checkpoint_id=str(ckpt), no_dist=True)
    with pytest.raises(UnsafeCheckpointError, match="recipe"):
        dc.load_common_state_dict(ckpt)
    with torch.serialization.safe_globals([Recipe]):
        assert dc.load_common_state_dict(ckpt) == {"recipe": Recipe("x")}


def test_manager_adopts_a_stock_dcp_checkpoint_in_its_root(tmp_path, caplog):
    full = torch.randn(4, 3)
    dcp.save({"w": full, "step": 100}, checkpoint_id=str(tmp_path / "iter_0000100"), no_dist=True)
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(async_save=False))
    assert manager.latest_step() == 100
    state, step = manager.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3))})
    manager.close()
    assert step == 100 and torch.equal(state["w"], full) and state["step"] == 100
    assert "no checksums" in caplog.text  # said once: nothing read was verified
