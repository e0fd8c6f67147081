"""A node-local ('local', 2) checkpoint is one unit too: a rank's part replaced by, or linked
to, another checkpoint's part of the same layout is refused by `load` on every rank and
reported by `verify`, as is a missing part, a missing commit marker or one naming a backend
that does not load (2 gloo ranks, one world)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Dict

import pytest

from dist_checkpointing.tools.verify import verify_checkpoint
from tests._world import get_world
from tests.trust import _seal_fns as F

pytestmark = pytest.mark.timeout(300)

PARTS = [os.path.join("0", "iter_0000000_0_local.pt"), os.path.join("1", "iter_0000000_1_local.pt")]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Dict[str, Path]:
    base = tmp_path_factory.mktemp("local")
    dirs = {name: base / name for name in ("a", "b")}
    get_world(2).run_ok(F.save_local_pair, str(dirs["a"]), str(dirs["b"]), timeout=120)
    return dirs


def _load(ckpt: Path) -> list:
    return get_world(2).run_ok(F.load_local, str(ckpt), timeout=120)


def _swap(name: str) -> Callable[[Path, Path], None]:
    return lambda ckpt, other: shutil.copyfile(other / name, ckpt / name)


def _relink(name: str) -> Callable[[Path, Path], None]:
    def edit(ckpt: Path, other: Path) -> None:
        (ckpt / name).unlink()
        (ckpt / name).symlink_to(other / name)

    return edit


def _swap_every_part(ckpt: Path, other: Path) -> None:
    for name in PARTS:
        shutil.copyfile(other / name, ckpt / name)


def _rename_common_backend(ckpt: Path, _: Path) -> None:
    raw = (ckpt / "metadata.json").read_bytes()
    (ckpt / "metadata.json").write_bytes(raw.replace(b'"torch"', b'"torcx"'))  # one bit


CASES = {
    "part 0 of another checkpoint": (_swap(PARTS[0]), PARTS[0]),
    "part 1 of another checkpoint": (_swap(PARTS[1]), PARTS[1]),
    "every part of another checkpoint": (_swap_every_part, PARTS[0]),
    "part 0 linked to another checkpoint's": (_relink(PARTS[0]), PARTS[0]),
    "part 1 deleted": (lambda ckpt, _: (ckpt / PARTS[1]).unlink(), "1"),
    "metadata.json deleted": (lambda ckpt, _: (ckpt / "metadata.json").unlink(), "metadata.json"),
    "metadata.json naming another backend": (_rename_common_backend, "metadata.json"),
}


def test_an_intact_local_checkpoint_loads_and_verifies(pair):
    assert _load(pair["a"]) == ["A", "A"] and _load(pair["b"]) == ["B", "B"]
    assert verify_checkpoint(pair["a"]).ok


@pytest.mark.parametrize("case", list(CASES))
def test_a_part_of_another_save_or_a_missing_file_is_refused_and_reported(pair, tmp_path, case):
    edit, named = CASES[case]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pair["a"], ckpt, symlinks=True)
    edit(ckpt, pair["b"])
    loaded = _load(ckpt)
    assert all(o not in ("A", "B", "a mix") for o in loaded), loaded  # refused on every rank
    report = verify_checkpoint(ckpt)
    assert not report.ok
    assert any(p.file.startswith(named) for p in report.problems), report.problems
