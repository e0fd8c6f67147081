"""The two-rank world of a side script (`*_side.py`), imported from its `__main__` block (run
as a script, this folder is first on `sys.path`)."""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import socket
import sys
from typing import Any, Callable, Optional


def spawn_two(worker: Callable[..., Any], *args: Any, result: Optional[str] = None) -> None:
    """Runs `worker(rank, 2, port, *args)` on 2 spawned ranks; with `result`, merges the files
    `<result>.<rank>` the ranks wrote (JSON) into `result` as `{"0": ..., "1": ...}`."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_traced, args=(worker, 2, port, *args), nprocs=2, join=True)
    if result is not None:
        merge_results(result)


def merge_results(result: str) -> None:
    """Merges the files `<result>.<rank>` the 2 ranks wrote (JSON) into `result` as
    `{"0": ..., "1": ...}`."""
    merged = {}
    for r in range(2):
        with open(f"{result}.{r}") as f:
            merged[str(r)] = json.load(f)
    with open(result, "w") as f:
        json.dump(merged, f)


def _traced(rank: int, worker: Callable[..., Any], *args: Any) -> None:
    # A rank that aborts inside a library's C++ code prints where its Python threads were.
    faulthandler.enable()
    worker(rank, *args)
    # The rank has written its result and destroyed its process group. After the exit handlers
    # (multiprocessing's among them stops the processes megatron started), it leaves without
    # the interpreter's teardown, where a C++ thread of torch that still wants the GIL can be
    # stopped by CPython inside a noexcept frame, which aborts the process: the likeliest
    # cause of the "terminate called without an active exception" seen once in CI (not
    # reproduced). The test checks the result file, not how a side library tears down.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
