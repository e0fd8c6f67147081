"""Parity replication: every rank's part rebuilt bit-exactly after losing any one node of its
group; two lost nodes of a group, or a damaged parity segment, reported on every rank."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.local import _parity_fns as P

pytestmark = pytest.mark.timeout(300)


@st.composite
def _groups(draw):
    k = draw(st.integers(2, 7))
    sizes = draw(st.lists(st.integers(0, 20_000), min_size=k, max_size=k))
    return k, sizes, draw(st.integers(0, k - 1)), draw(st.integers(0, 2**32 - 1))


@settings(max_examples=150, deadline=None)
@given(_groups())
def test_any_one_lost_part_is_rebuilt_exactly_from_the_others_parts_and_parities(group):
    import numpy as np

    from dist_checkpointing.local._parity_math import encode, rebuild, segment_size

    k, sizes, lost, seed = group
    rng = np.random.default_rng(seed)
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    parities = encode(parts)
    seg = segment_size(sizes, k)
    assert all(p.size == seg for p in parities)
    assert seg <= -(-max(sizes, default=0) // (k - 1)) + 4095  # about part / (k-1) per rank
    gone_parts = [None if i == lost else p for i, p in enumerate(parts)]
    gone_parities = [None if i == lost else p for i, p in enumerate(parities)]
    assert rebuild(gone_parts, gone_parities, sizes, lost).tobytes() == parts[lost].tobytes()
    other = (lost + 1) % k
    with pytest.raises(ValueError, match="both lost"):
        gone_parts[other] = None
        rebuild(gone_parts, gone_parities, sizes, lost)


def test_group_of_two_keeps_a_mirror_of_the_partner():
    import numpy as np

    from dist_checkpointing.local._parity_math import encode

    a, b = np.arange(5000, dtype=np.uint8), np.arange(3000, dtype=np.uint8)[::-1].copy()
    pa, pb = encode([a, b])
    assert pa[:3000].tobytes() == b.tobytes() and not pa[3000:].any()
    assert pb[:5000].tobytes() == a.tobytes()


def _check_saved(out, world, k):
    for rank, got in enumerate(out):
        assert got["files"] == [f"iter_0000002_{rank}_local.pt", f"iter_0000002_{rank}_parity.bin"]
        part, record = (got["sizes"][f] for f in got["files"])
        biggest = max(o["sizes"][o["files"][0]] for o in out)
        assert record <= biggest / (k - 1) + 8192  # one segment of the group's largest part
        # every node lost in turn: every rank loads iteration 2, bit-exact
        assert got["results"] == [(2, True)] * world, (rank, got["results"])


@pytest.mark.parametrize("k", [2, 4])
def test_every_part_is_rebuilt_after_losing_any_single_node_on_4_nodes(world_factory, tmp_path, k):
    world = world_factory(4)
    tmp = str(tmp_path)
    _check_saved(world.run_ok(P.save_then_lose_each_node, tmp, k, k == 4, timeout=200), 4, k)
    # two nodes of one group: a clear error on every rank
    latest, outcomes = zip(*world.run_ok(P.lose_nodes, tmp, k, [0, 1], timeout=90))
    assert latest == (-1,) * 4
    for name, message in outcomes:
        assert name == "NoReplicasAvailableError", message
        assert "iteration 2" in message and "rank(s) [0, 1]" in message, message
    if k == 2:  # one node in each group (groups [0, 1] and [2, 3]): both rebuilt
        assert world.run_ok(P.lose_nodes, tmp, k, [0, 2], timeout=90) == [(2, True)] * 4
    # a flipped byte in a parity segment: unused by a plain load, detected when needed
    for plain, (name, message) in world.run_ok(P.flip_parity_then_lose, tmp, k, 1, 0, timeout=90):
        assert plain
        assert name == "NoReplicasAvailableError", message
        assert "rank 1's parity record" in message and "parity checksum mismatch" in message


def test_manager_backend_and_tools_see_a_node_rebuilt_from_parity_or_lost(world_factory, tmp_path):
    world = world_factory(4)
    # k = 2 groups [0, 1] and [2, 3]: node 1 lost -> the local step 3 (rank 1's part rebuilt)
    one = world.run_ok(P.manager_resume, str(tmp_path / "one"), 2, [1], timeout=200)
    assert one == [(3, "local", True, 0)] * 4
    # nodes 0 and 1 lost -> no local candidate; the persistent step 2
    two = world.run_ok(P.manager_resume, str(tmp_path / "two"), 2, [0, 1], timeout=200)
    assert two == [(2, "persistent", True, 0)] * 4
    # the ('local', 2) backend through dc.save / dc.load, group of 4
    assert world.run_ok(P.local_backend_round_trip, str(tmp_path / "dc"), 4) == [(True, True)] * 4
    _check_tools(tmp_path)


def _check_tools(tmp_path):
    """`dist-ckpt ls / inspect / verify` name the present, rebuildable and lost parts."""
    from dist_checkpointing.tools import describe, list_checkpoints, verify_checkpoint

    one = tmp_path / "one" / "l" / "dist_ckpt"
    status = "parity groups [[0, 1], [2, 3]]: parts present [0, 2, 3], rebuildable [1], lost []"
    (entry,) = [i for i in list_checkpoints(one) if i.step == 3]
    assert entry.complete and entry.parity == status and entry.world_size == 4
    assert describe(one).parity == status
    report = verify_checkpoint(one)
    assert report.ok and report.parity == status and report.items == 6, report
    # `dist-ckpt ls` prints it, from the records' headers, without importing torch
    code = (
        "import sys\nfrom dist_checkpointing.cli import main\n"
        f"rc = main(['ls', {str(one)!r}])\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'torch'], 'torch imported'\n"
        "sys.exit(rc)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and status in out.stdout, out.stdout + out.stderr[-2000:]
    lost = tmp_path / "lost"
    shutil.copytree(one, lost)
    shutil.rmtree(lost / "0")  # group [0, 1] lost both nodes
    (entry,) = [i for i in list_checkpoints(lost) if i.step == 3]
    assert not entry.complete and entry.parity.endswith("rebuildable [], lost [0, 1]"), entry
    assert not verify_checkpoint(lost).ok
    record = one / "2" / "iter_0000003_2_parity.bin"
    data = bytearray(record.read_bytes())
    data[10] ^= 1
    record.write_bytes(bytes(data))
    (problem,) = verify_checkpoint(one).problems
    assert problem.file == "2/iter_0000003_2_parity.bin" and "parity checksum mismatch" in str(
        problem
    )
    dc = tmp_path / "dc" / "node1" / "ckpt"  # ('local', 2): node 1 sees its own part and record
    assert "parts present [1]" in describe(dc, deep=False).parity


@pytest.mark.parametrize(
    "jump,k,bad",
    [(0, 2, "replication_jump"), (1, 1, "group_size"), (3, 2, "replication_jump"), (1, 3, "group_size"), (2, 4, "group_size")],
)  # fmt: skip
def test_parity_parameters_that_do_not_fit_the_world_are_rejected_naming_them(
    world_factory, jump, k, bad
):
    for name, message in world_factory(4).run_ok(P.parity_params_error, jump, k, timeout=60):
        assert name == "CheckpointingException" and bad in message, message


def test_every_part_is_rebuilt_after_losing_any_single_node_on_6_nodes(world_factory, tmp_path):
    world = world_factory(6)
    tmp = str(tmp_path)
    _check_saved(world.run_ok(P.save_then_lose_each_node, tmp, 3, False, timeout=240), 6, 3)
    # groups [0, 1, 2] and [3, 4, 5]: one node of each lost, both rebuilt
    assert world.run_ok(P.lose_nodes, tmp, 3, [1, 5], timeout=90) == [(2, True)] * 6
    for latest, (name, message) in world.run_ok(P.lose_nodes, tmp, 3, [3, 5], timeout=90):
        assert latest == -1 and name == "NoReplicasAvailableError", message
