"""TemporalAsyncCaller: a forked writer that hangs before running Python is replaced.

CPython <= 3.11 can leave a forked child stuck in its after-fork code when another thread
of the parent held a runtime lock at the moment of the fork. These tests make the child of
chosen forks hang at the same point (an after-fork hook that sleeps), in this process.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import List

import pytest

from dist_checkpointing.async_save import AsyncRequest, CallState, TemporalAsyncCaller

#: how many of the next forks get a child that hangs before it runs any Python
_hang_next = 0


def _child_after_fork() -> None:
    if _hang_next > 0:
        time.sleep(3600)


def _parent_after_fork() -> None:
    global _hang_next
    _hang_next = max(_hang_next - 1, 0)


os.register_at_fork(after_in_child=_child_after_fork, after_in_parent=_parent_after_fork)


@pytest.fixture(autouse=True)
def _no_hang_after_the_test():
    yield
    global _hang_next
    _hang_next = 0


def append_line(path: str, line: str) -> str:
    with open(path, "a") as f:
        f.write(line + "\n")
    return line


def _request(path: Path, line: str = "written") -> AsyncRequest:
    return AsyncRequest(append_line, (str(path), line), []).freeze()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_writer_stuck_in_fork_is_replaced_and_the_request_runs_once(tmp_path, caplog):
    global _hang_next
    _hang_next = 1
    caller = TemporalAsyncCaller(startup_timeout=0.5)
    out = tmp_path / "out.txt"
    caller.schedule(0, _request(out))
    stuck = caller._calls[0].proc.pid
    with caplog.at_level(logging.WARNING, "dist_checkpointing.async_save.callers"):
        assert caller.poll(0, block=True) == (CallState.OK, "written")
    assert out.read_text() == "written\n"
    assert _gone(stuck), "the stuck writer was left running"
    assert f"(pid {stuck}) did not start within 0.5 s" in caplog.text
    caller.close()


def test_non_blocking_polls_report_running_until_the_replacement_finishes(tmp_path):
    global _hang_next
    _hang_next = 1
    caller = TemporalAsyncCaller(startup_timeout=0.5)
    out = tmp_path / "out.txt"
    caller.schedule(3, _request(out))
    states: List[CallState] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state, result = caller.poll(3, block=False)
        states.append(state)
        if state is not CallState.RUNNING:
            break
        time.sleep(0.05)
    assert states[-1] is CallState.OK and result == "written"
    assert states[0] is CallState.RUNNING  # the stuck writer was not taken as finished
    assert out.read_text() == "written\n"


def test_writer_that_never_starts_fails_the_call_after_max_attempts(tmp_path):
    global _hang_next
    _hang_next = 100
    caller = TemporalAsyncCaller(startup_timeout=0.3, max_attempts=3)
    out = tmp_path / "out.txt"
    caller.schedule(1, _request(out))
    pids = []
    real_fork = caller._fork

    def counting_fork(idx, call):
        real_fork(idx, call)
        pids.append(call.proc.pid)

    caller._fork = counting_fork  # type: ignore[method-assign]
    pids.append(caller._calls[1].proc.pid)
    start = time.monotonic()
    state, message = caller.poll(1, block=True)
    assert state is CallState.FAILED
    assert "did not start within 0.3 s, 3 times" in message and "nothing of" in message
    assert len(pids) == 3 and all(_gone(p) for p in pids), pids
    assert time.monotonic() - start < 10
    assert not out.exists()
    assert not caller._calls  # the failed call is released


def test_close_kills_a_writer_that_never_started(tmp_path):
    global _hang_next
    _hang_next = 100
    caller = TemporalAsyncCaller(startup_timeout=0.3, max_attempts=1)
    caller.schedule(0, _request(tmp_path / "out.txt"))
    pid = caller._calls[0].proc.pid
    start = time.monotonic()
    caller.close()
    assert time.monotonic() - start < 10  # not the 60 s a running writer is given
    assert _gone(pid)


def test_started_writer_is_not_killed_however_long_it_runs(tmp_path):
    caller = TemporalAsyncCaller(startup_timeout=0.2)
    out = tmp_path / "out.txt"
    caller.schedule(0, AsyncRequest(_slow_append, (str(out),), []).freeze())
    assert caller.poll(0, block=True) == (CallState.OK, "slow")
    assert out.read_text() == "slow\n"
    assert caller._calls == {}


def _slow_append(path: str) -> str:
    time.sleep(1.0)  # five times the start-up timeout
    return append_line(path, "slow")
