"""Run as a script: converts a checkpoint and prints the peak RSS growth in bytes (JSON)."""

import json
import sys

from dist_checkpointing.tools import (
    _storage,  # noqa: F401  (imports done before measuring)
    convert_checkpoint,
)
from tests._rss import current, peak

if __name__ == "__main__":
    import safetensors  # noqa: F401
    import tqdm  # noqa: F401

    src, out, to = sys.argv[1:4]
    base = max(current(), peak())
    result = convert_checkpoint(src, out, to, max_shard_size="64MB", progress=False)
    print(json.dumps({"growth": peak() - base, "bytes": result.bytes}))
