"""Checkpoints written once per session for the tools tests: by us, stock DCP, megatron-core."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._world import get_world
from tests.tools import _tools_fns


@pytest.fixture(scope="session")
def ours(tmp_path_factory) -> Path:
    """A torch_dist checkpoint saved by 2 ranks (row/column splits, objects, common state)."""
    ckpt = tmp_path_factory.mktemp("ours") / "iter_0000007"
    get_world(2).run_ok(_tools_fns.save_sharded, str(ckpt), timeout=120)
    return ckpt


@pytest.fixture(scope="session")
def local_ckpt(tmp_path_factory) -> Path:
    """A ('local', 2) checkpoint saved by 2 ranks."""
    ckpt = tmp_path_factory.mktemp("local") / "ckpt"
    get_world(2).run_ok(_tools_fns.save_sharded, str(ckpt), "local", timeout=120)
    return ckpt


@pytest.fixture(scope="session")
def run_root(tmp_path_factory) -> Path:
    """A CheckpointManager's root after 6 steps on 2 ranks: `persistent/iter_0000004` and
    the local tier `local/dist_ckpt` (steps 3 and 6, or only the newest when it cleans up)."""
    base = tmp_path_factory.mktemp("run") / "run1"
    get_world(2).run_ok(_tools_fns.save_with_manager, str(base), timeout=120)
    return base


@pytest.fixture(scope="session")
def stock(tmp_path_factory) -> Path:
    """A stock PyTorch DCP checkpoint saved by 2 ranks."""
    ckpt = tmp_path_factory.mktemp("stock") / "dcp"
    get_world(2).run_ok(_tools_fns.save_stock_dcp, str(ckpt), timeout=120)
    return ckpt


@pytest.fixture(scope="session")
def mcore(mcore016_jobs) -> Path:
    """A torch_dist checkpoint saved by megatron-core 0.16.1 (skips when it is absent);
    shared with the interop tests: copy it before changing it."""
    return Path(mcore016_jobs["save"].ckpt)


@pytest.fixture(scope="session")
def mcore19(mcore019_jobs) -> Path:
    """A torch_dist checkpoint saved by megatron-core 0.19.2: common state inside the
    `.distcp` files, no common.pt (skips when its side environment is absent); shared with
    the interop tests: copy it before changing it."""
    ckpt = Path(mcore019_jobs["save"].ckpt)
    assert not (ckpt / "common.pt").exists()  # the 0.17+ layout this fixture stands for
    return ckpt
