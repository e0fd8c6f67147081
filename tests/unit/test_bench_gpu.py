"""`benchmarks/bench_gpu.py` at its smallest size: every row runs and every load is checked
bit-exactly (a mismatch raises inside the run). On CUDA (the `gpu` mark) this is the smoke
test of the GPU benchmark; on CPU it checks that the script itself works where no GPU is."""

from __future__ import annotations

import pytest

from benchmarks import bench_gpu
from tests._devices import CUDA

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize(
    "device",
    [CUDA, "cpu"],
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
            "--drop-cache",
            "files",  # a test leaves the machine's page cache alone
            "--sync-files",
            "2",
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
        "ours sync save, 2 files",
        "ours load",
        "ours async blocks",
        "ours async committed",
        "local sync save",
        "local load",
        "local async blocks",
        "local async committed",
    ):
        assert isinstance(rows[key], float) and rows[key] > 0, key
    assert rows["page cache before reads"] == "dropped (fadvise DONTNEED per file)"
    # the stock pinned stager is reused across repeats on every torch version (2.11 closes
    # a caller's stager after each save); it needs CUDA for non-blocking copies
    if device == "cuda":
        assert isinstance(rows["DCP async (pinned stager) committed"], float)


def test_pinned_stager_is_reused_until_torch_clears_it():
    from types import SimpleNamespace

    closed = []

    def make():
        stager = SimpleNamespace(_state_dict_stager=SimpleNamespace(_deepcopy_dispatch={int: 1}))
        stager.close = lambda: closed.append(stager)
        return stager

    stagers = bench_gpu._Stagers(make)
    first = stagers()
    assert stagers() is first and stagers.made == 1  # torch 2.13: kept across saves
    first._state_dict_stager._deepcopy_dispatch.clear()  # torch 2.11 does this after a stage
    second = stagers()
    assert second is not first and stagers.made == 2 and closed == [first]
    stagers.close()
    assert closed == [first, second]
