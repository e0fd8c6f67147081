"""One conformance suite that every sharded save/load backend passes.

Backends: 'torch_dist', ('local', 2) with each rank its own directory, and ('per_rank', 1),
a backend this test registers through the public registry (`_per_rank_backend.py`).
Cases: bit-exact round trips (every dtype, nested containers, ShardedObjects, common
state), resharding (or a clear error naming the cause where a backend does not reshard),
every StrictHandling mode, failures on one rank raising on every rank, and async save
giving what a sync save gives.

Each scenario runs once per backend, inside one reused 2-rank gloo world (one call with a
timeout), and the tests below check its recorded outcomes.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import errors
from dist_checkpointing.validation import StrictHandling
from tests._sharding import bitwise_equal
from tests._world import get_world
from tests.strategies import _conformance_fns as fns
from tests.strategies import _per_rank_backend

pytestmark = pytest.mark.timeout(300)

BACKENDS = list(fns.BACKENDS)
WORLD = 2
CALL_TIMEOUT = 120.0


@pytest.fixture(scope="module")
def run_once(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    """Runs `fn(backend, root)` on every rank once per (fn, backend); later calls reuse it."""
    cache: Dict[Tuple[str, str], Tuple[List[Any], Path]] = {}

    def run(fn: Callable[..., Any], backend: str) -> Tuple[List[Any], Path]:
        key = (fn.__name__, backend)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"{fn.__name__}_{backend}")
            values = get_world(WORLD).run_ok(fn, backend, str(root), timeout=CALL_TIMEOUT)
            cache[key] = (values, root)
        return cache[key]

    return run


def _error_class(outcome: Tuple[str, Any]) -> type:
    """The exception class of an ("err", "Type: message") outcome (fails on success)."""
    status, detail = outcome
    assert status == "err", f"expected an error, got {detail!r}"
    cls = getattr(errors, detail.split(":", 1)[0], None)
    assert isinstance(cls, type) and issubclass(cls, errors.CheckpointingException), detail
    return cls


@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip_is_bit_exact(run_once, backend):
    for rank, res in enumerate(run_once(fns.round_trip, backend)[0]):
        assert res["problems"] == [], (rank, res["problems"])
        assert res["is_ckpt"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip_keeps_common_state_and_tensor_metadata(run_once, backend):
    want_tensors = {key: (shape, dtype) for key, shape, dtype, _ in fns.TENSORS}
    want_tensors["stacked"] = ((WORLD, 3, 2), torch.float32)
    for res in run_once(fns.round_trip, backend)[0]:
        common = res["common"]
        assert common["step"] == 1 and common["cfg"]["sizes"] == [1, 2, 3]
        assert bitwise_equal(common["cfg"]["t"], torch.arange(4) + 1)
        assert res["tensors"] == want_tensors


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_reshards_or_names_the_cause(run_once, backend):
    for res in run_once(fns.reshard, backend)[0]:
        for what in ("columns", "whole"):
            if backend in fns.RESHARDING:
                assert res[what] == ("ok", True), (what, res[what])
            else:
                _error_class(res[what])
                assert "'m'" in res[what][1] and "reshard" in res[what][1], res[what]


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_with_another_world_size_reshards_or_names_the_cause(run_once, backend):
    _, root = run_once(fns.round_trip, backend)
    _per_rank_backend.register()
    ckpt = os.path.join(root, "node0", "rt") if backend == "local" else os.path.join(root, "rt")
    want = fns._global("fp32", (8, 6), torch.float32, 1)  # saved split on rows over 2 ranks
    request = {"model": {"fp32": dc.ShardedTensor.from_rank_offsets("fp32", torch.zeros(8, 6))}}
    # this process has no process group: a world of one rank
    if backend in fns.RESHARDING:
        got = dc.load(request, ckpt, strict=StrictHandling.IGNORE_ALL)
        assert bitwise_equal(got["model"]["fp32"], want)
    else:
        with pytest.raises(errors.CheckpointingException, match="reshard"):
            dc.load(request, ckpt, strict=StrictHandling.IGNORE_ALL)


def _check_strict(mode: str, rank: int, res: Dict[str, Any]) -> None:
    unexpected = fns.STRICT_UNEXPECTED if rank == 1 else set()
    if mode == "ASSUME_OK_UNEXPECTED":  # no check: the backend fails on the unknown key
        _error_class(("err", res["error"]))
        assert "extra" in res["error"], res["error"]
        return
    if mode in ("RAISE_UNEXPECTED", "RAISE_ALL"):
        assert _error_class(("err", res["error"])) is errors.KeyMismatchError
        assert "extra" in res["error"], res["error"]
        if mode == "RAISE_ALL":
            assert "'b'" in res["error"], res["error"]
        return
    assert res["error"] is None, res["error"]
    assert res["keys"] == {"a"} and res["a_ok"]
    returns = mode in ("RETURN_UNEXPECTED", "RETURN_ALL")
    assert res["returned_tuple"] == returns
    if returns:
        assert res["unexpected"] == unexpected
        assert res["missing"] == (fns.STRICT_MISSING if mode == "RETURN_ALL" else set())
    logged = res["logged"]
    if mode == "LOG_UNEXPECTED":
        assert ("extra" in logged) == (rank == 1) and "'b'" not in logged, logged
    elif mode == "LOG_ALL":
        assert ("extra" in logged) == (rank == 1) and "'b'" in logged, logged
    else:
        assert "Checkpoint key mismatch" not in logged, logged


def _strict_params() -> List[Any]:
    return [pytest.param(b, m.name) for b in BACKENDS for m in StrictHandling]


@pytest.mark.parametrize(("backend", "mode"), _strict_params())
def test_strict_mode_handles_missing_and_unexpected_keys(run_once, backend, mode):
    for rank, res in enumerate(run_once(fns.strict_modes, backend)[0]):
        _check_strict(mode, rank, res[mode])


ERROR_CASES: Dict[str, Any] = {
    "unknown_key": ("nope", None),
    "bad_sharding": ("'a'", errors.ShardingIntegrityError),
    "overwrite": ("", errors.CheckpointExistsError),
    "missing_file": ("", None),
    "corrupted_file": ("", None),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_failure_on_one_rank_raises_on_every_rank(run_once, backend, case):
    values = run_once(fns.errors_everywhere, backend)[0]
    assert values[1]["files_deleted"][1] and values[1]["files_corrupted"][1], values[1]
    needle, cls = ERROR_CASES[case]
    for rank, res in enumerate(values):
        got = _error_class(res[case])
        if cls is not None:
            assert got is cls, (rank, res[case])
        assert needle in res[case][1], (rank, res[case])
        assert res["after"] == ("ok", True), res["after"]


def _files(root: Path) -> Dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _by_value(x: Any) -> Any:
    """`x` with every tensor as its dtype, shape and bytes (a pickled tensor holds its
    storage's address, so equal tensors pickle apart)."""
    if isinstance(x, torch.Tensor):
        raw = x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return str(x.dtype), tuple(x.shape), raw
    if isinstance(x, dict):
        return {k: _by_value(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_by_value(v) for v in x)
    return x


def _local_part(raw: bytes) -> Tuple[Any, ...]:
    """A local part's common state (without the save's id), tensors and objects, by value."""
    from dist_checkpointing._claim import SAVE_ID_KEY
    from dist_checkpointing.dict_utils import nested_values
    from dist_checkpointing.local._image import decode_image

    image = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    _, state = decode_image(image, "part", weights_only=False)  # this test's own files
    common = {k: v for k, v in state.common.items() if k != SAVE_ID_KEY}
    leaves = [
        (x.key, tuple(x.global_offset), _by_value(x.data))
        if isinstance(x, dc.ShardedTensor)
        else (x.unique_key, _by_value(x.data))
        for x in nested_values(state.sharded_state_dict)
    ]
    return _by_value(common), sorted(leaves, key=repr)


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_save_writes_what_sync_save_writes(run_once, backend):
    values, root = run_once(fns.async_equivalence, backend)
    for rank, res in enumerate(values):
        assert res["problems"] == [], (rank, res["problems"])
        assert not res["committed_early"]
    for rank in range(WORLD) if backend == "local" else [0]:
        sync = _files(Path(fns.ckpt_dir(backend, str(root), "sync", rank)))
        async_ = _files(Path(fns.ckpt_dir(backend, str(root), "async", rank)))
        assert sorted(sync) == sorted(async_)
        # each save's claim holds its own token and time (docs/formats.md)
        claims = {n for n in sync if re.fullmatch(r"claim(_\d+)?\.json", Path(n).name)}
        assert claims, sorted(sync)
        differ = [name for name in sync if sync[name] != async_[name] and name not in claims]
        if backend == "torch_dist":
            # DCP's pickled .metadata may memoize shared objects differently; its content
            # must be equal, and checksums.json differs only by the digest of that file and
            # the save's id (each save draws its own)
            assert set(differ) <= {".metadata", "checksums.json"}, differ
            a, b = (pickle.loads(files[".metadata"]) for files in (sync, async_))
            assert a.state_dict_metadata == b.state_dict_metadata
            assert a.storage_data == b.storage_data
            sums = [json.loads(files["checksums.json"]) for files in (sync, async_)]
            for s in sums:
                del s["digest"], s["files"][".metadata"], s["save_id"]
                del s["files"]["claim.json"]  # each claim's own token and time
            assert sums[0] == sums[1]
        else:  # each local part records its save's id (docs/formats.md): the rest is equal
            for name in differ:
                assert _local_part(sync[name]) == _local_part(async_[name]), name
