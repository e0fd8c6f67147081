"""The shared reads' pure logic, without processes: who reads what, windows and rows, and
the block check across windows (`strategies.torch_dist.shared_read`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo

from dist_checkpointing.errors import CheckpointCorruptedError
from dist_checkpointing.integrity import ItemSum, checksum
from dist_checkpointing.strategies.torch_dist import shared_read as sr
from dist_checkpointing.strategies.torch_dist.verify import BlockCheck

MIB = 1 << 20
STORED = ((1024, 1024), torch.float32)


def offer(node, chunks, verify=True, segment="seg", window=4 * MIB):
    wants = tuple(sr._Want(key, rows, STORED) for key, rows in chunks)
    return sr._Offer(node, 1, segment, verify, window, wants)


def key(file, i):
    return (file, i * 5 * MIB, 4 * MIB + 700)


def test_a_chunk_two_ranks_need_is_shared_by_default_and_the_threshold_is_kept(monkeypatch):
    k = key("a.distcp", 0)
    two = [offer("n0", [(k, (0, 1024))]) for _ in range(2)]
    assert sr.MIN_CONSUMERS == 2
    assert [c.consumers for c in sr._schedule(two, "n0")] == [(0, 1)]
    monkeypatch.setattr(sr, "MIN_CONSUMERS", 3)
    assert sr._schedule(two, "n0") == []
    three = [offer("n0", [(k, (0, 1024))]) for _ in range(3)]
    assert [c.consumers for c in sr._schedule(three, "n0")] == [(0, 1, 2)]


@pytest.fixture
def pairs_share(monkeypatch):
    monkeypatch.setattr(sr, "MIN_CONSUMERS", 2)


def test_a_chunk_is_shared_by_the_ranks_of_a_node_that_all_need_it(pairs_share):
    k = key("a.distcp", 0)
    offers = [offer("n0", [(k, (0, 1024))]) for _ in range(2)] + [
        offer("n1", [(k, (0, 1024))]) for _ in range(2)
    ]
    for node, ranks in (("n0", (0, 1)), ("n1", (2, 3))):
        chunks = sr._schedule(offers, node)
        assert [c.consumers for c in chunks] == [ranks]
        assert chunks[0].reader == ranks[0]
        assert chunks[0].windows == 1  # 4 MiB and the records: one read


def test_nothing_is_shared_alone_across_nodes_or_with_mixed_verification_or_windows(
    pairs_share,
):
    k = key("a.distcp", 0)
    alone = [offer("n0", [(k, (0, 1024))]), offer("n1", [(k, (0, 1024))])]
    assert sr._schedule(alone, "n0") == []
    mixed = [offer("n0", [(k, (0, 1024))]), offer("n0", [(k, (0, 1024))], verify=False)]
    assert sr._schedule(mixed, "n0") == []
    no_segment = [offer("n0", [(k, (0, 1024))]), offer("n0", [(k, (0, 1024))], segment=None)]
    assert sr._schedule(no_segment, "n0") == []
    # ranks of a node that disagree on the window size (a node's ranks counted differently)
    windows = [offer("n0", [(k, (0, 1024))]), offer("n0", [(k, (0, 1024))], window=8 * MIB)]
    assert sr._schedule(windows, "n0") == []


def test_two_ranks_of_a_node_read_windows_twice_as_large():
    assert sr.window_for(1) == sr.window_for(2) == 2 * sr.WINDOW
    assert sr.window_for(3) == sr.window_for(8) == sr.WINDOW
    k = ("a.distcp", 0, 64 * MIB)
    pair = [offer("n0", [(k, (0, 1024))], window=sr.window_for(2)) for _ in range(2)]
    four = [offer("n0", [(k, (0, 1024))], window=sr.window_for(4)) for _ in range(4)]
    big, small = sr._schedule(pair, "n0")[0], sr._schedule(four, "n0")[0]
    assert (big.window, small.window) == (8 * MIB, 4 * MIB)
    assert big.windows < small.windows


def test_a_chunk_whose_rows_the_node_does_not_all_need_is_not_shared(pairs_share):
    k = key("a.distcp", 0)
    gap = [offer("n0", [(k, (0, 400))]), offer("n0", [(k, (500, 1024))])]
    assert sr._schedule(gap, "n0") == []
    covered = [offer("n0", [(k, (0, 600))]), offer("n0", [(k, (500, 1024))])]
    assert len(sr._schedule(covered, "n0")) == 1


def test_each_file_is_read_front_to_back_by_one_rank_and_files_are_spread():
    files = [f"f{i}.distcp" for i in range(4)]
    chunks = [(key(f, i), (0, 1024)) for f in files for i in range(3)]
    offers = [offer("n0", chunks) for _ in range(4)]
    plan = sr._schedule(offers, "n0")
    readers = {c.key[0]: c.reader for c in plan}
    assert sorted(readers.values()) == [0, 1, 2, 3]
    for r in range(4):
        mine = sorted((c for c in plan if c.reader == r), key=lambda c: c.position)
        assert [c.key for c in mine] == sorted(c.key for c in mine)  # file order
        assert [c.first_window for c in mine] == [0, 1, 2]
    # the schedule's list: by position in the reader's list, then reader
    assert [(c.position, c.reader) for c in plan] == sorted((c.position, c.reader) for c in plan)


def _runs_to_the_end(plan, ranks, slots):
    """Simulates the protocol: readers fill windows in their own order, each into slot
    `n % slots` once every consumer freed what it held; consumers copy out in `_order`.
    Returns whether every window was read and consumed (False: the ranks deadlock)."""
    streams = {
        r: sorted(
            ((c.first_window + k, c) for c in plan if c.reader == r for k in range(c.windows)),
            key=lambda w: w[0],
        )
        for r in ranks
    }
    filled = {r: 0 for r in ranks}  # windows each reader filled so far
    freed = {}  # (reader, window number) -> consumers that freed it
    orders = {r: sr._order(plan, r) for r in ranks}
    done = {r: 0 for r in ranks}
    moved = True
    while moved:
        moved = False
        for r in ranks:
            stream = streams[r]
            n = filled[r]
            if n < len(stream):
                if n < slots or freed.get((r, n - slots), set()) >= set(
                    stream[n - slots][1].consumers
                ):
                    filled[r] += 1
                    moved = True
            order = orders[r]
            if done[r] < len(order):
                chunk, k = order[done[r]]
                n = chunk.first_window + k
                if filled[chunk.reader] > n:
                    freed.setdefault((chunk.reader, n), set()).add(r)
                    done[r] += 1
                    moved = True
    return all(filled[r] == len(streams[r]) for r in ranks) and all(
        done[r] == len(orders[r]) for r in ranks
    )


@settings(max_examples=200, deadline=None)
@given(
    ranks=st.integers(2, 5),
    chunks=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 3 * 5), st.sets(st.integers(0, 4), min_size=2)),
        min_size=1,
        max_size=12,
    ),
    slots=st.integers(2, 3),
)
def test_every_rank_consumes_its_windows_once_in_an_order_free_of_deadlocks(ranks, chunks, slots):
    wants = [[] for _ in range(ranks)]
    for i, (file, mib, users) in enumerate(chunks):
        k = (f"f{file}.distcp", i * 16 * MIB, mib * MIB)
        for r in users:
            if r < ranks:
                wants[r].append((k, (0, 1024)))
    plan = sr._schedule([offer("n0", w) for w in wants], "n0")
    for r in range(ranks):
        got = sr._order(plan, r)
        want = [(c.key, k) for c in plan if r in c.consumers for k in range(c.windows)]
        assert sorted((c.key, k) for c, k in got) == sorted(want)  # each window once
        for reader in range(ranks):  # in its reader's order
            numbers = [c.first_window + k for c, k in got if c.reader == reader]
            assert numbers == sorted(numbers)
    assert _runs_to_the_end(plan, range(ranks), slots)


def test_the_simulation_tells_a_deadlocking_order(monkeypatch):
    # two files, each read by one rank, each chunk needed by both: rank 0 taking reader 0's
    # windows first and rank 1 reader 1's first leaves both readers waiting
    chunks = [(key(f, 0), (0, 1024)) for f in ("a.distcp", "b.distcp")]
    plan = sr._schedule([offer("n0", chunks) for _ in range(2)], "n0")
    plan = [
        sr._Chunk(c.key, c.reader, c.consumers, c.position, 0, 4, c.stored, c.window) for c in plan
    ]
    assert _runs_to_the_end(plan, range(2), 2)

    def reader_by_reader(chunks_, rank):
        mine = [(c, k) for c in chunks_ if rank in c.consumers for k in range(c.windows)]
        return sorted(mine, key=lambda w: (w[0].reader != rank, w[1]))

    monkeypatch.setattr(sr, "_order", reader_by_reader)
    assert not _runs_to_the_end(plan, range(2), 2)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    offset=st.integers(0, 3 * MIB),
    head=st.integers(64, 9000),
    row_bytes=st.integers(1, 4096 - 64),
    nrows=st.integers(1, 3000),
    window=st.sampled_from([4096, 8192, 3 * 4096]),
)
def test_every_row_is_handed_out_once_from_bytes_its_window_holds(
    offset, head, row_bytes, nrows, window, monkeypatch
):
    monkeypatch.setattr(sr, "SLACK", 0)
    monkeypatch.setattr(sr, "PRE", 8192)
    length = head + nrows * row_bytes + 300
    k = ("f", offset, length)
    dtype = torch.uint8
    geo = sr._geometry(k, window, head, (((nrows, row_bytes)), dtype))
    n = sr._windows(k, window)
    given_out = []
    for w in range(n):
        lo, hi = geo.window(w)
        assert lo % 4096 == 0 and hi - lo <= geo.size <= window
        r0, r1 = geo.rows(w)
        given_out += range(r0, r1)
        if r1 > r0:
            first = geo.data + r0 * row_bytes
            assert lo - first < sr.PRE - sr.HEADER  # the carried part fits in front
            assert geo.data + r1 * row_bytes <= hi  # the rows end inside the window
    assert given_out == list(range(nrows))
    assert geo.window(n - 1)[1] == offset + length


def test_the_block_check_spans_windows_and_names_a_damaged_block():
    data = np.random.default_rng(0).integers(0, 255, 10_000, dtype=np.uint8)
    block = 1024
    sums = tuple(checksum(data[i : i + block]) for i in range(0, data.size, block))
    expected = ItemSum(0, 0, 0, data.size, block, sums)
    info = _StorageInfo("f", 0, data.size)
    ok = BlockCheck(expected, "t", info)
    for cut in range(0, data.size, 3000):  # pieces that do not line up with blocks
        ok.feed(data[cut : cut + 3000])
    ok.finish()
    bad = data.copy()
    bad[5000] ^= 1
    check = BlockCheck(expected, "t", info)
    with pytest.raises(CheckpointCorruptedError, match="data block 4"):
        for cut in range(0, bad.size, 3000):
            check.feed(bad[cut : cut + 3000])
        check.finish()
    short = BlockCheck(expected, "t", info)
    short.feed(data[:4096])
    with pytest.raises(CheckpointCorruptedError, match="ends in block 4, before block 10"):
        short.finish()
    # a range of blocks (the rows of a resharded read): from block 2 up to block 6
    part = BlockCheck(expected, "t", info, 2 * block, 6 * block)
    for cut in range(2 * block, 6 * block, 700):
        part.feed(data[cut : min(cut + 700, 6 * block)])
    part.finish()
    part = BlockCheck(expected, "t", info, 2 * block, 6 * block)
    with pytest.raises(CheckpointCorruptedError, match="data block 4, bytes 4096-5120 of f"):
        part.feed(bad[2 * block : 6 * block])
    part = BlockCheck(expected, "t", info, 8 * block)  # to the end: a short last block
    part.feed(data[8 * block :])
    part.finish()
    with pytest.raises(CheckpointCorruptedError, match="more data"):
        part.feed(data[:1])
