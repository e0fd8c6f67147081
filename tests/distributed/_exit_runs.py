"""Runs a tiny 2-rank load N times in a row and reports how each rank's process ended.

Usage: python -m tests.distributed._exit_runs RUNS CKPT_DIR [DESTROY_FIRST_RUNS]

Each run forks two ranks from this already-imported interpreter (so a run costs no torch
import), and each rank then leaves through the ordinary exit path of a script: `sys.exit`
at the end of its work unwinds to the top level, atexit handlers run, the interpreter
finalizes and C++ static destructors run. A rank that aborts at exit ("terminate called
without an active exception", SIGABRT) shows as a non-zero status here. After RUNS loads of
that plain kind come DESTROY_FIRST_RUNS (default 0) whose ranks destroy the process group
themselves before exiting. Prints one line per bad exit, then "clean N/RUNS" and
"destroy-first: clean M/DESTROY_FIRST_RUNS"; exits non-zero if any run was not clean.
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import List, Tuple

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.base import StrategyAction, get_default_strategy

_RUN_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, port: int, ckpt: str, save: bool, destroy_first: bool) -> None:
    """The body of one rank, as a user's 7-line script would have it; never returns."""
    atexit.register(_check_groups_destroyed)  # registered first, so it runs last
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if save:
        full = torch.arange(64, dtype=torch.float32).reshape(8, 8)
        local = full[rank * 4 : (rank + 1) * 4].clone()
        dc.save({"w": ShardedTensor.from_rank_offsets("w", local, (0, rank, 2))}, ckpt)
    else:  # resharded: stored as row blocks, loaded as column blocks
        want = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 4), (1, rank, 2))}
        state = dc.load(want, ckpt)
        expected = torch.arange(64, dtype=torch.float32).reshape(8, 8)[:, rank * 4 : (rank + 1) * 4]
        if not torch.equal(state["w"], expected):
            sys.stderr.write(f"rank {rank}: wrong values\n")
            sys.exit(3)
    if destroy_first:
        dist.destroy_process_group()
    sys.exit(0)  # unwinds to the top level: the normal end of a script


def _check_groups_destroyed() -> None:
    """At exit, after the library's hook: only the user's default group may be left."""
    if dist.is_initialized() and len(dist.distributed_c10d._world.pg_map) > 1:
        sys.stderr.write("dist_checkpointing's process groups are alive at exit\n")
        sys.stderr.flush()
        os._exit(5)


def _run_pair(ckpt: str, save: bool, destroy_first: bool, logdir: str, i: int) -> List[str]:
    """One 2-rank run; returns a description of each rank that did not exit cleanly."""
    port = _free_port()
    pids: List[Tuple[int, str]] = []
    for rank in (0, 1):
        log = os.path.join(logdir, f"run{i}_rank{rank}.log")
        pid = os.fork()
        if pid == 0:  # the rank: its output goes to its own log
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            try:
                _rank_main(rank, port, ckpt, save, destroy_first)
            except SystemExit:
                raise
            except BaseException as e:  # reported through the exit status and the log
                sys.stderr.write(f"rank {rank}: {type(e).__name__}: {e}\n")
                sys.exit(2)
        pids.append((pid, log))
    bad: List[str] = []
    deadline = time.monotonic() + _RUN_TIMEOUT_S
    for pid, log in pids:
        status = None
        while status is None:
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                status = raw
            elif time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                bad.append(f"run {i}: pid {pid} timed out")
            else:
                time.sleep(0.005)
        with open(log, errors="replace") as f:
            text = f.read()
        code = os.waitstatus_to_exitcode(status)
        if code != 0 or "terminate called" in text:
            tail = " | ".join(text.strip().splitlines()[-3:])
            bad.append(f"run {i}: pid {pid} exit code {code}: {tail}")
    return bad


def main(argv: List[str]) -> int:
    """Saves once, then runs the loads (see the module docstring); 0 when every exit was clean."""
    runs, ckpt = int(argv[0]), argv[1]
    destroy_first_runs = int(argv[2]) if len(argv) > 2 else 0
    torch.set_num_threads(1)
    # import the backends once here, not in every forked rank (DCP's import dominates a run)
    get_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1)
    # the ranks' finalization would otherwise copy most of this heap (copy-on-write) when
    # the garbage collector walks it: frozen objects are not walked
    gc.freeze()
    # no context manager: the forked ranks unwind through this frame when they exit
    logdir = tempfile.mkdtemp(prefix="dc-exit-")
    failures = _run_pair(ckpt, True, False, logdir, 0)
    clean = {False: 0, True: 0}
    modes = [False] * runs + [True] * destroy_first_runs
    for i, destroy_first in enumerate(modes, start=1):
        bad = _run_pair(ckpt, False, destroy_first, logdir, i)
        failures += [f"{line} (destroy-first)" if destroy_first else line for line in bad]
        clean[destroy_first] += not bad
    shutil.rmtree(logdir, ignore_errors=True)
    for line in failures:
        print(line)
    print(f"clean {clean[False]}/{runs}")
    print(f"destroy-first: clean {clean[True]}/{destroy_first_runs}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
