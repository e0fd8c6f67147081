"""Recovery at load sends a lost part from its holder's file (read once, sent chunk by
chunk) and verifies it at the receiver; a bad copy falls back to another."""

from __future__ import annotations

import pytest

from tests.local import _local_fns as F
from tests.local import _retrieve_fns as R

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("chunk", [4096, 5000])
def test_lost_part_is_sent_bit_exact_and_read_once(world_factory, tmp_path, size, chunk):
    world = world_factory(size)
    tmp = str(tmp_path)
    world.run_ok(F.save_iterations, tmp, [3], 1, 2, False, timeout=90)
    world.run_ok(F.remove_dirs, tmp, [size - 1], timeout=90)
    results = world.run_ok(R.recover_with_spy, tmp, chunk, 2, timeout=90)
    assert [same for same, _, _ in results] == [True] * size
    # cliques [0, 1] (and [2, 3]): the lost part's other holder streams it
    _, reads, nbytes = results[size - 2]
    assert nbytes > 2 * chunk  # several chunks, the last one partial
    covered = sorted(reads)
    assert covered[0][0] == 0 and sum(n for _, n in covered) == nbytes
    assert all(a + n == b for (a, n), (b, _) in zip(covered, covered[1:]))  # each byte once
    assert all(not r for i, (_, r, _) in enumerate(results) if i != size - 2)


@pytest.mark.parametrize("damage", ["flip", "read_error"])
def test_recovery_falls_back_when_the_streamed_copy_is_bad(world_factory, tmp_path, damage):
    world = world_factory(4)
    tmp = str(tmp_path)
    world.run_ok(F.save_iterations, tmp, [3], 1, 4, False, timeout=90)  # every rank holds all
    world.run_ok(F.remove_dirs, tmp, [3], timeout=90)
    assert world.run_ok(R.recover_past_a_bad_copy, tmp, damage, timeout=90) == [(True, None)] * 4
