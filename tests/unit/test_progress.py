"""Progress bars: on a terminal, after a delay, never in logs or pipes."""

from __future__ import annotations

import io
import sys

from dist_checkpointing import _progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_is_drawn_on_a_terminal_for_long_operations(monkeypatch):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(_progress, "SHOW_AFTER_S", 0.0)
    with _progress.byte_progress("load iter_100", 1000) as advance:
        assert advance is not None
        advance(400)
        advance(600)
    assert "load iter_100" in term.getvalue() and "1.00k" in term.getvalue()


def test_no_bar_when_stderr_is_not_a_terminal(monkeypatch):
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    with _progress.byte_progress("load iter_100", 1000) as advance:
        assert advance is None
    assert pipe.getvalue() == ""


def test_short_operations_draw_nothing(monkeypatch):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with _progress.byte_progress("load iter_100", 1000) as advance:
        assert advance is not None
        advance(1000)  # done long before the delay
    assert "load iter_100" not in term.getvalue()
