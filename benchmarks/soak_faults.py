"""A fault soak (not part of the test run): randomly drawn faults against sync, async and
local-tier saves on 2 gloo ranks, with the count of each outcome.

Faults: a flipped byte or a deleted file in a complete checkpoint (then loaded), links to a
complete checkpoint's files in a new save's target, a full disk on one rank mid-save, two jobs
saving into one directory at once, and SIGKILLs of one rank at a random byte of its data.
Outcomes: `exact` (loaded bit-exactly, or the save went through), `refused` (a
`CheckpointingException` on every rank), and the failures: `WRONG` (a value loaded wrong
without an error), `EARLIER-DAMAGED` (a complete checkpoint changed), `HANG`, `SPLIT` (ranks
disagreed). Run from the repository root:

    python -m benchmarks.soak_faults --faults 1000 --kills 20
"""

from __future__ import annotations

import argparse
import collections
import errno
import hashlib
import os
import random
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.errors import CheckpointingException
from dist_checkpointing.storage import faults
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

MODES = ("sync", "async", "local")
KINDS = ("flip", "delete", "link", "full-disk")
LOCAL = ("local", 2)


def _state(tag: int, fill: bool = True) -> Dict[str, Any]:
    r, w = dist.get_rank(), dist.get_world_size()
    full = torch.arange(64 * 2 * w, dtype=torch.float32).reshape(64, 2 * w) * 7 + tag
    local = full[:, 2 * r : 2 * r + 2].clone()
    return {
        "w": ShardedTensor.from_rank_offsets(
            "w", local if fill else torch.zeros_like(local), (1, r, w)
        ),
        "b": ShardedTensor.from_rank_offsets("b", torch.full((5,), float(tag)), replica_id=r),
        "o": ShardedObject("o", {"tag": tag, "rank": r} if fill else None, (w,), (r,)),
        "tag": tag,
    }


def _save(mode: str, state: Dict[str, Any], ckpt: str) -> None:
    strategy = LOCAL if mode == "local" else None
    if mode != "async":
        dc.save(state, ckpt, sharded_strategy=strategy)
        return
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(dc.save(state, ckpt, async_sharded_save=True))
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()


def _load_outcome(ckpt: str, tag: int) -> str:
    """'exact', 'refused' or 'WRONG' for this rank's load of `ckpt` (saved as `tag`)."""
    want = _state(tag)
    try:
        got = dc.load(_state(tag, fill=False), ckpt)
    except CheckpointingException:
        return "refused"
    ok = (
        torch.equal(got["w"], want["w"].data)
        and torch.equal(got["b"], want["b"].data)
        and got["o"] == want["o"].data
        and got["tag"] == tag
    )
    return "exact" if ok else "WRONG"


def _files(ckpt: str) -> List[str]:
    return sorted(
        os.path.relpath(os.path.join(d, n), ckpt) for d, _, ns in os.walk(ckpt) for n in ns
    )


def _digests(ckpt: str) -> Dict[str, str]:
    out = {}
    for rel in _files(ckpt):
        with open(os.path.join(ckpt, rel), "rb") as f:
            out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


def _agree(outcome: str) -> str:
    """One outcome for the trial: the ranks' if they agree, else SPLIT (or the worst)."""
    every: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, outcome)
    for bad in ("WRONG", "EARLIER-DAMAGED"):
        if bad in every:
            return bad
    return every[0] if len(set(every)) == 1 else "SPLIT:" + "/".join(every)


def _trial(base: str, i: int, rng: random.Random) -> Tuple[str, str, str]:
    mode, kind = rng.choice(MODES), rng.choice(KINDS)
    me = dist.get_rank()
    earlier = os.path.join(base, f"e{i}")
    _save(mode, _state(i), earlier)
    dist.barrier()
    before = _digests(earlier)
    files = [f for f in _files(earlier) if os.path.getsize(os.path.join(earlier, f))]
    # every rank draws the same numbers, whichever rank acts on them
    pick, offset_frac, bit = rng.choice(files), rng.random(), rng.randrange(8)
    hard, linked = rng.random() < 0.5, [rel for rel in files if rng.random() < 0.8]
    outcome = "exact"
    if kind in ("flip", "delete"):
        if me == 0:
            path = os.path.join(earlier, pick)
            if kind == "delete":
                os.remove(path)
            else:
                with open(path, "r+b") as f:
                    at = int(offset_frac * os.path.getsize(path))
                    f.seek(at)
                    byte = f.read(1)
                    f.seek(at)
                    f.write(bytes([byte[0] ^ (1 << bit)]))
        dist.barrier()
        outcome = _load_outcome(earlier, i)
        # damage to a file nothing reads (the claim) must load exactly
        return mode, f"{kind}:{os.path.basename(pick)}", _agree(outcome)
    target = os.path.join(base, f"t{i}")
    if kind == "link":
        if me == 0:
            os.makedirs(target)
            link = os.link if hard else os.symlink
            for rel in linked:
                if os.path.basename(rel) != "metadata.json":
                    os.makedirs(os.path.dirname(os.path.join(target, rel)), exist_ok=True)
                    link(os.path.join(earlier, rel), os.path.join(target, rel))
        dist.barrier()
        try:
            _save(mode, _state(i + 100000), target)
            outcome = _load_outcome(target, i + 100000)
        except CheckpointingException:
            outcome = "refused"
    else:  # full disk on one rank, at a random write
        victim = rng.randrange(dist.get_world_size())
        pattern = "*local*" if mode == "local" else "*.distcp"
        full = faults.Fault(pattern, error=OSError(errno.ENOSPC, "No space left on device"))
        with faults.injected(*([full] if me == victim else [])):
            try:
                _save(mode, _state(i + 200000), target)
                outcome = "exact"  # nothing matched the pattern: it went through
            except CheckpointingException:
                outcome = "refused"
        dist.barrier()
        if outcome == "refused" and dc.check_is_distributed_checkpoint(target):
            outcome = "WRONG"  # a failed save left a commit marker
    dist.barrier()
    if _digests(earlier) != before or _load_outcome(earlier, i) != "exact":
        outcome = "EARLIER-DAMAGED"
    return mode, kind, _agree(outcome)


def soak_round(base: str, seed: int, n: int) -> List[Tuple[str, str, str]]:
    """Runs `n` drawn faults in this world (every rank draws the same ones)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        out.append(_trial(base, seed * 100000 + i, rng))
        if os.environ.get("SOAK_VERBOSE") and dist.get_rank() == 0:
            print(i, *out[-1], flush=True, file=sys.stderr)
        if i % 20 == 19:  # keep the disk small
            dist.barrier()
            if dist.get_rank() == 0:
                for name in os.listdir(base):
                    shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            dist.barrier()
    return out


def kill_trial(base: str, seed: int) -> Tuple[str, float]:
    """Saves a complete checkpoint, then one rank is SIGKILLed at a random byte of its data
    (sync) or while its async writer runs. Returns the survivor's (outcome, seconds)."""
    rng = random.Random(seed)
    is_async, victim = rng.random() < 0.5, rng.randrange(2)
    _save("sync", _state(seed), os.path.join(base, "earlier"))
    t0 = time.monotonic()
    target = os.path.join(base, "killed")
    try:
        if dist.get_rank() == victim:
            if is_async:
                faults.inject(faults.Fault("*.distcp", delay_s=rng.uniform(0.05, 1.0)))
            else:
                faults.inject(faults.Fault("*.distcp", die_after_bytes=rng.randrange(1, 1600)))
        if is_async:
            queue = AsyncCallsQueue()
            queue.schedule_async_request(dc.save(_state(seed + 1), target, async_sharded_save=True))
            if dist.get_rank() == victim:
                time.sleep(rng.uniform(0.0, 0.5))
                faults.die()
            queue.maybe_finalize_async_calls(blocking=True)
        else:
            dc.save(_state(seed + 1), target)
        return "exact", time.monotonic() - t0  # the victim's write came before its death
    except CheckpointingException:
        return "refused", time.monotonic() - t0


def after_kill(base: str, seed: int) -> str:
    earlier = _load_outcome(os.path.join(base, "earlier"), seed)
    target = os.path.join(base, "killed")
    if dc.check_is_distributed_checkpoint(target):
        return "EARLIER-DAMAGED" if earlier != "exact" else _load_outcome(target, seed + 1)
    return "refused-and-earlier-" + earlier


def main(argv: Optional[List[str]] = None) -> int:
    from tests._world import World
    from tests.distributed._ownership_fns import race

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=1000, help="faults in the long-lived world")
    p.add_argument("--kills", type=int, default=20, help="SIGKILLs (a new world each)")
    p.add_argument("--races", type=int, default=50, help="two-job races into one directory")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    counts: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        world = World(2)
        chunk = 50
        for k in range(0, args.faults, chunk):
            base = os.path.join(tmp, f"round{k}")
            os.makedirs(base)
            n = min(chunk, args.faults - k)
            try:
                rounds = world.run(soak_round, base, args.seed * 1000 + k, n, timeout=900)
            except TimeoutError:
                counts["any"]["HANG"] += n
                world = World(2)
                continue
            for mode, kind, outcome in rounds[0].unwrap():
                counts[f"{mode}/{kind.split(':')[0]}"][outcome] += 1
        base = os.path.join(tmp, "race")
        os.makedirs(base)
        other = World(2)
        for job, w in enumerate((world, other)):
            for inbox in w.inboxes:
                inbox.put((race, (base, job, args.races)))
        results = [w._collect("race", 600) for w in (world, other)]
        other.close(kill=True)
        for i in range(args.races):
            ok = [all(results[j][r].unwrap()[i] == ("", "") for r in range(2)) for j in range(2)]
            counts["race"]["exactly one job saved" if sum(ok) == 1 else "BOTH-OR-NEITHER"] += 1
        world.close(kill=True)
        verdict = World(2)
        for k in range(args.kills):
            base = os.path.join(tmp, f"kill{k}")
            os.makedirs(base)
            w = World(2)
            got = w.run_tolerating_deaths(kill_trial, base, args.seed * 7919 + k, timeout=120)
            survivors = [o for o in got if o is not None]
            if not survivors:
                counts["kill"]["HANG"] += 1
                continue
            seen = [o.unwrap()[0] if o.error is None else "error" for o in survivors]
            after = verdict.run_ok(after_kill, base, args.seed * 7919 + k, timeout=120)
            counts["kill"][f"survivor {seen[0]}, then {after[0]}"] += 1
        verdict.close()
    total = sum(sum(c.values()) for c in counts.values())
    print(f"{total} faults in {time.monotonic() - start:.0f} s")
    for key in sorted(counts):
        print(f"  {key:20s} " + ", ".join(f"{o}: {n}" for o, n in sorted(counts[key].items())))
    bad = sum(n for c in counts.values() for o, n in c.items() if o.isupper() or "SPLIT" in o)
    print("failures (WRONG, EARLIER-DAMAGED, HANG, SPLIT, BOTH-OR-NEITHER):", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
