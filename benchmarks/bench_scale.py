"""Coordination at scale: a save's planning and validation, and a rank's load planning, for N
simulated ranks in one process; ours beside DCP's planners and megatron-core's validation.

Shard metadata only (no tensor is allocated): each rank's records come from a layout
(`benchmarks/scale_layouts.py`: `tp8-pp16-dp128`, a GPT-3-like model with Adam state, about
300 entries per rank at 16,384 ranks; `moe-tp4-pp8-ep8-dp512`, an MoE with expert
parallelism; smaller `--ranks` shrink DP, then PP). Every system and world size runs in its
own subprocess, capped at `--timeout` seconds (reported as `timed_out: true`, with what it
had measured so far) and `--mem-cap-gib` of resident memory.

- `ours`: `tests._simulate.simulate` runs our real save protocol
  (`_sharding_agreement.agreement_protocol`: agreement and validation) for every rank through its in-process
  communicator, which counts the bytes each rank receives per exchange; run twice with the
  same per-rank caches, the second run is the warm save. Then the save's finalization:
  every rank's `encode_report` of its main replicas, rank 0's `write_global_metadata`
  (`.metadata` and the load index, into a temporary directory; the reports' total is what
  rank 0 receives in that gather); and the load: `open_for_load` of a rank's keys plus
  `plan_tensor_reads` for each of its shards (first and last rank, the larger counts).
- `dcp`: torch's `DefaultSavePlanner` (local plans, the coordinator's global plan, plan
  caching for the warm save) and `DefaultLoadPlanner` (`benchmarks/scale_dcp.py`).
- `megatron`: megatron-core 0.16.1's `all_gather_object` of shard metadata and
  `validate_sharding_integrity` (`benchmarks/mcore_scale_side.py`, in `--mcore-python`).

Figures are CPU seconds of one rank (`save_coordinator_s`: rank 0, `save_other_max_s`: the
slowest other rank, `warm_save_s`: the slowest rank in a repeated save of the same
structure, `load_open_plan_s`: a rank's metadata open and read planning) and
`max_recv_bytes`, the most any rank receives in one exchange.

    python -m benchmarks.bench_scale --ranks 64 256 1024 4096 16384 --layout tp8-pp16-dp128 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from benchmarks.scale_layouts import LAYOUTS, make_layout, resharded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ("ours", "dcp", "megatron")
FIELDS = (
    "save_coordinator_s",
    "save_other_max_s",
    "warm_save_s",
    "max_recv_bytes",
    "load_open_plan_s",
    "load_open_plan_resharded_s",
)
COLUMNS = [
    "system",
    "ranks",
    "parallelism",
    "save_coordinator_s",
    "save_other_max_s",
    "warm_save_s",
    "max_recv_MiB",
    "load_open_plan_s",
    "load_open_plan_resharded_s",
    "timed_out",
    "note",
]


# ---------------------------------------------------------------- the subprocesses


def _emit(kind: str, payload: Dict[str, Any]) -> None:
    print(json.dumps({kind: payload}), flush=True)


def _get(obj: Any, name: str) -> Any:
    return obj[name] if isinstance(obj, dict) else getattr(obj, name)


def _ours(layout: Any) -> Dict[str, Any]:
    """Our save agreement for every rank, cold then warm, through the simulator; then the
    save's finalization (reports, metadata files) and a rank's load open and plan."""
    out = _ours_sharding(layout)
    _emit("partial", out)
    fp = _ours_fully_parallel(layout)
    out.update(fp)
    out["save_coordinator_s"] += fp["fp_distribution_cpu_s"][0]
    out["save_other_max_s"] += max(fp["fp_distribution_cpu_s"][1:], default=0.0)
    out["max_recv_bytes"] = max(out["max_recv_bytes"], fp["fp_max_recv_bytes"])
    del fp["fp_distribution_cpu_s"], out["fp_distribution_cpu_s"]
    _emit("partial", out)
    fin = _ours_finalize_and_load(layout)
    out.update(fin)
    out["save_coordinator_s"] += fin["finalize_coordinator_s"]
    out["save_other_max_s"] += fin["finalize_other_max_s"]
    out["max_recv_bytes"] = max(out["max_recv_bytes"], fin["finalize_max_recv_bytes"])
    return out


def _ours_sharding(layout: Any) -> Dict[str, Any]:
    from dist_checkpointing._sharding_agreement import (
        AgreementCache,
        ShardRecord,
        agreement_protocol,
    )
    from tests._simulate import simulate

    world = layout.world
    records = [
        [
            ShardRecord(
                "t",
                r.key,
                r.dtype,
                r.global_shape,
                r.global_offset,
                r.local_shape,
                0 if r.is_main_replica else 1,
            )
            for r in layout.rank_records(rank)
        ]
        for rank in range(world)
    ]
    caches = [AgreementCache() for _ in range(world)]

    def save() -> Any:
        protocols = [agreement_protocol(r, world, records[r], caches[r]) for r in range(world)]
        return simulate(protocols)[1]

    cold = save()
    cpu = list(cold.cpu_s)
    out: Dict[str, Any] = {
        "save_coordinator_s": cpu[0],
        "save_other_max_s": max(cpu[1:], default=0.0),
        "max_recv_bytes": cold.max_recv_bytes,
        "exchanges": len(cold.exchanges),
    }
    warm = save()
    out["warm_save_s"] = max(warm.cpu_s)
    out["warm_max_recv_bytes"] = warm.max_recv_bytes
    return out


def _ours_fully_parallel(layout: Any) -> Dict[str, Any]:
    """The fully parallel wrappers' coordination over data-parallel groups (megatron's
    default): who writes each main replica on save (`distribution_protocol`), then, on load,
    who reads each shard and the plan of the exchange that sends it to the others
    (`exchange_plan_protocol`)."""
    from dist_checkpointing.exchange_utils import distribution_protocol, exchange_plan_protocol
    from tests._simulate import simulate

    world, tp, dp = layout.world, layout.tp, layout.dp

    def group(rank: int) -> List[int]:
        t, _, pp = layout.coords(rank)
        return [t + tp * (d + dp * pp) for d in range(dp)]

    def shards(rank: int) -> Dict[Any, Tuple[int, bool]]:
        size = {"bfloat16": 2, "float32": 4}
        return {
            (r.key, r.global_offset): (math.prod(r.local_shape) * size[r.dtype], r.is_main_replica)
            for r in layout.iter_records(rank)
        }

    gc.collect()
    protos = [distribution_protocol(r, group(r), shards(r), True) for r in range(world)]
    savers, save = simulate(protos)
    out: Dict[str, Any] = {"fp_distribution_cpu_s": save.cpu_s}
    out["fp_save_distribution_max_s"] = max(save.cpu_s)
    del protos
    protos = [distribution_protocol(r, group(r), shards(r)) for r in range(world)]
    readers, load = simulate(protos)
    del protos, savers
    have, need = [], []
    for r in range(world):
        held = {(x.key, x.global_offset): (x.local_shape, x.dtype) for x in layout.iter_records(r)}
        have.append({sid: meta for sid, meta in held.items() if readers[r][sid] == r})
        need.append(sorted(sid for sid in held if readers[r][sid] != r))
    del readers
    protos = [exchange_plan_protocol(r, world, have[r], need[r]) for r in range(world)]
    _, plan = simulate(protos)
    out["fp_load_coordination_max_s"] = max(a + b for a, b in zip(load.cpu_s, plan.cpu_s))
    out["fp_max_recv_bytes"] = max(save.max_recv_bytes, load.max_recv_bytes, plan.max_recv_bytes)
    return out


def _ours_finalize_and_load(layout: Any) -> Dict[str, Any]:
    """Each rank encodes its finalize report (its main replicas, as written); rank 0 gathers
    them and writes `.metadata` and the load index; then the first and the last rank open the
    metadata for their keys and plan their reads."""
    import tempfile
    from pathlib import Path

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.metadata import TensorProperties as Props
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    from dist_checkpointing.strategies.torch_dist.finalize import (
        encode_report,
        write_global_metadata,
    )
    from dist_checkpointing.strategies.torch_dist.metadata_file import open_for_load
    from dist_checkpointing.strategies.torch_dist.plan import (
        ChunkIndex,
        TensorRequest,
        plan_tensor_reads,
    )

    world = layout.world
    reports, cpu = [], []
    for r in range(world):
        items, results, pos = [], [], 0
        for rec in layout.iter_records(r):
            if not rec.is_main_replica:
                continue
            offsets = torch.Size(rec.global_offset)
            index = MetadataIndex(rec.key, offsets)
            nbytes = math.prod(rec.local_shape) * (2 if rec.dtype == "bfloat16" else 4)
            chunk = ChunkStorageMetadata(offsets, torch.Size(rec.local_shape))
            props = Props(dtype=getattr(torch, rec.dtype))
            data = TensorWriteData(chunk, props, torch.Size(rec.global_shape))
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
            info = _StorageInfo(f"__{r}_0.distcp", pos, nbytes)
            results.append(WriteResult(index, nbytes, info))
            pos += nbytes
        t0 = time.process_time()
        reports.append(encode_report(items, results))
        cpu.append(time.process_time() - t0)
    out: Dict[str, Any] = {
        "finalize_other_max_s": max(cpu[1:], default=0.0),
        "finalize_max_recv_bytes": sum(len(b) for b in reports),
    }
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
        t0 = time.process_time()
        write_global_metadata(Path(tmp), reports, False)
        out["finalize_coordinator_s"] = cpu[0] + time.process_time() - t0
        out["metadata_bytes"] = sum(p.stat().st_size for p in Path(tmp).iterdir())
        times, opens, resharded_times = [], [], []
        # the simulation's objects are not a loading rank's: keep collections of them out
        gc.collect()
        gc.freeze()
        for target, timed in ((layout, times), (resharded(layout), resharded_times)):
            for r in sorted({0, target.world - 1}):
                recs = target.rank_records(r)
                t0 = time.process_time()
                boxes: Dict[str, Any] = {}
                for rec in recs:
                    boxes.setdefault(rec.key, []).append((rec.global_offset, rec.local_shape))
                md = open_for_load(Path(tmp), sorted(boxes), None, boxes)
                opens.append(time.process_time() - t0)
                indices: Dict[str, Any] = {}
                for slot, rec in enumerate(recs):
                    req = TensorRequest(rec.key, slot, rec.global_offset, rec.local_shape)
                    stored = md.state_dict_metadata[rec.key]
                    index = indices.setdefault(rec.key, ChunkIndex(stored))
                    plan_tensor_reads(req, stored, index=index)
                timed.append(time.process_time() - t0)
        out["load_open_plan_s"] = max(times)
        out["load_open_plan_resharded_s"] = max(resharded_times)
        out["load_open_s"] = max(opens)
    return out


def _child(system: str, layout_name: str, ranks: int) -> None:
    layout = make_layout(layout_name, ranks)
    if system == "ours":
        out = _ours(layout)
    else:
        from benchmarks import scale_dcp

        out = scale_dcp.run(layout, lambda partial: _emit("partial", partial))
    out["parallelism"] = layout.parallelism
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    _emit("result", out)


# ---------------------------------------------------------------- the parent


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _run_capped(cmd: List[str], timeout: float, mem_cap: int) -> Dict[str, Any]:
    """Runs `cmd` in its own session; kills it at `timeout` s or `mem_cap` bytes resident.

    Returns its last `result` (or the last `partial`), `timed_out`, `error`, `wall_s`.
    """
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: List[str] = []
    err: List[str] = []
    readers = [
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True),  # type: ignore[arg-type]
        threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True),  # type: ignore[arg-type]
    ]
    for t in readers:
        t.start()
    start = time.perf_counter()
    timed_out, error = False, None
    while proc.poll() is None:
        if time.perf_counter() - start > timeout:
            timed_out = True
        elif _rss_bytes(proc.pid) > mem_cap:
            error = f"killed: over the memory cap of {mem_cap / 2**30:.0f} GiB resident"
        if timed_out or error:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        time.sleep(0.25)
    wall = time.perf_counter() - start
    for t in readers:
        t.join(timeout=5)
    result: Optional[Dict[str, Any]] = None
    partial: Dict[str, Any] = {}
    for line in lines:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict) and "result" in msg:
            result = msg["result"]
        elif isinstance(msg, dict) and "partial" in msg:
            partial = msg["partial"]
    if result is None and not timed_out and error is None:
        error = f"exit {proc.returncode}: " + "".join(err)[-1500:].strip()
    out = dict(result if result is not None else partial)
    out.update(timed_out=timed_out, wall_s=round(wall, 2))
    if error:
        out["error"] = error
    return out


def _mcore_python(arg: str) -> Tuple[Optional[str], str]:
    """(interpreter, "") for megatron-core, or (None, why not)."""
    candidate = arg or os.environ.get("DIST_CKPT_MCORE_PYTHON", "")
    if not candidate and os.path.exists(os.path.join(REPO, ".venv-mcore", "bin", "python")):
        candidate = os.path.join(REPO, ".venv-mcore", "bin", "python")
    if not candidate:
        return None, "no megatron-core interpreter (set DIST_CKPT_MCORE_PYTHON or --mcore-python)"
    probe = subprocess.run(
        [candidate, "-c", "import megatron.core.dist_checkpointing.validation"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0:
        return None, f"{candidate} cannot import megatron-core: {probe.stderr.strip()[-300:]}"
    return candidate, ""


def _row(system: str, ranks: int, layout: str, measured: Dict[str, Any]) -> Dict[str, Any]:
    row: Dict[str, Any] = {"system": system, "ranks": ranks, "layout": layout}
    row.update({f: None for f in FIELDS})
    row.update(measured)
    row.setdefault("timed_out", False)
    return row


def _measure(system: str, ranks: int, args: argparse.Namespace, mcore: Any) -> Dict[str, Any]:
    if system == "megatron":
        python, why = mcore
        if python is None:
            return _row(system, ranks, args.layout, {"skipped": why})
        cmd = [python, os.path.join(REPO, "benchmarks", "mcore_scale_side.py")]
    else:
        cmd = [sys.executable, "-m", "benchmarks.bench_scale", "--child", system]
    cmd += ["--ranks", str(ranks), "--layout", args.layout]
    timeout = args.ours_timeout if system == "ours" else args.timeout
    return _row(system, ranks, args.layout, _run_capped(cmd, timeout, args.mem_cap))


def _table_row(row: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(row)
    if row.get("max_recv_bytes") is not None:
        out["max_recv_MiB"] = row["max_recv_bytes"] / 2**20
    out["note"] = row.get("skipped") or row.get("error") or ""
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="tp8-pp16-dp128")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per peer and N")
    parser.add_argument(
        "--ours-timeout",
        type=float,
        default=900.0,
        help="seconds for ours per N (it simulates every rank's save and fully parallel load)",
    )
    parser.add_argument(
        "--mem-cap-gib", type=float, default=12.0, help="resident memory cap per subprocess"
    )
    parser.add_argument(
        "--mcore-python",
        default="",
        help="Python with megatron-core 0.16.1 (default $DIST_CKPT_MCORE_PYTHON, "
        "else .venv-mcore/bin/python; missing: megatron is skipped)",
    )
    parser.add_argument("--child", choices=("ours", "dcp"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.layout, args.ranks[0])
        return
    for n in args.ranks:
        make_layout(args.layout, n)  # bad sizes fail before anything runs
    args.mem_cap = int(args.mem_cap_gib * 2**30)
    mcore = _mcore_python(args.mcore_python) if "megatron" in args.systems else (None, "")
    rows = []
    for n in args.ranks:
        for system in args.systems:
            row = _measure(system, n, args, mcore)
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
    if not args.json:
        from benchmarks._common import print_table

        print_table(
            f"bench_scale, layout {args.layout} (CPU s per rank; MiB per rank per exchange)",
            [_table_row(r) for r in rows],
            COLUMNS,
        )


if __name__ == "__main__":
    main()
