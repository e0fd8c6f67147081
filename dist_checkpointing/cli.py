"""The `dist-ckpt` command: `demo` and `inspect`."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from typing import List, Optional

__all__ = ["main"]


def _inspect(path: str) -> int:
    from .core import maybe_load_config
    from .errors import CheckpointingException
    from .mapping import ShardedObject, ShardedTensor
    from .serialization import load_common_state_dict, load_sharded_metadata

    try:
        config = maybe_load_config(path)
        if config is None:
            print(f"{path}: not a complete checkpoint (no metadata.json)", file=sys.stderr)
            return 2
        metadata = load_sharded_metadata(path)
        common = load_common_state_dict(path)
    except CheckpointingException as e:
        print(f"{path}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(
        f"{path}: sharded {config.sharded_backend} v{config.sharded_backend_version}, common {config.common_backend} v{config.common_backend_version}"
    )
    total = 0
    for key, sh in sorted(metadata.items()):
        if isinstance(sh, ShardedTensor):
            nbytes = math.prod(sh.global_shape) * sh.dtype.itemsize
            total += nbytes
            print(
                f"  tensor  {key:<40} {str(tuple(sh.global_shape)):<20} {str(sh.dtype):<16} {nbytes:>14,} B"
            )
        elif isinstance(sh, ShardedObject):
            print(f"  object  {key}")
    print(f"  common keys: {sorted(map(str, common))}")
    print(f"  tensor bytes: {total:,}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of `dist-ckpt` / `python -m dist_checkpointing`."""
    parser = argparse.ArgumentParser(prog="dist-ckpt", description="dist_checkpointing tools")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="save, reshard and load a multi-rank checkpoint on CPU")
    demo.add_argument("--world-size", type=int, default=4)
    demo.add_argument("--hidden", type=int, default=512)
    demo.add_argument("--layers", type=int, default=4)
    demo.add_argument("--vocab", type=int, default=8192)
    demo.add_argument(
        "--dir", default="", help="parent directory of the checkpoint (default: a temp dir)"
    )
    insp = sub.add_parser("inspect", help="list a checkpoint's backend, tensors and objects")
    insp.add_argument("path")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.command == "demo":
        from .demo import DemoConfig, run_demo

        run_demo(DemoConfig(args.world_size, args.hidden, args.layers, args.vocab, args.dir))
        return 0
    return _inspect(args.path)
