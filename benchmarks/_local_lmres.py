"""lm-resiliency in `bench_local`'s parity phase: runs `benchmarks/lmres_side.py` in
`--lmres-python` (its own interpreter; our package is not imported there) on the same world
size and repeats, and lays its rows beside ours (clique factor 2 and parity k).

lm-resiliency (GEMINI) keeps its copies in host memory and writes node-local files only when
a restart flushes them, so its rows map onto ours as follows (the table's notes say so):
bytes kept are its host memory against our node-local files; its save has no synchronous
form ("n/a"); its "committed" is the peer's replica received in memory; its plain load and
the load after a lost node are the restarted job's `enable_resiliency(...)`; a lost node's
recovery is its survivors' restart flush, the copy of the lost rank's replica to the
replacement, and that load. Its in-memory rollback (live processes) has no row of ours.
Where its state per rank differs from ours (`--lmres-mib`, for hosts without ~6x its
state in memory per rank), times are given in seconds per GiB of state per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional

__all__ = ["run_lmres", "lmres_table", "lmres_title"]


def run_lmres(args: argparse.Namespace) -> Dict[str, Any]:
    """Runs the side driver; its results, or `{"lmres n/a": why}` when it did not run."""
    here = os.path.dirname(os.path.abspath(__file__))
    mib = args.lmres_mib or args.parity_mib
    cmd = [
        args.lmres_python,
        os.path.join(here, "lmres_side.py"),
        "--world-size",
        str(args.parity_world),
        "--mib-per-rank",
        str(mib),
        "--repeats",
        str(args.repeats),
        "--dir",
        os.path.join(args.dir, "lmres"),
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # its own site-packages
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd="/", env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"lmres n/a": f"{' '.join(cmd)}: {e}"}
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"lmres n/a": f"the side run failed ({last})"}
    res = json.loads(done.stdout.strip().splitlines()[-1])
    if "lmres skipped" in res:
        return {"lmres n/a": res["lmres skipped"] + f"; try a smaller --lmres-mib than {mib}"}
    res["lmres MiB per rank"] = mib
    return res


def _value(res: Dict[str, Any], key: Optional[str], scale: float) -> Any:
    if key is None or key not in res:
        return None
    return res[key] * scale


def lmres_table(res: Dict[str, Any], k: int, parity_mib: int) -> List[Dict[str, Any]]:
    """Rows `what, lm-resiliency, clique f2, parity k, parity / lm-res, note`."""
    p, c = f"parity k{k}", "clique f2"
    if "lmres n/a" in res:
        return [{"what": "lm-resiliency", "lm-resiliency": f"n/a ({res['lmres n/a']})"}]
    per_gib = res["lmres MiB per rank"] != parity_mib
    # times per GiB of state per rank where the sizes differ; byte ratios as they are
    lm_t = 1024 / res["lmres MiB per rank"] if per_gib else 1.0
    ours_t = 1024 / parity_mib if per_gib else 1.0
    spec = [
        # what, lm-res key (or "n/a (why)"), ours' key suffix, is a time, note
        (
            "copies kept per rank / state",
            "lmres host RAM kept / state",
            "bytes kept / state",
            False,
            "lm-res: host memory (RSS growth: 2 own + 2 peer slots); ours: node-local files",
        ),
        (
            "node-local disk after a restart flush / state",
            "lmres disk after flush / state",
            None,
            False,
            "lm-res writes files only when a restart flushes (own + peer slots, 2 steps)",
        ),
        (
            "sync save s",
            "n/a (async only)",
            "save s",
            True,
            "lm-res captures only asynchronously; its node-local write is the restart flush",
        ),
        (
            "async save: save() blocks s",
            "lmres save blocks s",
            "async blocks s",
            True,
            "lm-res: optimizer.step() with its capture hook (host copy, then threads)",
        ),
        (
            "async save: committed s",
            "lmres replicated s",
            "async final s",
            True,
            "lm-res: the peer's replica received in its memory; ours: node-local files",
        ),
        (
            "plain load s",
            "lmres restart load s",
            "load s",
            True,
            "lm-res: the restarted job's enable_resiliency() from node-local files",
        ),
        (
            "in-memory rollback, live processes s",
            "lmres memory rollback s",
            None,
            True,
            "lm-res only: ckpt_manager.load() from its own slots",
        ),
        (
            "restart flush of the survivors s",
            "lmres flush s",
            None,
            True,
            "flush_for_restart(): own + peer slots written and fsync'd",
        ),
        (
            "copy of the lost rank's files to its replacement s",
            "lmres copy to replacement s",
            None,
            True,
            "copy_checkpoint_to(): a local copy here; a network transfer on a cluster",
        ),
        (
            "recovery of a lost node's part s",
            "lmres recovery s",
            "recovery s",
            True,
            "lm-res: flush + copy + restart load (sum of medians)",
        ),
    ]
    rows = []
    for what, lm_key, ours, is_time, note in spec:
        lm: Any = (
            lm_key if lm_key.startswith("n/a") else _value(res, lm_key, lm_t if is_time else 1)
        )
        scale = ours_t if is_time else 1.0
        row: Dict[str, Any] = {
            "what": what.removesuffix(" s") + " s/GiB" if per_gib and is_time else what,
            "lm-resiliency": lm,
            c: _value(res, f"{c} {ours}" if ours else None, scale),
            p: _value(res, f"{p} {ours}" if ours else None, scale),
            "note": note,
        }
        if isinstance(lm, float) and isinstance(row[p], float) and lm > 0:
            row["parity / lm-res"] = f"{row[p] / lm:.2f}"
        rows.append(row)
    return rows


def lmres_title(res: Dict[str, Any], args: argparse.Namespace) -> str:
    """The table's title: versions, sizes, repeats."""
    if "lmres n/a" in res:
        return "lm-resiliency: not measured"
    mib = res["lmres MiB per rank"]
    sizes = (
        f"{mib} MiB fp32 per rank"
        if mib == args.parity_mib
        else f"lm-resiliency at {mib} MiB, ours at {args.parity_mib} MiB fp32 per rank; times "
        "in s per GiB of state per rank"
    )
    return (
        f"lm-resiliency {res.get('lmres version', '?')} (GEMINI, jump 1) beside ours, "
        f"{args.parity_world} ranks, {sizes}, medians of {args.repeats}; every load verified "
        "bit for bit"
    )
