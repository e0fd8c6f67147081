"""Callers: run a request's `async_fn` in another process, away from the training loop;
each reports a call's outcome once, as a `CallStatus`."""

from __future__ import annotations

import ast
import ctypes
import enum
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from ..errors import CheckpointingException

if TYPE_CHECKING:
    from .queue import AsyncRequest

__all__ = [
    "AsyncCaller",
    "TemporalAsyncCaller",
    "PersistentAsyncCaller",
    "CallState",
    "CallStatus",
    "check_main_guard",
]

logger = logging.getLogger(__name__)

#: how often an idle persistent writer looks whether its parent is still there
_PARENT_POLL_S = 1.0


class CallState(enum.Enum):
    """Where a scheduled call stands on one rank (FAILED: raised, crashed or killed)."""

    RUNNING = "running"
    OK = "ok"
    FAILED = "failed"


#: (state, payload): the payload is the result (OK), a message (FAILED) or None (RUNNING)
CallStatus = Tuple[CallState, Any]


def _run_and_report(fn: Callable[..., Any], args: Tuple[Any, ...]) -> CallStatus:
    """Runs `fn(*args)`; a failure becomes a FAILED status (reported on every rank)."""
    try:
        return (CallState.OK, fn(*args))
    except BaseException as e:  # reported to every rank by the queue
        return (CallState.FAILED, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}")


def _is_main_test(test: ast.expr) -> bool:
    """Whether `test` is `__name__ == "__main__"`, either way round."""
    return ast.unparse(test) in ("__name__ == '__main__'", "'__main__' == __name__")


def check_main_guard() -> None:
    """Raises `CheckpointingException` (script, line, remedy) when a spawned writer would
    re-run the user's unguarded script (its top level calls us outside its main guard)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path:
        return
    frame: Optional[FrameType] = sys._getframe(1)
    line = None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            line = frame.f_lineno
        frame = frame.f_back
    if line is None:
        return
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return  # unknown: harmless
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test):
            first, last = node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno
            if first <= line <= last:
                return
    raise CheckpointingException(
        f"AsyncCallsQueue(persistent=True) starts its writer with multiprocessing 'spawn', "
        f"which re-runs the top level of {os.path.basename(path)} in the writer; line {line} "
        f'runs outside `if __name__ == "__main__":`. Move the script\'s code into a main() '
        f"called under that guard, or use AsyncCallsQueue(persistent=False) (a forked "
        f"writer per save, no guard needed)."
    )


class AsyncCaller(ABC):
    """Runs one request's `async_fn` away from the training loop."""

    @abstractmethod
    def schedule(self, call_idx: int, request: AsyncRequest) -> None:
        """Starts running `request.async_fn` (does not wait)."""

    @abstractmethod
    def poll(self, call_idx: int, block: bool) -> CallStatus:
        """Returns the call's status; with `block`, waits until it is not running."""

    @abstractmethod
    def close(self) -> None:
        """Releases the caller's processes (waits for running calls)."""


def _lower_priority(niceness: int) -> None:
    """Makes this (writer) process yield the CPU to the training processes."""
    if niceness > 0:
        try:
            os.nice(niceness)
        except OSError as e:
            logger.debug("could not lower writer priority: %s", e)


def _died(proc: Any, what: str = "background writer") -> CallStatus:
    """The status of a call whose writer `proc` ended without reporting it."""
    proc.join()
    return (CallState.FAILED, f"{what} (pid {proc.pid}) died with exit code {proc.exitcode}")


def _die_with_parent(parent: int) -> None:
    """Linux: makes this forked writer die with its parent. It inherited the parent's
    sockets, the process group's among them: alive after its parent was killed, it would
    keep them open, and the other ranks would wait for the collective timeout instead of
    learning of the death at once."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the writer ends when its work does
        return
    if os.getppid() != parent:  # the parent died before the request above took effect
        os._exit(1)


def _temporal_child(
    fn: Callable[..., Any], args: Tuple[Any, ...], conn: Any, niceness: int, parent: int
) -> None:
    if parent:
        _die_with_parent(parent)
    conn.send("started")  # Python runs: the fork itself completed
    _lower_priority(niceness)
    conn.send(_run_and_report(fn, args))
    conn.close()


@dataclass
class _Fork:
    """One call's forked writer, and what it takes to fork it again."""

    fn: Callable[..., Any]
    args: Tuple[Any, ...]
    proc: Any = None
    recv: Any = None
    forked_at: float = 0.0
    started: bool = False
    attempts: int = 0


class TemporalAsyncCaller(AsyncCaller):
    """A fresh forked process per request; it inherits the host buffers without copying.

    A forked child can hang before running Python (CPython <= 3.11 takes a runtime lock in
    the child that another parent thread may have held at the fork). Such a child never
    sends its start message: after `startup_timeout` seconds it is killed and forked again
    (none of the request ran), up to `max_attempts` forks, then the call fails.

    Args:
        niceness: added to the writer's nice value so training keeps the CPU.
        startup_timeout: seconds a forked writer may take to start running Python.
        max_attempts: forks per call before the call is failed.
    """

    def __init__(
        self, niceness: int = 0, startup_timeout: float = 10.0, max_attempts: int = 3
    ) -> None:
        self._calls: Dict[int, _Fork] = {}
        self.niceness = niceness
        self.startup_timeout = startup_timeout
        self.max_attempts = max_attempts

    def schedule(self, call_idx: int, request: AsyncRequest) -> None:
        call = _Fork(request.async_fn, request.async_fn_args)  # type: ignore[arg-type]
        self._fork(call_idx, call)
        self._calls[call_idx] = call

    def _fork(self, call_idx: int, call: _Fork) -> None:
        ctx = mp.get_context("fork")
        main = threading.current_thread() is threading.main_thread()
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_temporal_child,
            # the death signal follows the forking thread: only the main thread's lives on
            args=(call.fn, call.args, send, self.niceness, os.getpid() if main else 0),
            daemon=True,
            name=f"dc-async-{call_idx}",
        )
        proc.start()
        send.close()  # so that the child's death shows as EOF here
        call.proc, call.recv, call.started = proc, recv, False
        call.forked_at = time.monotonic()
        call.attempts += 1

    def _await_start(self, call_idx: int, call: _Fork, block: bool) -> Optional[CallStatus]:
        """Waits for the writer to start (re-forking a stuck one); a status unless it started."""
        while not call.started:
            deadline = call.forked_at + self.startup_timeout
            if call.recv.poll(max(deadline - time.monotonic(), 0.0) if block else 0):
                try:
                    call.recv.recv()
                except EOFError:
                    return _died(call.proc)
                call.started = True
                return None
            if time.monotonic() < deadline:  # still within its time to start
                if block:
                    continue
                return (CallState.RUNNING, None)
            pid = call.proc.pid
            call.proc.kill()
            call.proc.join(timeout=30)
            call.recv.close()
            if call.attempts >= self.max_attempts:
                return (
                    CallState.FAILED,
                    f"background writer for call {call_idx} did not start within "
                    f"{self.startup_timeout:g} s, {call.attempts} times (the last, pid {pid}, "
                    f"was killed); nothing of the request ran",
                )
            msg = "background writer for call %d (pid %d) did not start within %g s: "
            msg += "killed it and forked another"
            logger.warning(msg, call_idx, pid, self.startup_timeout)
            self._fork(call_idx, call)
        return None

    def poll(self, call_idx: int, block: bool) -> CallStatus:
        call = self._calls[call_idx]
        status = self._await_start(call_idx, call, block)
        if status is not None:
            return status if status[0] is CallState.RUNNING else self._finish(call_idx, status)
        if not block and not call.recv.poll(0):
            if call.proc.is_alive():
                return (CallState.RUNNING, None)
            call.proc.join()
            if not call.recv.poll(0):
                return self._finish(call_idx, _died(call.proc))
        try:
            status = call.recv.recv()
        except EOFError:
            status = _died(call.proc)
        return self._finish(call_idx, status)

    def _finish(self, call_idx: int, status: CallStatus) -> CallStatus:
        call = self._calls.pop(call_idx)
        call.recv.close()
        call.proc.join(timeout=30)
        return status

    def close(self) -> None:
        for idx, call in list(self._calls.items()):
            # a writer that never started is replaced or given up on, not waited for
            if self._await_start(idx, call, block=True) is None:
                call.proc.join(timeout=60)
            call.recv.close()
        self._calls.clear()


def _persistent_worker(
    tasks: Any, results: Any, niceness: int, log_setup: Tuple[int, bool], parent: int
) -> None:
    level, shown = log_setup  # the parent's: a spawned process starts unconfigured
    if shown:
        logging.basicConfig(format="%(levelname)s async writer %(name)s: %(message)s")
    logging.getLogger("dist_checkpointing").setLevel(level)
    _lower_priority(niceness)
    while True:
        try:
            task = tasks.get(timeout=_PARENT_POLL_S)
        except queue.Empty:
            # a parent killed outright never sends the stop: without this the worker
            # would wait forever, holding the parent's output pipes and shared memory
            if os.getppid() != parent:
                return
            continue
        if task is None:
            return
        call_idx, fn, args = task
        logger.debug("async writer (pid %d) runs call %d", os.getpid(), call_idx)
        status = _run_and_report(fn, args)
        del fn, args, task  # drop shared-memory handles before the next request
        results.put((call_idx, status))


class PersistentAsyncCaller(AsyncCaller):
    """One long-lived spawned worker fed through a queue (host buffers go as shared memory);
    restarted if it dies.

    Args:
        niceness: added to the worker's nice value so training keeps the CPU.
    """

    def __init__(self, niceness: int = 0) -> None:
        import torch.multiprocessing as tmp

        self.niceness = niceness
        self._ctx = tmp.get_context("spawn")
        self._proc: Any = None
        self._tasks: Any = None
        self._results: Any = None
        self._pending: List[int] = []
        self._done: Dict[int, CallStatus] = {}

    def _ensure_worker(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            return
        self._tasks, self._results = self._ctx.Queue(), self._ctx.Queue()
        level = logging.getLogger("dist_checkpointing").getEffectiveLevel()
        log_setup = (level, bool(logging.getLogger().handlers))
        self._proc = self._ctx.Process(
            target=_persistent_worker,
            args=(self._tasks, self._results, self.niceness, log_setup, os.getpid()),
            daemon=True,
            name="dc-async-worker",
        )
        self._proc.start()
        logger.debug("started persistent async worker pid %d", self._proc.pid)

    def schedule(self, call_idx: int, request: AsyncRequest) -> None:
        self._ensure_worker()
        self._tasks.put((call_idx, request.async_fn, request.async_fn_args))
        self._pending.append(call_idx)

    def _drain(self, timeout: Optional[float]) -> None:
        try:
            call_idx, status = self._results.get(timeout is not None, timeout)
        except Exception:  # queue.Empty
            return
        self._done[call_idx] = status
        self._pending.remove(call_idx)

    def poll(self, call_idx: int, block: bool) -> CallStatus:
        while call_idx not in self._done:
            self._drain(0.2 if block else None)
            if call_idx in self._done:
                break
            if not self._proc.is_alive():
                self._drain(None)  # a result may have arrived just before the exit
                if call_idx in self._done:
                    break
                died = _died(self._proc, "persistent async worker")
                self._done.update((idx, died) for idx in self._pending)
                self._pending.clear()
                break
            if not block:
                return (CallState.RUNNING, None)
        return self._done.pop(call_idx)

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._tasks.put(None)
            self._proc.join(timeout=60)
            if self._proc.is_alive():
                self._proc.kill()
        self._proc = None
