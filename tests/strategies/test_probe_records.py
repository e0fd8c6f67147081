"""The node's records of read-path measurements (`storage.records`): a later process takes
the record instead of probing, and a record is only taken on the machine, boot and device
it was made on, within its age."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from dist_checkpointing.storage import probe, records

#: a measurement where the page cache won every pair (a choice O_DIRECT's default is not)
PAGE_CACHE_WON = probe.ReadProbe(2.0, 0.2, 64 << 20, ((1.0, 0.1), (1.0, 0.1)))


@pytest.fixture
def data_file(tmp_path):
    """A file large enough to probe (four probe regions and more)."""
    path = tmp_path / "data.distcp"
    np.full(5 * probe.PROBE_BYTES // 4, 7, dtype=np.uint32).tofile(path)
    return str(path)


@pytest.fixture
def measures(monkeypatch):
    """The probe's measurement stubbed (the page cache wins); returns the calls made."""
    calls = []

    def measure(path, pairs=2, direct_first=True):
        calls.append(path)
        return PAGE_CACHE_WON

    monkeypatch.setattr(probe, "_measure", measure)
    return calls


def test_a_value_recorded_is_recalled_for_the_same_device(record_dir, tmp_path):
    other = tmp_path / "other"
    other.write_bytes(b"x")
    assert records.recall("kind", str(other)) is None
    records.remember("kind", str(tmp_path), {"a": 1, "b": [1.5, 2]})
    assert records.recall("kind", str(other)) == {"a": 1, "b": [1.5, 2]}
    assert records.recall("another-kind", str(other)) is None
    (name,) = os.listdir(record_dir)  # no temp file left behind
    assert name.startswith("kind-") and name.endswith(f"-{os.stat(tmp_path).st_dev}.json")


def test_records_are_off_when_the_variable_is_set_empty(monkeypatch, tmp_path):
    monkeypatch.setenv(records.ENV, "")
    assert records.directory() is None
    records.remember("kind", str(tmp_path), {"a": 1})
    assert records.recall("kind", str(tmp_path)) is None


def test_the_default_directory_is_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(records.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert records.directory() == tmp_path / "cache" / "dist_checkpointing"


def test_a_record_of_another_boot_or_too_old_is_not_taken(record_dir, tmp_path, monkeypatch):
    records.remember("kind", str(tmp_path), {"a": 1})
    (path,) = record_dir.iterdir()
    body = json.loads(path.read_text())
    body["measured_at"] = time.time() - records.MAX_AGE_S - 1
    path.write_text(json.dumps(body))
    assert records.recall("kind", str(tmp_path)) is None
    body["measured_at"] = time.time()
    path.write_text(json.dumps(body))
    assert records.recall("kind", str(tmp_path)) == {"a": 1}
    monkeypatch.setattr(records, "_boot_id", lambda: "another-boot")
    assert records.recall("kind", str(tmp_path)) is None


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{not json",
        b'{"version": 1}',
        b'{"version": 99, "measured_at": 0, "value": {}}',
        b'{"version": 1, "measured_at": "soon", "value": {}}',
        b"[1, 2]",
        b"x" * (1 << 17),
    ],
)
def test_a_malformed_record_is_measured_anew_without_an_error(
    record_dir, data_file, measures, content
):
    records.remember(probe.RECORD, data_file, {})
    (path,) = record_dir.iterdir()
    path.write_bytes(content)
    assert probe.prefer_direct_reads(data_file) is False
    assert measures == [data_file]


def test_a_later_process_takes_the_record_instead_of_probing(record_dir, data_file, measures):
    assert probe.prefer_direct_reads(data_file) is False  # the page cache won
    assert measures == [data_file]
    probe.forget_probes()  # as a new process starts
    assert probe.prefer_direct_reads(data_file) is False
    assert measures == [data_file]  # not measured again
    kept = probe.probe_result(data_file)
    assert kept is not None and kept.recorded
    assert kept.pairs == PAGE_CACHE_WON.pairs
    probe.forget_probes()
    assert probe.local_probe(data_file, pairs=1) == kept  # a load's own part, recorded too
    assert measures == [data_file]


def test_without_records_every_process_probes(monkeypatch, data_file, measures):
    monkeypatch.setenv(records.ENV, "")
    probe.prefer_direct_reads(data_file)
    probe.forget_probes()
    probe.prefer_direct_reads(data_file)
    assert measures == [data_file, data_file]


def test_ranks_taking_one_record_decide_as_it_did_and_do_not_record_it_again(
    record_dir, data_file, monkeypatch
):
    taken = probe.ReadProbe.from_value(PAGE_CACHE_WON.value())
    combined = probe.combine([taken, None, taken, taken])
    assert combined == taken  # counted once, still marked recorded
    written = []
    monkeypatch.setattr(records, "remember", lambda *a: written.append(a))
    probe.keep(data_file, combined)
    assert written == []
    # a rank that measured anew: the combination is new, and recorded
    fresh = probe.ReadProbe(0.1, 1.0, 32 << 20, ((0.1, 1.0),))
    mixed = probe.combine([taken, fresh, taken])
    assert not mixed.recorded and mixed.pairs == fresh.pairs + taken.pairs
    assert mixed.prefer_direct is False  # the page cache won 2 of 3 pairs, and in total
    probe.keep(data_file, mixed)
    assert written == [(probe.RECORD, data_file, mixed.value())]
    # the next load exchanges the same measurements: kept, not recorded again (which would
    # renew the record's date without measuring)
    probe.keep(data_file, probe.combine([taken, fresh, taken]))
    assert len(written) == 1


def test_a_record_that_is_not_a_measurement_is_not_taken(record_dir, data_file, measures):
    records.remember(probe.RECORD, data_file, {"direct_s": 1.0, "buffered_s": 0.1})
    probe.prefer_direct_reads(data_file)
    assert measures == [data_file]
    records.remember(
        probe.RECORD,
        data_file,
        {"direct_s": 0.0, "buffered_s": 0.1, "nbytes": 1, "pairs": [[0.0, 0.1]]},
    )
    probe.forget_probes()
    probe.prefer_direct_reads(data_file)
    assert measures == [data_file] * 2
