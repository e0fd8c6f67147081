"""Run as a script: converts a checkpoint and prints the peak RSS growth in bytes (JSON)."""

import json
import resource
import sys

from dist_checkpointing.tools import (
    _storage,  # noqa: F401  (imports done before measuring)
    convert_checkpoint,
)


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


if __name__ == "__main__":
    import safetensors  # noqa: F401
    import tqdm  # noqa: F401

    src, out, to = sys.argv[1:4]
    base = max(_current(), _peak())
    result = convert_checkpoint(src, out, to, max_shard_size="64MB", progress=False)
    print(json.dumps({"growth": _peak() - base, "bytes": result.bytes}))
