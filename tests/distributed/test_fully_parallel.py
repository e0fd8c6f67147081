"""Fully parallel save/load wrappers on gloo worlds of 2 and 4 ranks (CPU tensors; GPU-marked
variants run `_fp_nccl.py` with CUDA tensors).

Each replicated shard is written by exactly one rank (read from DCP's `.metadata`: the file
holding each chunk names its writer), with bytes balanced over the ranks; on load each shard
is read by exactly one rank and exchanged. Combinations with the plain strategies and with
resharding (the `tp` tensor is saved split by rows and loaded split by columns).
"""

from __future__ import annotations

import collections
import os
import re

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from dist_checkpointing.errors import CheckpointingException
from dist_checkpointing.strategies.fully_parallel import (
    EXCHANGE_ALGOS,
    FullyParallelLoadStrategyWrapper,
)
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from tests.distributed import _fp_fns

pytestmark = pytest.mark.timeout(300)


def _bytes_by_writer(ckpt: str) -> dict:
    """{writer rank: {chunk key: bytes}} from the DCP metadata (files are __<rank>_<n>.distcp)."""
    md = FileSystemReader(ckpt).read_metadata()
    out: dict = collections.defaultdict(dict)
    for index, info in md.storage_data.items():
        rank = int(re.match(r"__(\d+)_", str(info.relative_path)).group(1))
        out[rank][(index.fqn, tuple(index.offset or ()))] = info.length
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_fully_parallel_save_writes_each_shard_once_with_bytes_balanced(
    world_factory, tmp_path, world
):
    ckpt = str(tmp_path / "c")
    world_factory(world).run_ok(_fp_fns.save, ckpt, True, timeout=120)
    writers = _bytes_by_writer(ckpt)
    chunks = collections.Counter(k for per_rank in writers.values() for k in per_rank)
    assert all(n == 1 for n in chunks.values())  # every chunk written by exactly one rank
    # payload bytes (items on disk also carry a header each)
    rep_bytes = {
        r: sum(
            _fp_fns.full(int(fqn[3:])).numel() * 4 for fqn, _ in per_rank if fqn.startswith("rep")
        )
        for r, per_rank in writers.items()
    }
    assert sorted(rep_bytes) == list(range(world))  # every rank writes a share
    largest = max(s * 16 * 4 for s in _fp_fns.SIZES)
    assert max(rep_bytes.values()) - min(rep_bytes.values()) <= largest
    # a plain save leaves it all to rank 0
    plain = str(tmp_path / "p")
    world_factory(world).run_ok(_fp_fns.save, plain, False, timeout=120)
    plain_writers = _bytes_by_writer(plain)
    assert not any(
        fqn.startswith("rep") for r, d in plain_writers.items() if r != 0 for fqn, _ in d
    )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    "fp_save, fp_load",
    [(True, False), (False, True), (True, True)],
    ids=["fp-save", "fp-load", "fp-both"],
)
def test_fully_parallel_round_trip_resharded(world_factory, tmp_path, world, fp_save, fp_load):
    ckpt = str(tmp_path / "c")
    w = world_factory(world)
    w.run_ok(_fp_fns.save, ckpt, fp_save, 0, timeout=120)
    for split_axis in (0, 1):  # same split, then resharded by columns
        results = w.run_ok(_fp_fns.load, ckpt, fp_load, split_axis, timeout=120)
        assert [bad for bad, _ in results] == [[]] * world
        if fp_load:
            reads = collections.Counter(
                s for _, read in results for s in read if s[0].startswith("rep")
            )
            assert sorted(reads) == sorted((f"rep{i}", (0, 0)) for i in range(len(_fp_fns.SIZES)))
            assert set(reads.values()) == {1}  # each replicated shard read by one rank
            assert all(any(s[0].startswith("rep") for s in read) for _, read in results)


def test_fully_parallel_load_rejects_unknown_exchange_algo():
    with pytest.raises(CheckpointingException, match="exchange_algo 'magic'.*gather_object"):
        FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), exchange_algo="magic")


def test_fully_parallel_load_accepts_exactly_megatrons_exchange_algo_names():
    assert set(EXCHANGE_ALGOS) == {"broadcast", "gather_rounds", "gather_object"}
    for name in EXCHANGE_ALGOS:
        wrapper = FullyParallelLoadStrategyWrapper(
            TorchDistLoadShardedStrategy(), exchange_algo=name
        )
        assert wrapper.exchange_algo == name
    for wrong in ("Broadcast", "", "gather"):
        with pytest.raises(CheckpointingException, match=repr(wrong)):
            FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), exchange_algo=wrong)


@pytest.mark.parametrize("exchange_algo", ["broadcast", "gather_rounds", "gather_object"])
def test_fully_parallel_load_gives_same_tensors_each_read_once_for_every_exchange_algo(
    world_factory, tmp_path, exchange_algo
):
    ckpt = str(tmp_path / "c")
    w = world_factory(2)
    w.run_ok(_fp_fns.save, ckpt, False, 0, timeout=120)
    results = w.run_ok(_fp_fns.load, ckpt, True, 1, exchange_algo, timeout=120)
    assert [bad for bad, _ in results] == [[], []]
    reads = collections.Counter(s for _, read in results for s in read if s[0].startswith("rep"))
    assert set(reads.values()) == {1} and len(reads) == len(_fp_fns.SIZES)
    # each rank read only part of the replicated shards: the rest came through the exchange
    assert all(0 < sum(s[0].startswith("rep") for s in read) < len(reads) for _, read in results)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("in_flight_bytes", [1, 200, 1 << 30], ids=["each", "windows", "all"])
def test_shard_exchange_delivers_every_wanted_shard_when_waiting_in_windows(
    world_factory, world, in_flight_bytes
):
    results = world_factory(world).run_ok(_fp_fns.exchange, in_flight_bytes, timeout=120)
    assert results == [[]] * world


def _run_cuda_script(tmp_path, backend: str, world: int) -> None:
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "_fp_nccl.py")
    proc = subprocess.run(
        [sys.executable, script, str(tmp_path), backend, str(world)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK" in proc.stdout


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="NCCL needs one GPU per rank (2 ranks on one GPU: 'Duplicate GPU detected'); "
    "the one-GPU variants below cover the CUDA paths",
)
def test_fully_parallel_round_trip_with_cuda_tensors_on_nccl(tmp_path):
    _run_cuda_script(tmp_path, "nccl", 2)


@pytest.mark.gpu
@requires_cuda
def test_fully_parallel_round_trip_with_cuda_tensors_on_nccl_when_one_rank(tmp_path):
    _run_cuda_script(tmp_path, "nccl", 1)


@pytest.mark.gpu
@requires_cuda
def test_fully_parallel_round_trip_with_cuda_tensors_on_gloo_when_ranks_share_one_gpu(tmp_path):
    # the exchange sends every replicated shard read by one rank to the other: CUDA to host,
    # over gloo, back to cuda:0
    _run_cuda_script(tmp_path, "gloo", 2)
