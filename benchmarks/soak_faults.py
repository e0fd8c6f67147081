"""A fault soak (not part of the test run): randomly drawn faults against sync, async and
local-tier ('local', 2) saves on 2 gloo ranks, with the count of each outcome.

Each trial saves a checkpoint E, then applies one fault drawn by this driver process from a
random generator seeded per trial. The driver makes every draw and every change to files;
the ranks only save and load, so their collectives never depend on what each lists. Every
call into the ranks has a hard timeout: a trial that exceeds it is a HANG.
- Faults on E, which is then loaded (and, where refused, verified): a flipped bit; a file
  replaced by the same-named file of another checkpoint D of the same layout (alone; or a
  data file with its sidecar, local: every rank's part); a deleted file; a file replaced by
  a symbolic or hard link to D's.
- Faults on a new save T (after which E and D must be unchanged and E load exactly): links
  to E's files placed in T; a full disk on one rank at a random write; a second 2-rank job
  saving into T at the same moment; one rank SIGKILLed at a random byte or moment of its
  save, or as soon as the commit marker appears (in a world of its own that saved before).
Outcomes are described in docs/guarantees.md; those that must never occur are in capitals.
Run from the repository root (the log holds one line per trial; the same command resumes):

    python -m benchmarks.soak_faults --trials 1000 --seed 1 --log /tmp/soak.jsonl
"""

from __future__ import annotations

import argparse
import collections
import errno
import hashlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing._dist import peer_lost
from dist_checkpointing.errors import CheckpointingException, RankLostAfterCommitError
from dist_checkpointing.storage import faults

MODES = ("sync", "async", "local")
KINDS = {  # fault kinds and their weights
    "flip": 22, "swap": 10, "swap-set": 8, "delete": 12, "relink": 8,
    "links-in-target": 10, "full-disk": 12, "concurrent-job": 10, "kill": 8,
}  # fmt: skip
MUST_BE_ZERO = (
    "WRONG-VALUE", "HANG", "EARLIER-DAMAGED", "SPLIT", "VERIFY-PASSED", "BOTH-JOBS-SAVED",
    "FAILED-BUT-COMMITTED", "SAVE-LOST", "COMMITTED-UNLOADABLE", "COMMITTED-REPORTED-FAILED",
    "UNEXPECTED",
)  # fmt: skip
_TIMEOUT_S = 180.0  # one call into the ranks (a save or load of a few KiB)


# ---- rank side (module-level functions, sent to the ranks by reference) ----------------


def _state(tag: int, fill: bool = True) -> Dict[str, Any]:
    """A small state whose every value tells which save (`tag`) wrote it."""
    r, w = dist.get_rank(), dist.get_world_size()
    full = torch.arange(32 * 2 * w, dtype=torch.float32).reshape(32, 2 * w) * 7 + tag
    local = full[:, 2 * r : 2 * r + 2].clone()
    b = torch.full((5,), float(tag))
    return {
        "w": ShardedTensor.from_rank_offsets("w", local if fill else 0 * local, (1, r, w)),
        "b": ShardedTensor.from_rank_offsets("b", b if fill else 0 * b, replica_id=r),
        "o": ShardedObject("o", {"tag": tag, "rank": r} if fill else None, (w,), (r,)),
        "tag": tag,
    }


def _error(e: CheckpointingException) -> str:
    """'after-commit' (RankLostAfterCommitError), 'lost-peer' (this rank's collective
    failed: a peer died or went silent) or 'refused' (any other)."""
    if isinstance(e, RankLostAfterCommitError):
        return "after-commit"
    return "lost-peer" if peer_lost(e) else "refused"


def _save(mode: str, tag: int, ckpt: str) -> str:
    """'saved' when this rank's save returned, else `_error` of what it raised."""
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    try:
        if mode != "async":
            dc.save(_state(tag), ckpt, sharded_strategy=("local", 2) if mode == "local" else None)
            return "saved"
        queue = AsyncCallsQueue()
        try:
            queue.schedule_async_request(dc.save(_state(tag), ckpt, async_sharded_save=True))
            queue.maybe_finalize_async_calls(blocking=True)
        finally:
            queue.close()
    except CheckpointingException as e:
        return _error(e)
    return "saved"


def rank_load(ckpt: str, tag: int) -> str:
    """'exact', `_error` of what the load raised, or 'WRONG-VALUE'."""
    want = _state(tag)
    try:
        got = dc.load(_state(tag, fill=False), ckpt)
    except CheckpointingException as e:
        return _error(e)
    same = [torch.equal(got[k], want[k].data) for k in ("w", "b")]
    return (
        "exact" if all(same) and got["o"] == want["o"].data and got["tag"] == tag else "WRONG-VALUE"
    )


class _NthWrite(faults.Fault):
    """ENOSPC from the `nth` matching write on (a disk that fills up during the save)."""

    def __init__(self, pattern: str, nth: int) -> None:
        super().__init__(pattern, error=OSError(errno.ENOSPC, "No space left on device"))
        self.nth, self.seen = nth, 0

    def matches(self, op: str, path: str) -> bool:
        if not super().matches(op, path):
            return False
        self.seen += 1
        return self.seen >= self.nth


def rank_save(
    mode: str, tag: int, ckpt: str, victim: int = -1, pattern: str = "", nth: int = 0
) -> str:
    """Saves `tag` into `ckpt`; on `victim` the disk is full from the `nth` write of a file
    matching `pattern` on."""
    with faults.injected(*([_NthWrite(pattern, nth)] if dist.get_rank() == victim else [])):
        return _save(mode, tag, ckpt)


def rank_race(mode: str, tag: int, ckpt: str, base: str, job: int, delays: List[float]) -> str:
    """One job's save into `ckpt`, started with the other job's: the jobs' rank 0s meet
    through files, then each job's ranks, then each rank waits its drawn delay."""
    if dist.get_rank() == 0:
        open(os.path.join(base, f"ready_{job}"), "w").close()
        other, deadline = os.path.join(base, f"ready_{1 - job}"), time.monotonic() + 60
        while not os.path.exists(other) and time.monotonic() < deadline:
            time.sleep(0.0005)
    dist.barrier()
    time.sleep(delays[dist.get_rank()])
    return _save(mode, tag, ckpt)


def rank_killed_save(
    mode: str, tag: int, ckpt: str, victim: int, moment: str, x: float
) -> Tuple[str, float]:
    """Saves into `ckpt` while `victim` is SIGKILLed at `moment`: 'byte' (at byte x of its
    data; in an async torch_dist save its writer process dies), 'time' (x seconds into the
    save) or 'commit' (as soon as metadata.json appears), and at the latest when its save
    returns: a victim never reports (a process killed while it sends its result to the
    driver would leave the worlds' shared result queue locked: a hang of the harness, not
    of the library). Returns the survivor's (`_save` outcome, seconds)."""
    if dist.get_rank() == victim and moment == "byte":
        pattern = "*_local*" if mode == "local" else "*.distcp"
        faults.inject(faults.Fault(pattern, die_after_bytes=max(1, int(x))))
    elif dist.get_rank() == victim:
        marker, deadline = os.path.join(ckpt, "metadata.json"), time.monotonic() + x

        def kill() -> None:
            while time.monotonic() < deadline if moment == "time" else not os.path.exists(marker):
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()
    start = time.monotonic()
    outcome = _save(mode, tag, ckpt)
    if dist.get_rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    return outcome, time.monotonic() - start


# ---- driver side: draws, file faults, verdicts ---------------------------------------


class _Hang(Exception):
    """A call into the ranks exceeded its hard timeout (the world was killed)."""


def _files(ckpt: str) -> List[str]:
    return sorted(
        os.path.relpath(os.path.join(d, n), ckpt) for d, _, ns in os.walk(ckpt) for n in ns
    )


def _digests(ckpt: str) -> Dict[str, str]:
    """Every file's sha256 (a link: where it points)."""
    paths = {rel: os.path.join(ckpt, rel) for rel in _files(ckpt)}
    return {
        rel: os.readlink(p)
        if os.path.islink(p)
        else hashlib.sha256(open(p, "rb").read()).hexdigest()
        for rel, p in paths.items()
    }


def _one(outcomes: List[str]) -> str:
    """The ranks' outcome when they agree (WRONG-VALUE if any rank got one), else SPLIT."""
    if "WRONG-VALUE" in outcomes:
        return "WRONG-VALUE"
    return outcomes[0] if len(set(outcomes)) == 1 else "SPLIT:" + "/".join(outcomes)


def _replace(path: str, make: Callable[[str], Any]) -> None:
    """Puts what `make(tmp)` creates in place of the file at `path`."""
    make(path + ".soak-tmp")
    os.replace(path + ".soak-tmp", path)


class Soak:
    """The worlds, the donor checkpoints D (one per mode), and one trial at a time."""

    def __init__(self, base: str) -> None:
        from tests._world import World

        self.World, self.base = World, base
        self.world = World(2)
        self.other: Optional[Any] = None  # the second job's world, from its first trial
        self.donors: Dict[str, Tuple[str, int]] = {}

    def _collect(self, world: Any, fn: Callable[..., Any], *args: Any) -> List[str]:
        """Runs `fn(*args)` on `world`'s ranks (`args` None: already sent)."""
        try:
            got = (
                world.run(fn, *args, timeout=_TIMEOUT_S) if args else world._collect("", _TIMEOUT_S)
            )
        except TimeoutError as e:
            self.world = self.world if self.world.alive else self.World(2)
            raise _Hang(str(e)) from e
        return [o.value if o.error is None else f"UNEXPECTED:{type(o.error).__name__}" for o in got]

    def call(self, fn: Callable[..., Any], *args: Any) -> str:
        return _one(self._collect(self.world, fn, *args))

    def donor(self, mode: str) -> Tuple[str, int]:
        if mode not in self.donors:
            path, tag = os.path.join(self.base, f"donor-{mode}"), 900001 + MODES.index(mode)
            if self.call(rank_save, mode, tag, path) != "saved":
                raise RuntimeError(f"the donor checkpoint {path} could not be saved")
            self.donors[mode] = (path, tag)
        return self.donors[mode]

    def trial(self, i: int, rng: random.Random) -> Tuple[str, str, str, str]:
        """One drawn fault: (mode, kind, detail, outcome)."""
        mode = rng.choice(MODES)
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        tdir = os.path.join(self.base, f"trial{i}")
        earlier, tag = os.path.join(tdir, "E"), 10 * i + 1
        os.makedirs(tdir)
        try:
            donor, _ = self.donor(mode)
            donor_before = _digests(donor)
            saved = self.call(rank_save, mode, tag, earlier)
            if saved != "saved":
                return mode, kind, "", f"earlier-save-failed:{saved}"
            before = _digests(earlier)
            if kind in ("flip", "swap", "swap-set", "delete", "relink"):
                detail = self.damage(kind, earlier, donor, rng)
                outcome = self.judge_damaged(earlier, tag)
            else:
                detail, outcome = getattr(self, kind.replace("-", "_"))(mode, tdir, tag, rng)
                again = self.call(rank_load, earlier, tag)
                if _digests(earlier) != before or again not in ("exact", "lost-peer"):
                    outcome = "EARLIER-DAMAGED"
                elif again == "lost-peer":
                    outcome = "env-lost-peer"
            if _digests(donor) != donor_before:
                outcome = "EARLIER-DAMAGED"
            return mode, kind, detail, outcome
        except _Hang:
            return mode, kind, "", "HANG"
        finally:
            shutil.rmtree(tdir, ignore_errors=True)

    def damage(self, kind: str, ckpt: str, donor: str, rng: random.Random) -> str:
        """Applies a drawn fault to `ckpt`'s files (with `donor`'s); names the files."""
        files = [f for f in _files(ckpt) if os.path.getsize(os.path.join(ckpt, f))]
        shared = [f for f in files if os.path.exists(os.path.join(donor, f))]
        pick = rng.choice(files if kind in ("flip", "delete") else shared)
        path = os.path.join(ckpt, pick)
        if kind == "flip":
            with open(path, "r+b") as f:
                f.seek(at := rng.randrange(os.path.getsize(path)))
                byte = f.read(1)[0] ^ (1 << rng.randrange(8))
                f.seek(at)
                f.write(bytes([byte]))
        elif kind == "delete":
            os.remove(path)
        elif kind == "relink":
            how = rng.choice(("symlink", "hardlink"))
            link = os.symlink if how == "symlink" else os.link
            _replace(path, lambda tmp: link(os.path.join(donor, pick), tmp))
            return f"{how}:{os.path.basename(pick)}"
        else:  # swap: one file; swap-set: a data file with its sidecar, or every local part
            group = [pick]
            if kind == "swap-set":
                group = [f for f in shared if f.endswith("_local.pt")]
                if not group:
                    data = rng.choice([f for f in shared if f.endswith(".distcp")])
                    group = [data, data + ".sums"]
            for rel in group:
                _replace(
                    os.path.join(ckpt, rel),
                    lambda t, r=rel: shutil.copyfile(os.path.join(donor, r), t),
                )
            return "+".join(os.path.basename(g) for g in group)
        return os.path.basename(pick)

    def judge_damaged(self, ckpt: str, tag: int) -> str:
        """A damaged checkpoint's load, and where every rank refused it, `verify`."""
        from dist_checkpointing.tools.verify import verify_checkpoint

        got = self.call(rank_load, ckpt, tag)
        if got == "refused":
            try:
                if verify_checkpoint(ckpt).ok:
                    return "VERIFY-PASSED"
            except CheckpointingException:
                pass  # (reported as an error: not a checkpoint it can read)
            except Exception as e:
                return f"UNEXPECTED:verify raised {type(e).__name__}"
            return "refused-on-every-rank"
        return {"exact": "loaded-exact", "lost-peer": "env-lost-peer"}.get(got, got)

    def judge_new(self, saved: str, ckpt: str, tag: int) -> str:
        """The outcome of a new save that met a fault (`saved`: its ranks' outcome)."""
        if saved == "saved":
            got = self.call(rank_load, ckpt, tag)
            return "saved-loads-exact" if got == "exact" else {"refused": "SAVE-LOST"}.get(got, got)
        if saved in ("refused", "lost-peer"):
            if dc.check_is_distributed_checkpoint(ckpt):
                return "FAILED-BUT-COMMITTED"
            return "save-failed-not-committed"
        return saved

    def links_in_target(
        self, mode: str, tdir: str, tag: int, rng: random.Random
    ) -> Tuple[str, str]:
        earlier, target = os.path.join(tdir, "E"), os.path.join(tdir, "T")
        how = rng.choice(("symlink", "hardlink"))
        link = os.symlink if how == "symlink" else os.link
        names = [f for f in _files(earlier) if os.path.basename(f) != "metadata.json"]
        chosen = [f for f in names if rng.random() < 0.7] or [rng.choice(names)]
        for rel in chosen:
            os.makedirs(os.path.dirname(os.path.join(target, rel)), exist_ok=True)
            link(os.path.join(earlier, rel), os.path.join(target, rel))
        detail = f"{how}s to {len(chosen)} of {len(names)} files"
        detail += ", claim linked" if any("claim" in f for f in chosen) else ""
        # `.metadata` and data files without our claim and record: a stock DCP checkpoint
        was_one = dc.check_is_distributed_checkpoint(target)
        outcome = self.judge_new(self.call(rank_save, mode, tag + 1, target), target, tag + 1)
        if was_one and outcome == "FAILED-BUT-COMMITTED":  # refused: it held a checkpoint
            outcome = "refused-target-holds-a-checkpoint"
        return detail, outcome

    def full_disk(self, mode: str, tdir: str, tag: int, rng: random.Random) -> Tuple[str, str]:
        victim, nth = rng.randrange(2), rng.randint(1, 3)
        pattern = rng.choice(("*_local*" if mode == "local" else "*.distcp", "*"))
        target = os.path.join(tdir, "T")
        saved = self.call(rank_save, mode, tag + 1, target, victim, pattern, nth)
        return f"rank {victim}, write {nth} of {pattern}", self.judge_new(saved, target, tag + 1)

    def concurrent_job(self, mode: str, tdir: str, tag: int, rng: random.Random) -> Tuple[str, str]:
        """A second 2-rank job saves into the same new directory at the same moment."""
        if self.other is None or not self.other.alive:
            self.other = self.World(2)
        target, worlds = os.path.join(tdir, "T"), (self.world, self.other)
        for job, w in enumerate(worlds):
            delays = [rng.uniform(0, 0.02) for _ in range(2)]
            for inbox in w.inboxes:
                inbox.put((rank_race, (mode, tag + 1 + job, target, tdir, job, delays)))
        results = [_one(self._collect(w, rank_race)) for w in worlds]
        if results == ["saved", "saved"]:
            return "", "BOTH-JOBS-SAVED"
        if "saved" not in results:
            return "", "neither-job-saved" if results == ["refused"] * 2 else "/".join(results)
        won = results.index("saved")
        outcome = self.judge_new("saved", target, tag + 1 + won)
        return f"job {won} won", outcome.replace("saved-loads", "one-job-saved-loads")

    def kill(self, mode: str, tdir: str, tag: int, rng: random.Random) -> Tuple[str, str]:
        """One rank SIGKILLed during a save, in a world of its own that saved before (its
        first save also creates the library's process group)."""
        victim, moment = rng.randrange(2), rng.choice(("byte", "time", "commit"))
        x = rng.uniform(1, 4000) if moment == "byte" else rng.uniform(0, 0.6)
        target, world = os.path.join(tdir, "T"), self.World(2)
        self._collect(world, rank_save, mode, tag + 2, os.path.join(tdir, "before"))
        got = world.run_tolerating_deaths(
            rank_killed_save, mode, tag + 1, target, victim, moment, x, timeout=_TIMEOUT_S
        )
        detail, survivor = f"rank {victim} at {moment} {x:.2f}", got[1 - victim]
        if survivor is None:
            return detail, "HANG"
        if survivor.error is not None:
            return detail, f"UNEXPECTED:{type(survivor.error).__name__}"
        said, seconds = survivor.value
        detail += f"; survivor: {said} after {seconds:.1f} s"
        committed = dc.check_is_distributed_checkpoint(target)
        loaded = self.call(rank_load, target, tag + 1) if committed else "not committed"
        if loaded == "WRONG-VALUE":
            return detail, loaded
        if said in ("saved", "after-commit"):
            name = "save-returned" if said == "saved" else "after-commit-reported"
            return detail, f"{name}-loads-exact" if loaded == "exact" else "SAVE-LOST"
        if committed:
            return (
                detail,
                "COMMITTED-REPORTED-FAILED" if loaded == "exact" else "COMMITTED-UNLOADABLE",
            )
        return detail, "save-failed-not-committed"


def report(rows: List[Dict[str, Any]]) -> int:
    """Prints the counts as a table (faults per mode, outcomes per fault kind) and the
    totals; returns 1 if any must-be-zero outcome occurred."""
    print("| fault | sync | async | local | outcomes |\n|---|---|---|---|---|")
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        modes = " | ".join(str(sum(r["mode"] == m for r in mine)) for m in MODES)
        outs = collections.Counter(r["outcome"] for r in mine)
        print(
            f"| {kind} | {modes} | " + ", ".join(f"{o} {n}" for o, n in sorted(outs.items())) + " |"
        )
    total = collections.Counter(r["outcome"] for r in rows)
    bad = sum(n for o, n in total.items() if o.startswith(MUST_BE_ZERO))
    waits = [
        float(r["detail"].split(" after ")[-1][:-2]) for r in rows if "survivor:" in r["detail"]
    ]
    print(f"{len(rows)} faults, {sum(r['s'] for r in rows):.0f} s of trials; must-be-zero: {bad}")
    print(f"the survivor of a SIGKILL answered within {max(waits, default=0):.1f} s")
    print(", ".join(f"{o}: {n}" for o, n in total.most_common()))
    return 1 if bad else 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--trials", type=int, default=1000, help="faults drawn (one per trial)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log", default="", help="JSON lines of finished trials (resumed from)")
    args = p.parse_args(argv)
    rows = []
    if args.log and os.path.exists(args.log):
        with open(args.log) as f:
            rows = [
                r for r in map(json.loads, f) if r["seed"] == args.seed and r["i"] < args.trials
            ]
    done = {r["i"] for r in rows}
    from benchmarks import soak_faults as this  # rank functions by their importable name

    # a survivor of a lost peer raises within this (the ranks inherit it): a third of the
    # hard timeout of a call
    os.environ.setdefault("DIST_CKPT_TIMEOUT_S", str(int(_TIMEOUT_S / 3)))
    with tempfile.TemporaryDirectory() as tmp, open(args.log or os.devnull, "a") as log:
        soak = this.Soak(tmp) if len(done) < args.trials else None
        for i in (i for i in range(args.trials) if i not in done):
            assert soak is not None
            t0 = time.monotonic()
            mode, kind, detail, outcome = soak.trial(i, random.Random(f"{args.seed}/{i}"))
            row = dict(seed=args.seed, i=i, mode=mode, kind=kind, detail=detail, outcome=outcome)
            rows.append({**row, "s": round(time.monotonic() - t0, 2)})
            print(json.dumps(rows[-1]), file=log, flush=True)
        for w in (soak.world, soak.other) if soak else ():
            if w is not None:
                w.close(kill=True)
    return report(sorted(rows, key=lambda r: r["i"]))


if __name__ == "__main__":
    sys.exit(main())
