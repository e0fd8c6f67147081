"""Errors agreed across ranks stay readable at scale: tested without processes."""

from __future__ import annotations

import pytest

from dist_checkpointing import _dist
from dist_checkpointing.errors import (
    CheckpointCorruptedError,
    CheckpointingException,
    DistributedFailureError,
    close_matches,
)
from dist_checkpointing.validation import _report


def _reports(causes):
    """Per-rank reports as `error_report` builds them (None: the rank succeeded)."""
    return [None if c is None else ("CheckpointCorruptedError", c) for c in causes]


def _raise(reports):
    with pytest.raises(CheckpointingException) as info:
        _dist.raise_on_reported_errors(reports, None, "Load")
    return info.value


@pytest.mark.parametrize(
    "ranks, text",
    [
        ([0, 1, 2, 3, 5, 7, 8, 9], "0-3, 5, 7-9"),
        ([4], "4"),
        ([3, 1, 2, 1], "1-3"),
        ([], ""),
        ([0, 2, 4], "0, 2, 4"),
    ],
)
def test_rank_ranges_compress_consecutive_runs(ranks, text):
    assert _dist.rank_ranges(ranks) == text


def test_identical_causes_on_1024_ranks_read_as_one_line():
    err = _raise(_reports(["OSError: No space left on device"] * 1024))
    assert isinstance(err, CheckpointCorruptedError)
    assert str(err) == "Load failed on ranks 0-1023: OSError: No space left on device"


def test_distinct_causes_are_kept_and_grouped_when_1024_ranks_fail_two_ways():
    causes = ["KeyError: 'w'" if r % 512 < 500 else "OSError: disk gone" for r in range(1024)]
    msg = str(_raise(_reports(causes)))
    assert msg == (
        "Load failed on ranks 0-1023: ranks 0-499, 512-1011: KeyError: 'w'; "
        "ranks 500-511, 1012-1023: OSError: disk gone"
    )


def test_ranks_that_succeeded_are_left_out_of_the_ranges():
    causes = [None] * 1024
    for r in (3, 4, 5, 900):
        causes[r] = "ValueError: bad"
    causes[7] = "OSError: other"
    msg = str(_raise(_reports(causes)))
    assert msg == (
        "Load failed on ranks 3-5, 7, 900: ranks 3-5, 900: ValueError: bad; rank 7: OSError: other"
    )


def test_1024_distinct_causes_stay_bounded_and_say_what_is_cut():
    causes = [f"CheckpointCorruptedError: checksum mismatch in __{r}_0.distcp" for r in range(1024)]
    msg = str(_raise(_reports(causes)))
    assert len(msg) < _dist._MAX_TOTAL_MESSAGE + 300
    assert "rank 0: CheckpointCorruptedError: checksum mismatch in __0_0.distcp" in msg
    shown = msg.count("checksum mismatch")
    assert 10 < shown < 1024
    assert f"[{1024 - shown} more distinct cause(s) on ranks {shown}-1023 cut" in msg


def test_one_overlong_cause_is_cut_with_its_length():
    text = _dist._describe(ValueError("x" * 5000))
    assert len(text) < _dist._MAX_MESSAGE + 60
    assert text.endswith(
        f"[... {len('ValueError: ') + 5000 - _dist._MAX_MESSAGE} more characters cut]"
    )


def test_unknown_error_class_becomes_distributed_failure():
    with pytest.raises(DistributedFailureError, match="failed on rank 1: Boom: x"):
        _dist.raise_on_reported_errors([None, ("Boom", "Boom: x")], None, "Save")


def test_close_matches_name_up_to_five_similar_keys():
    keys = [f"decoder.layers.{i}.mlp.weight" for i in range(10)] + ["embedding.weight"]
    hint = close_matches("decoder.layers.3.mlp.wieght", keys)
    assert hint.startswith(" (closest keys in the checkpoint: 'decoder.layers.3.mlp.weight'")
    assert hint.count("'decoder.layers.") == 5
    assert close_matches("optimizer.state", keys) == ""


def test_unexpected_key_report_names_the_key_it_probably_meant():
    text = _report({"model.weight", "model.bias"}, {"model.wieght"})
    assert "'model.wieght' (closest keys in the checkpoint: 'model.weight'" in text
