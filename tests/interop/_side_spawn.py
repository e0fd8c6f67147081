"""The two-rank world of a side script (`*_side.py`), imported from its `__main__` block (run
as a script, this folder is first on `sys.path`)."""

from __future__ import annotations

import json
import socket
from typing import Any, Callable, Optional


def spawn_two(worker: Callable[..., Any], *args: Any, result: Optional[str] = None) -> None:
    """Runs `worker(rank, 2, port, *args)` on 2 spawned ranks; with `result`, merges the files
    `<result>.<rank>` the ranks wrote (JSON) into `result` as `{"0": ..., "1": ...}`."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, *args), nprocs=2, join=True)
    if result is None:
        return
    merged = {}
    for r in range(2):
        with open(f"{result}.{r}") as f:
            merged[str(r)] = json.load(f)
    with open(result, "w") as f:
        json.dump(merged, f)
