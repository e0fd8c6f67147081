"""The node's records of write-path measurements (`storage.records`, `storage.write_probe`):
a later process takes the record instead of writing the probe's scratch file, a record is
written once per new measurement, and a malformed one is measured anew."""

from __future__ import annotations

import os

import pytest

from dist_checkpointing.storage import records, write_probe
from dist_checkpointing.storage.write_probe import WriteProbe

#: a measurement where the page cache won every pair (a choice O_DIRECT's default is not)
PAGE_CACHE_WON = WriteProbe(((1.0, 0.1), (1.0, 0.1), (1.0, 0.1)), 4 << 20)


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    return path


@pytest.fixture
def measures(monkeypatch):
    """The probe's measurement stubbed (the page cache wins); returns the calls made."""
    calls = []

    def measure(directory):
        calls.append(directory)
        return PAGE_CACHE_WON

    monkeypatch.setattr(write_probe, "_measure", measure)
    return calls


def test_a_later_process_takes_the_record_instead_of_probing(record_dir, ckpt, measures):
    assert write_probe.prefer_direct_writes(ckpt) is False  # the page cache won
    assert measures == [str(ckpt)]
    assert len(os.listdir(record_dir)) == 1
    write_probe.forget_write_probes()  # as a new process starts
    assert write_probe.prefer_direct_writes(ckpt) is False
    assert measures == [str(ckpt)]  # not measured again
    kept = write_probe.write_probe_result(ckpt)
    assert kept is not None and kept.recorded and kept.pairs == PAGE_CACHE_WON.pairs
    write_probe.forget_write_probes()
    # a save's own part: the record, even for a save too small to measure
    assert write_probe.local_write_probe(ckpt, 1) == kept
    assert measures == [str(ckpt)]


def test_without_records_every_process_probes(monkeypatch, ckpt, measures):
    monkeypatch.setenv(records.ENV, "")
    write_probe.prefer_direct_writes(ckpt)
    write_probe.forget_write_probes()
    write_probe.prefer_direct_writes(ckpt)
    assert measures == [str(ckpt)] * 2


@pytest.mark.parametrize(
    "value",
    [
        {},
        {"nbytes": 4 << 20},
        {"nbytes": 4 << 20, "pairs": []},
        {"nbytes": 0, "pairs": [[1.0, 0.1]]},
        {"nbytes": 4 << 20, "pairs": [[0.0, 0.1]]},
        {"nbytes": 4 << 20, "pairs": [[1.0]]},
        {"nbytes": "x", "pairs": [[1.0, 0.1]]},
    ],
)
def test_a_record_that_is_not_a_measurement_is_measured_anew(record_dir, ckpt, measures, value):
    records.remember(write_probe.RECORD, str(ckpt), value)
    assert write_probe.prefer_direct_writes(ckpt) is False
    assert measures == [str(ckpt)]


def test_a_torn_record_file_is_measured_anew(record_dir, ckpt, measures):
    records.remember(write_probe.RECORD, str(ckpt), PAGE_CACHE_WON.value())
    (path,) = record_dir.iterdir()
    path.write_bytes(b'{"version": 1, "measured_at": ')
    assert write_probe.prefer_direct_writes(ckpt) is False
    assert measures == [str(ckpt)]


def test_ranks_taking_one_record_decide_as_it_did_and_do_not_record_it_again(
    record_dir, ckpt, monkeypatch
):
    taken = WriteProbe.from_value(PAGE_CACHE_WON.value())
    combined = write_probe.combine([taken, None, taken, taken])
    assert combined == taken and combined.prefer_direct is False  # counted once
    written = []
    monkeypatch.setattr(records, "remember", lambda *a: written.append(a))
    write_probe.keep(ckpt, combined)
    assert written == []
    # a rank that measured anew (O_DIRECT won its pair): the combination is new, recorded
    fresh = WriteProbe(((0.1, 1.0),), 4 << 20)
    mixed = write_probe.combine([taken, fresh, taken])
    assert not mixed.recorded and mixed.pairs == fresh.pairs + taken.pairs
    assert mixed.prefer_direct is True  # the page cache did not win every pair
    write_probe.keep(ckpt, mixed)
    assert written == [(write_probe.RECORD, str(ckpt), mixed.value())]
    # the next save exchanges the same measurements: kept, not recorded again
    write_probe.keep(ckpt, write_probe.combine([taken, fresh, taken]))
    assert len(written) == 1


def test_a_save_records_the_agreed_measurement_and_a_restart_does_not_probe(
    record_dir, tmp_path, monkeypatch
):
    import torch

    from dist_checkpointing import ShardedTensor, load, save

    calls = []

    def measure(directory):
        calls.append(directory)
        return PAGE_CACHE_WON

    monkeypatch.setattr(write_probe, "_measure", measure)
    t = torch.arange(write_probe.MIN_PROBED_SAVE // 4, dtype=torch.float32)

    def state(x):
        return {"w": ShardedTensor.from_rank_offsets("w", x)}

    save(state(t), tmp_path / "a")
    assert len(calls) == 1
    write_probe.forget_write_probes()  # a restarted process
    save(state(t + 1), tmp_path / "b")
    assert len(calls) == 1  # the record was taken
    assert write_probe.write_probe_result(tmp_path / "b").recorded
    assert torch.equal(load(state(torch.empty_like(t)), tmp_path / "b")["w"], t + 1)
