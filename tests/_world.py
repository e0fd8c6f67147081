"""Reusable multi-rank gloo worlds for tests.

A `World(n)` spawns n processes once, each with an initialized gloo process group, and
runs functions on all of them: `world.run(fn, *args)` calls `fn(*args)` on every rank and
returns one `Outcome` per rank. A call that does not finish within its timeout kills the
world (a hang fails the test fast); the next `get_world(n)` starts a fresh one.

Functions must be importable module-level callables (they are sent by reference).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

_START_TIMEOUT = 120.0


@dataclass
class Outcome:
    """What one rank's call produced: a value, or an exception (with its traceback text)."""

    rank: int
    value: Any = None
    error: Optional[BaseException] = None
    trace: str = ""

    def unwrap(self) -> Any:
        if self.error is not None:
            raise AssertionError(f"rank {self.rank} raised:\n{self.trace}") from self.error
        return self.value


def _worker(rank: int, world_size: int, inbox: Any, outbox: Any) -> None:
    import datetime
    import logging

    import torch.distributed as dist

    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    timeout = datetime.timedelta(seconds=90)
    # rank 0's store takes a port the system picks and tells the others through the test
    # process: a port picked in advance can be taken by another process in between
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        outbox.put((rank, "port", store.port, ""))
    else:
        port = inbox.get()
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    outbox.put((rank, "ready", None, ""))
    while True:
        task = inbox.get()
        if task is None:
            break
        fn, args = task
        try:
            outbox.put((rank, "ok", fn(*args), ""))
        except BaseException as e:  # reported to the test process
            trace = traceback.format_exc()
            try:
                outbox.put((rank, "err", e, trace))
            except Exception:
                outbox.put((rank, "err", RuntimeError(repr(e)), trace))
    dist.destroy_process_group()
    # The exit handlers (multiprocessing's among them: they wait for the rank's own child
    # processes and flush its queues) run, then the rank leaves without the interpreter's
    # teardown of torch (about half a second of CPU per rank, at every session's end).
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class World:
    """n ranks with a gloo process group, reused across calls."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self.size = size
        self.inboxes = [ctx.Queue() for _ in range(size)]
        self.outbox = ctx.Queue()
        self.procs = [
            # not daemonic: ranks start background writer processes of their own (async save)
            ctx.Process(target=_worker, args=(r, size, self.inboxes[r], self.outbox))
            for r in range(size)
        ]
        for p in self.procs:
            p.start()
        port = self._collect_one("port", _START_TIMEOUT)
        for inbox in self.inboxes[1:]:
            inbox.put(port)
        self._collect("ready", _START_TIMEOUT)

    def _collect_one(self, what: str, timeout: float) -> Any:
        """Rank 0's `what` message (the only one that comes before the others are ready)."""
        outcome = self._collect(what, timeout, ranks=1)[0]
        return outcome.unwrap()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def _collect(self, what: str, timeout: float, ranks: Optional[int] = None) -> List[Outcome]:
        deadline = time.monotonic() + timeout
        got: Dict[int, Outcome] = {}
        expected = self.size if ranks is None else ranks
        while len(got) < expected:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.alive:
                self.close(kill=True)
                missing = sorted(set(range(expected)) - got.keys())
                raise TimeoutError(
                    f"ranks {missing} did not finish {what} within {timeout:.0f} s (world killed)"
                )
            try:
                rank, status, value, trace = self.outbox.get(timeout=min(remaining, 1.0))
            except Exception:
                continue
            got[rank] = Outcome(
                rank, value if status != "err" else None, value if status == "err" else None, trace
            )
        return [got[r] for r in range(expected)]

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> List[Outcome]:
        """Runs `fn(*args)` on every rank; returns the per-rank outcomes."""
        for inbox in self.inboxes:
            inbox.put((fn, args))
        return self._collect(getattr(fn, "__name__", "call"), timeout)

    def run_ok(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> List[Any]:
        """Runs `fn(*args)` on every rank and returns the values; fails if any rank raised."""
        return [o.unwrap() for o in self.run(fn, *args, timeout=timeout)]

    def run_tolerating_deaths(
        self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0
    ) -> List[Optional[Outcome]]:
        """Runs `fn(*args)` on every rank when some ranks are meant to die (SIGKILL).

        Returns one outcome per rank, None for a rank that died (or did not answer within
        `timeout`). The world is killed afterwards: its process group is broken.
        """
        for inbox in self.inboxes:
            inbox.put((fn, args))
        deadline = time.monotonic() + timeout
        got: Dict[int, Outcome] = {}
        while len(got) < self.size and time.monotonic() < deadline:
            dead = {r for r, p in enumerate(self.procs) if not p.is_alive()}
            if len(got) + len(dead - got.keys()) >= self.size and self.outbox.empty():
                break
            try:
                rank, status, value, trace = self.outbox.get(timeout=0.5)
            except Exception:
                continue
            got[rank] = Outcome(
                rank, value if status != "err" else None, value if status == "err" else None, trace
            )
        self.close(kill=True)
        return [got.get(r) for r in range(self.size)]

    def close(self, kill: bool = False) -> None:
        if not kill:
            self._ask_to_stop()
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)

    def _ask_to_stop(self) -> None:
        for inbox in self.inboxes:
            try:
                inbox.put(None)
            except Exception:
                pass


_worlds: Dict[int, World] = {}


def get_world(size: int) -> World:
    """A live world of `size` ranks, reusing the previous one when it is healthy."""
    world = _worlds.get(size)
    if world is None or not world.alive:
        world = World(size)
        _worlds[size] = world
    return world


def close_all_worlds() -> None:
    # every world is asked to stop before any is waited for: their ranks leave at the same
    # time instead of one world after another
    for world in _worlds.values():
        world._ask_to_stop()
    for world in _worlds.values():
        for p in world.procs:
            p.join(timeout=10)
        world.close(kill=True)  # ends whatever did not leave by then
    _worlds.clear()
