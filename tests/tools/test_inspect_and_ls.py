"""`dist-ckpt ls` and `dist-ckpt inspect` (and their functions) on every kind of checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from dist_checkpointing.cli import main
from dist_checkpointing.errors import NotACheckpointError
from dist_checkpointing.manager.layout import write_latest
from dist_checkpointing.tools import describe, list_checkpoints

pytestmark = pytest.mark.timeout(300)


def test_inspect_shows_shards_values_size_and_checksum_coverage(ours, capsys):
    info = describe(ours)
    assert info.complete and info.kind == "torch_dist" and info.step == 7
    shards = {t.key: t.shards for t in info.tensors}
    assert shards == {"rows": 2, "cols": 2, "layers": 2, "norm": 1, "ids": 1, "flag": 1}
    assert {t.key: t.shape for t in info.tensors}["layers"] == [2, 3, 4]
    assert info.objects["iteration"] == "7" and info.objects["rng/shard_1_2"] == "{'seed': 1}"
    assert len(info.objects["args"]) < 80  # short repr of a long value
    assert info.size == sum(p.stat().st_size for p in ours.iterdir())
    c = info.checksums
    assert c is not None and c.present and c.items_covered == c.items > 0
    assert c.bytes_covered == c.bytes and ".metadata" in c.files_covered
    assert main(["inspect", str(ours)]) == 0
    out = capsys.readouterr().out
    # 11 items of tensor chunks and objects, 3 of the common state's plain values (for DCP)
    assert "torch_dist v1" in out and "shards" in out and "checksums: 14/14 items" in out


def test_inspect_json_is_machine_readable(ours, capsys):
    assert main(["inspect", "--json", str(ours)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["complete"] and data["backend"] == "torch_dist v1"
    assert {t["key"] for t in data["tensors"]} >= {"rows", "cols"}


def test_inspect_tells_a_missing_path_from_an_incomplete_checkpoint(ours, tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such file or directory" in err
    partial = tmp_path / "iter_0000009"
    shutil.copytree(ours, partial)
    (partial / "metadata.json").unlink()
    assert main(["inspect", str(partial)]) == 1
    assert "incomplete checkpoint: no metadata.json" in capsys.readouterr().err
    with pytest.raises(NotACheckpointError, match="no such file"):
        describe(tmp_path / "nope")


def test_inspect_on_a_root_points_to_ls(ours, capsys):
    assert main(["inspect", str(ours.parent)]) == 2
    assert "dist-ckpt ls" in capsys.readouterr().err


def test_inspect_reads_local_backend_checkpoints(local_ckpt, capsys):
    info = describe(local_ckpt)
    assert info.complete and info.kind == "local" and info.world_size == 2
    shards = {t.key: t.shards for t in info.tensors}
    assert shards["rows"] == 2 and shards["norm"] == 2  # replicas are kept by every rank
    assert info.objects["iteration"] == "7"
    assert main(["inspect", str(local_ckpt)]) == 0
    assert "local v2 (world size 2)" in capsys.readouterr().out


def test_inspect_reads_stock_dcp_checkpoints(stock):
    info = describe(stock)
    assert info.complete and info.kind == "dcp" and info.backend == "dcp"
    assert {t.key for t in info.tensors} >= {"rows", "cols", "flag"}
    assert info.objects["step"] == "3"
    assert info.checksums is not None and not info.checksums.present


@pytest.mark.interop
def test_inspect_reads_megatron_core_checkpoints(mcore):
    info = describe(mcore)
    assert info.complete and info.kind == "torch_dist"
    assert {t.key: t.shape for t in info.tensors} == {"w": [8, 6], "layers": [2, 3, 4]}
    assert info.objects["iteration"] == "5"


def test_ls_lists_newest_first_with_state_and_latest_marked(ours, tmp_path, capsys):
    root = tmp_path / "root"
    root.mkdir()
    for step in (3, 7):
        shutil.copytree(ours, root / f"iter_{step:07d}")
    crashed = root / "iter_0000011"
    crashed.mkdir()
    (crashed / "__0_0.distcp").write_bytes(b"partial")
    (root / "unrelated").mkdir()
    write_latest(root, 7)
    found = list_checkpoints(root)
    assert [(i.step, i.complete, i.latest) for i in found] == [
        (11, False, False),
        (7, True, True),
        (3, True, False),
    ]
    assert found[1].backend == "torch_dist v1" and len(found[1].tensors) == 6
    assert found[1].size > 0 and found[1].date
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["11", "INCOMPLETE"] and "no metadata.json" in out[1]
    assert out[2].startswith("*")
    assert main(["ls", "--json", str(root)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["step"] for d in data] == [11, 7, 3] and data[1]["latest"]
    assert main(["ls", str(tmp_path / "nope")]) == 2


def test_ls_reads_stock_and_megatron_layouts(stock, ours, tmp_path):
    root = tmp_path / "mixed"
    root.mkdir()
    shutil.copytree(stock, root / "iter_0000001")
    shutil.copytree(ours, root / "iter_0000002")
    kinds = [(i.step, i.kind, i.complete) for i in list_checkpoints(root)]
    assert kinds == [(2, "torch_dist", True), (1, "dcp", True)]


_LOCAL_V1 = os.path.join(os.path.dirname(__file__), "..", "local", "data", "local_v1")


@pytest.fixture
def local_v1(tmp_path):
    """A ('local', 1) checkpoint as one machine holds it: rank 0's part only."""
    ckpt = tmp_path / "v1"
    shutil.copytree(os.path.join(_LOCAL_V1, "node0", "ckpt"), ckpt)
    return ckpt


def _inspect_without_torch(ckpt) -> subprocess.CompletedProcess:
    """`dist-ckpt inspect ckpt` in a fresh interpreter that fails if torch gets imported."""
    code = (
        "import sys\n"
        "from dist_checkpointing.cli import main\n"
        f"rc = main(['inspect', {str(ckpt)!r}])\n"
        "assert rc == 0, rc\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'torch'], 'torch imported'\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )


@pytest.mark.parametrize("which", ["ours", "stock", "mcore"])
def test_fast_inspect_without_torch_matches_the_full_reader(which, request):
    """`dist-ckpt inspect` reads complete torch_dist and DCP checkpoints without importing
    torch (interpreter start to exit: ~0.1 s of CPU here), with the full reader's result
    (deep and shallow)."""
    from dist_checkpointing.tools._light import describe_light

    ckpt = request.getfixturevalue(which)
    assert describe_light(ckpt) == describe(ckpt)
    assert describe_light(ckpt, deep=False) == describe(ckpt, deep=False)
    out = _inspect_without_torch(ckpt)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "shards" in out.stdout


@pytest.mark.parametrize("which", ["local_ckpt", "local_v1"])
def test_local_checkpoints_are_listed_without_torch_and_inspected_by_the_full_reader(
    which, request, capsys
):
    """What `ls` needs of a ('local', 1|2) checkpoint (which parts exist) comes without
    torch and equals the full reader's; `inspect` reads the parts with the one decoder of
    the local format."""
    from dist_checkpointing.tools._light import describe_light

    ckpt = request.getfixturevalue(which)
    assert describe_light(ckpt, deep=False) == describe(ckpt, deep=False)
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "shards" in out and "incomplete" not in out


def _damage(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_fast_inspect_hands_other_checkpoints_to_the_full_reader(ours, local_ckpt, tmp_path):
    from dist_checkpointing.tools._light import Unsupported, describe_light

    partial = tmp_path / "partial"
    shutil.copytree(ours, partial)
    (partial / "metadata.json").unlink()
    for path in (partial, tmp_path / "nope"):
        with pytest.raises(Unsupported):
            describe_light(path)
    damaged = tmp_path / "damaged"
    shutil.copytree(ours, damaged)
    (damaged / "common.pt").write_bytes(b"garbage")
    with pytest.raises(Unsupported):
        describe_light(damaged)
    # a flipped bit in a local part: in a tensor, in the header, in the footer
    for i, offset in enumerate((0, -200, -1)):
        local = tmp_path / f"local{i}"
        shutil.copytree(local_ckpt, local)
        _damage(local / "1" / "iter_0000000_1_local.pt", offset)
        with pytest.raises(Unsupported):
            describe_light(local)
        assert not describe(local).complete  # the full reader names the damage


def test_inspect_reads_a_commit_record_without_a_version_and_hands_odd_digests_on(
    ours, tmp_path, capsys
):
    """A torch_dist `metadata.json` without `sharded_backend_version` means version 1 (as on
    load); a digest that is not hex in `checksums.json` is damage the full reader names,
    never an internal error."""
    no_version = tmp_path / "no_version"
    shutil.copytree(ours, no_version)
    config = json.loads((no_version / "metadata.json").read_text())
    del config["sharded_backend_version"]
    (no_version / "metadata.json").write_text(json.dumps(config))
    assert main(["inspect", str(no_version)]) == 0
    assert "torch_dist v1" in capsys.readouterr().out
    odd = tmp_path / "odd_digest"
    shutil.copytree(ours, odd)
    sums = json.loads((odd / "checksums.json").read_text())
    sums["digest"] = "not hex"
    (odd / "checksums.json").write_text(json.dumps(sums))
    rc = main(["inspect", str(odd)])
    out, err = capsys.readouterr()
    assert "internal error" not in (out + err).lower()
    assert rc != 0 or "checksums" in out + err


def _run_cli_without_torch(*args: str) -> subprocess.CompletedProcess:
    """`dist-ckpt ARGS` in a fresh interpreter; its stderr ends with the torch modules imported."""
    code = (
        "import sys\n"
        "from dist_checkpointing.cli import main\n"
        f"rc = main({list(args)!r})\n"
        "print([m for m in sys.modules if m.split('.')[0] == 'torch'], file=sys.stderr)\n"
        "sys.exit(rc)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )


def test_ls_lists_both_tiers_of_a_manager_with_every_state_without_torch(run_root, tmp_path):
    root = tmp_path / "run1"
    shutil.copytree(run_root, root)
    persistent, tier = root / "persistent", root / "local" / "dist_ckpt"
    crashed = persistent / "iter_0000008"  # data files, no commit record
    crashed.mkdir()
    (crashed / "__0_0.distcp").write_bytes(b"partial")
    dirty = tier / "1" / "iter_0000009_1_local.dirty.pt"  # rank 1 died while writing step 9
    shutil.copy(next((tier / "1").glob("iter_*_1_local.pt")), dirty)
    shutil.copy(
        next((tier / "0").glob("iter_*_0_local.pt")), tier / "0" / "iter_0000009_0_local.pt"
    )

    started = time.monotonic()
    out = _run_cli_without_torch("ls", str(root / "local"))
    assert out.returncode == 0 and out.stderr.strip() == "[]", out.stderr[-2000:]
    assert time.monotonic() - started < 10  # no torch import (~2 s of CPU on its own)
    lines = out.stdout.splitlines()
    assert lines[0].split()[:4] == ["9", "INCOMPLETE", "local", "tier"]
    assert "no committed part of rank(s) [1] here (.dirty" in lines[1]
    assert lines[2].split()[:4] == ["6", "complete", "local", "tier"]
    out = _run_cli_without_torch("ls", "--json", str(root))
    assert out.returncode == 0 and out.stderr.strip() == "[]", out.stderr[-2000:]
    listed = [(e["step"], e["state"], e["path"]) for e in json.loads(out.stdout)]
    assert listed[:3] == [
        (9, "incomplete", str(tier)),
        (8, "incomplete", str(crashed)),
        (6, "complete", str(tier)),
    ]
    assert (4, "complete", str(persistent / "iter_0000004")) in listed

    damaged = persistent / "iter_0000005"  # a commit record that does not parse
    shutil.copytree(persistent / "iter_0000004", damaged)
    (damaged / "metadata.json").write_text("{not json")
    (entry,) = [i for i in list_checkpoints(root) if i.step == 5]
    assert entry.state == "unusable" and "damaged metadata.json" in entry.problem


def test_inspect_and_verify_read_a_managers_local_tier(run_root, capsys):
    tier = run_root / "local" / "dist_ckpt"
    info = describe(tier)
    assert info.complete and info.step == 6 and info.world_size == 2
    assert [(t.key, t.shape, t.shards) for t in info.tensors] == [("rows", [8, 6], 2)]
    assert main(["inspect", str(tier)]) == 0
    out, err = capsys.readouterr()
    assert f"{tier} step 6: local tier (world size 2)" in out
    assert "incomplete" not in out + err
    assert main(["verify", str(tier)]) == 0
    assert f"{tier} step 6: OK: 2 items" in capsys.readouterr().out
    assert main(["verify", str(tier), "--step", "2"]) == 2
    assert "no step 2 in this local tier" in capsys.readouterr().err
    assert main(["inspect", str(run_root / "local")]) == 2
    assert f"dist-ckpt ls {run_root / 'local'}" in capsys.readouterr().err
