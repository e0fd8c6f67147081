"""Checksum throughput on one core: the candidates for `checksums.json`.

python -m benchmarks.bench_checksums --mib 256 --repeats 5
"""

from __future__ import annotations

import argparse
import time
import zlib
from typing import Any, Callable, Dict

import numpy as np
import xxhash


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    data = np.random.default_rng(0).integers(0, 255, args.mib << 20, dtype=np.uint8)  # touched once
    candidates: Dict[str, Callable[[Any], Any]] = {
        "xxh3_64 (xxhash)": xxhash.xxh3_64_intdigest,
        "xxh64 (xxhash)": xxhash.xxh64_intdigest,
        "crc32 (zlib)": zlib.crc32,
    }
    try:
        import crc32c  # type: ignore[import-not-found]

        candidates["crc32c (crc32c)"] = crc32c.crc32c
    except ImportError:
        pass
    print(f"{'checksum':18s} GB/s (median of {args.repeats}, {args.mib} MiB, one core)")
    for name, fn in candidates.items():
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn(data)
            times.append(time.perf_counter() - t0)
        print(f"{name:18s} {data.nbytes / sorted(times)[len(times) // 2] / 1e9:.2f}")


if __name__ == "__main__":
    main()
