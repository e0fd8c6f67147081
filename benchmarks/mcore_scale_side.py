"""megatron-core 0.16.1's save-time sharding validation on a `bench_scale` layout, for
`bench_scale` (run it in a Python that has megatron-core; it never imports dist_checkpointing).

Every simulated rank's records become megatron `ShardedTensor`s without data (its
constructor allows `data=None`); then what megatron's `save` does before writing, with
`validate_access_integrity=True` (its default):
- `determine_global_metadata`: each rank strips data (`without_data()`) and
  `all_gather_object`s its list, so every rank pickles its own list and unpickles all of
  them (the world's lists are built here by unpickling, one copy in memory);
- `validate_sharding_integrity(global_metadata)`: global rank 0 checks every key (a one-rank
  gloo group makes this process rank 0).
Costs are CPU seconds (`time.thread_time`); the cyclic GC is off while the per-rank lists
are built and on during validation. `all_gather_object` pads every object to the largest
one, so each rank receives `world x max(pickled list)` bytes. megatron-core validates on
every save (its cached plan skips DCP's planning only), so a warm save costs the same.

Prints JSON lines: progress `{"partial": {...}}`, then `{"result": {...}}`.

    "$DIST_CKPT_MCORE_PYTHON" benchmarks/mcore_scale_side.py --ranks 1024 --layout tp8-pp16-dp128
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import resource
import sys
import time
from typing import Any, Dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _emit(kind: str, payload: Dict[str, Any]) -> None:
    print(json.dumps({kind: payload}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--layout", default="tp8-pp16-dp128")
    args = parser.parse_args()

    sys.path.insert(0, REPO)
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.validation import validate_sharding_integrity

    from benchmarks.scale_layouts import make_layout

    layout = make_layout(args.layout, args.ranks)
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out: Dict[str, Any] = {"parallelism": layout.parallelism}
    gc.disable()
    global_metadata = []
    pickle_s, unpickle_all_s, sizes = [], 0.0, []
    for r in range(layout.world):
        local = [
            ShardedTensor(
                key=rec.key,
                data=None,
                dtype=dtypes[rec.dtype],
                local_shape=rec.local_shape,
                global_shape=rec.global_shape,
                global_offset=rec.global_offset,
                axis_fragmentations=tuple(
                    g // s for g, s in zip(rec.global_shape, rec.local_shape)
                ),
                replica_id=(0, 0, 0) if rec.is_main_replica else (0, 0, 1),
            )
            for rec in layout.iter_records(r)
        ]
        t0 = time.thread_time()
        blob = pickle.dumps([sh.without_data() for sh in local])
        pickle_s.append(time.thread_time() - t0)
        sizes.append(len(blob))
        t0 = time.thread_time()
        global_metadata.append(pickle.loads(blob))
        unpickle_all_s += time.thread_time() - t0
        del local, blob
        if r % 1024 == 1023:
            _emit("partial", {**out, "ranks_gathered": r + 1, "unpickle_so_far_s": unpickle_all_s})
    out.update(
        gather_pickle_max_s=max(pickle_s),
        gather_unpickle_s=unpickle_all_s,
        max_recv_bytes=layout.world * max(sizes),
        recv_pickled_bytes=sum(sizes),
    )
    _emit("partial", out)
    gc.enable()
    t0 = time.thread_time()
    validate_sharding_integrity(global_metadata)
    out["validate_s"] = time.thread_time() - t0
    out["save_coordinator_s"] = pickle_s[0] + unpickle_all_s + out["validate_s"]
    out["save_other_max_s"] = max(pickle_s[1:], default=0.0) + unpickle_all_s
    out["warm_save_s"] = max(out["save_coordinator_s"], out["save_other_max_s"])
    out["load_open_plan_s"] = None
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    _emit("result", out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
