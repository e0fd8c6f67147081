"""The first exchange's frame size in `_object_gather` (pure arithmetic, no processes)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dist_checkpointing import _object_gather as og


def test_small_worlds_get_the_full_frame_and_large_ones_a_bounded_exchange():
    assert og.inline_bytes(1) == og.inline_bytes(2) == og.INLINE
    assert og.inline_bytes(64) + og.HEADER <= og.GATHERED // 64
    assert og.inline_bytes(1024) == og.GATHERED // 1024 - og.HEADER
    assert og.inline_bytes(10**6) == og.MIN_INLINE


@given(st.integers(min_value=1, max_value=10**6))
def test_frames_stay_within_the_bounds(world):
    inline = og.inline_bytes(world)
    assert og.MIN_INLINE <= inline <= og.INLINE
    if (og.MIN_INLINE + og.HEADER) * world <= og.GATHERED:
        assert (inline + og.HEADER) * world <= og.GATHERED
