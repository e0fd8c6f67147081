"""`benchmarks/bench_gpu.py` at its smallest size: every row runs and every load is checked
bit-exactly (a mismatch raises inside the run). On CUDA (the `gpu` mark) this is the smoke
test of the GPU benchmark; on CPU it checks that the script itself works where no GPU is."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_gpu

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize(
    "device",
    [
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
        "cpu",
    ],
)
def test_gpu_benchmark_runs_every_row_and_checks_loads(device, tmp_path):
    args = bench_gpu.parser().parse_args(
        [
            "--device",
            device,
            "--size-mib",
            "4",
            "--tensors",
            "2",
            "--repeats",
            "1",
            "--world-sizes",
            "1",
            "--dir",
            str(tmp_path / "b"),
        ]
    )
    results = bench_gpu.run(args)
    rows = results["1"]
    for key in (
        "pinned D2H copy",
        "raw O_DIRECT write",
        "torch.save",
        "DCP save",
        "DCP async (default staging) committed",
        "ours sync save",
        "ours load",
        "ours async blocks",
        "ours async committed",
        "local sync save",
        "local load",
        "local async blocks",
        "local async committed",
    ):
        assert isinstance(rows[key], float) and rows[key] > 0, key
