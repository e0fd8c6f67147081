"""Choosing the write path of a synchronous save (O_DIRECT or page cache + fsync) by measuring it.

Which path writes a checkpoint faster depends on the machine: O_DIRECT skips the copy into
the page cache (0.5-0.8x the CPU seconds of a buffered save of 1 GiB on this project's
2-core CI VM) and leaves the cache to the training job, but each request waits for the device;
buffered writes queue the whole file at once and let the kernel write it back in large
requests (`start_writeback` starts that as the file is written; the final fsync waits for
it). On the CI VM the two measured within the run-to-run noise of each other on one day
(`benchmarks/bench_save.py`) and O_DIRECT 2x ahead on another (4 ranks x 4 GiB: 1.23 s
against 2.50 s); on a GPU node's local NVMe, O_DIRECT saves with 4 files per rank took
0.75x the time of one raw O_DIRECT stream. So the first synchronous save into a file
system writes a small scratch file both ways, alternating, each write followed by its
fsync, and keeps the answer for every later save on that file system (keyed by device
number) in this process. A `torch_dist` save's ranks then exchange their own
measurements at every save and all keep the combination (`combine`, `keep`), so that all
write the same way.

O_DIRECT stays the choice unless the page cache is clearly faster: by `BUFFERED_MARGIN` in
total and in every pair of probes (one probe on a busy machine is noisy; the read probe,
`storage.probe`, asks less of O_DIRECT: half the pairs; here the default is O_DIRECT,
which costs less CPU, and the page cache must win them all).
The probe writes `2 * ROUNDS * PROBE_BYTES` (24 MiB) once per process and file system, at
the first save writing at least `MIN_PROBED_SAVE` bytes there, into a
scratch file in the checkpoint directory that is removed before the save goes on. Its
writes bypass the `faults` seam: they are measurements, no checkpoint data.

A new measurement is also recorded on the node (`storage.records`, as the read probe's), and
a later process on the same machine takes the record instead of writing the scratch file:
the probe cost 0.06 s of the first save of a restarted job (4 ranks x 1 GiB on the CI VM,
docs/performance.md, sixteenth pass). A record only picks between write paths that store the
same bytes: a stale one costs speed, never correctness.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import buffers, records
from .direct import PathLike, direct_allowed, refuse_direct

__all__ = [
    "BUFFERED_MARGIN",
    "MIN_PROBED_SAVE",
    "PROBE_BYTES",
    "RECORD",
    "ROUNDS",
    "WriteProbe",
    "combine",
    "forget_write_probes",
    "keep",
    "local_write_probe",
    "prefer_direct_writes",
    "write_probe_result",
]

logger = logging.getLogger(__name__)

#: bytes of each probe write (one request, then fsync)
PROBE_BYTES = 4 << 20
#: pairs of probes (one O_DIRECT and one buffered write each, in alternating order)
ROUNDS = 3
#: buffered writes are chosen only when faster than O_DIRECT by this factor
BUFFERED_MARGIN = 0.9
#: a save writing fewer bytes than this (per rank) does not probe: it uses an earlier
#: measurement of its file system, else O_DIRECT (the probe would cost a large share of it)
MIN_PROBED_SAVE = 64 << 20


@dataclass(frozen=True)
class WriteProbe:
    """One file system's measurement: seconds per (O_DIRECT, buffered) pair of writes."""

    pairs: Tuple[Tuple[float, float], ...]
    nbytes: int  # bytes written by each probe
    #: taken from the node's record of an earlier process's measurement (`storage.records`),
    #: not measured by this one
    recorded: bool = False

    def value(self) -> Dict[str, Any]:
        """The measurement as a record's value (`storage.records`)."""
        return {"nbytes": self.nbytes, "pairs": [list(p) for p in self.pairs]}

    @classmethod
    def from_value(cls, value: Dict[str, Any]) -> WriteProbe:
        """A measurement from a record's value, marked `recorded`.

        Raises:
            ValueError, KeyError, TypeError: a malformed value.
        """
        pairs = tuple((float(d), float(b)) for d, b in value["pairs"])
        nbytes = int(value["nbytes"])
        if not (pairs and nbytes > 0 and all(d > 0 and b > 0 for d, b in pairs)):
            raise ValueError(f"not a measurement: {value!r}")
        return cls(pairs, nbytes, recorded=True)

    @property
    def direct_s(self) -> float:
        """Total seconds of the O_DIRECT probes."""
        return sum(d for d, _ in self.pairs)

    @property
    def buffered_s(self) -> float:
        """Total seconds of the buffered probes."""
        return sum(b for _, b in self.pairs)

    @property
    def prefer_direct(self) -> bool:
        """False only when buffered writes were clearly faster: in total and in every pair."""
        if not self.pairs:
            return True
        if not self.buffered_s < BUFFERED_MARGIN * self.direct_s:
            return True
        return not all(b < BUFFERED_MARGIN * d for d, b in self.pairs)


#: the kind of this module's records on the node (`storage.records`)
RECORD = "write-path"
#: earlier processes' records taken, and new measurements recorded once
_records: records.Measurements[WriteProbe] = records.Measurements(RECORD, WriteProbe.from_value)

#: the path in use per file system: this process's own measurement, or what the ranks
#: agreed on (`combine`, `keep`)
_results: Dict[int, WriteProbe] = {}
#: this process's own measurement per file system (what it contributes to an agreement)
_local: Dict[int, WriteProbe] = {}
_lock = threading.Lock()


def _write_once(path: str, view: memoryview, direct: bool) -> float:
    """Seconds to create `path`, write `view` in one request and fsync it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    t0 = time.perf_counter()
    fd = os.open(path, flags, 0o600)
    try:
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], done)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _measure(directory: str) -> WriteProbe:
    """Writes the scratch file both ways, alternating; removes it."""
    path = os.path.join(directory, f".write_probe.{os.getpid()}.{threading.get_ident()}")
    # page-aligned, as O_DIRECT needs, and shared memory like the images that async and
    # local saves write from. Sync saves stream through chunk buffers in huge pages, from
    # which O_DIRECT writes ran faster still (`buffers.ChunkBuffers`): measured from those,
    # the probe would favour O_DIRECT more than the images' writes warrant
    data = np.frombuffer(mmap.mmap(-1, PROBE_BYTES), dtype=np.uint8)
    data[:] = 0x5A  # not zeros: some virtual disks skip writing zero blocks
    view = memoryview(data)  # type: ignore[arg-type]
    try:
        # untimed: creating the file (and committing that with the first fsync) cost
        # 4x a probe write here, and would land on whichever path went first
        _write_once(path, view[: buffers.ALIGN], False)
        pairs: List[Tuple[float, float]] = []
        for i in range(ROUNDS):
            if i % 2 == 0:
                d = _write_once(path, view, True)
                b = _write_once(path, view, False)
            else:
                b = _write_once(path, view, False)
                d = _write_once(path, view, True)
            pairs.append((d, b))
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return WriteProbe(tuple(pairs), PROBE_BYTES)


def _direct_device(directory: PathLike) -> Optional[Tuple[str, int]]:
    """`(directory, its device number)`, or None where O_DIRECT is unusable there.

    Raises:
        OSError: the directory cannot be examined.
    """
    d = os.fspath(directory)
    if not hasattr(os, "O_DIRECT") or not direct_allowed(d):
        return None
    return d, os.stat(d).st_dev


def prefer_direct_writes(directory: PathLike, nbytes: int = MIN_PROBED_SAVE) -> bool:
    """Whether a synchronous save into `directory` should write with O_DIRECT, by measurement.

    Measured on the first call for a file system (see the module docstring) and remembered.
    False where O_DIRECT is unavailable or was refused in `directory` (then the refusal is
    recorded, as a failed O_DIRECT write would).

    Args:
        directory: an existing directory the save writes into.
        nbytes: the bytes the save writes here; below `MIN_PROBED_SAVE` nothing is
            measured (an earlier measurement is used, else O_DIRECT).

    Returns:
        True unless buffered writes measured clearly faster (or O_DIRECT is not usable).

    Raises:
        OSError: the directory cannot be written (the save would fail the same way).
    """
    where = _direct_device(directory)
    if where is None:
        return False
    d, dev = where
    with _lock:
        result = _results.get(dev)
    if result is None:
        result = local_write_probe(d, nbytes)
        if result is not None:  # a new measurement is recorded (once)
            _records.record(dev, d, result)
    if result is None:  # not measured: O_DIRECT, unless the probe's write was just refused
        return direct_allowed(d)
    return result.prefer_direct


def local_write_probe(directory: PathLike, nbytes: int = MIN_PROBED_SAVE) -> Optional[WriteProbe]:
    """This process's own measurement of `directory`'s file system, measured on the first
    call (see the module docstring) and remembered; what a rank contributes to `combine`.
    An earlier process's measurement recorded on the node is taken instead of measuring
    (not recorded again here: `keep` records what the ranks agree on).

    Returns:
        The measurement, or None where nothing was measured: O_DIRECT is unusable there
        (refused now, or before), or the save is smaller than `MIN_PROBED_SAVE` and nothing
        was measured or recorded before.

    Raises:
        OSError: the directory cannot be written (the save would fail the same way).
    """
    where = _direct_device(directory)
    if where is None:
        return None
    d, dev = where
    with _lock:  # one probe per file system, also when several threads ask at once
        result = _local.get(dev)
        if result is None:
            result = _records.take(d)
            if result is None and nbytes < MIN_PROBED_SAVE:
                return None
        if result is None:
            try:
                result = _measure(d)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                refuse_direct(d, e, "writes")
                return None
        if dev not in _local:
            _local[dev] = result
            _results.setdefault(dev, result)
            _log_choice(d, "record on this node" if result.recorded else "probe", result)
    return result


def _log_choice(directory: str, what: str, result: WriteProbe) -> None:
    logger.info(
        "write path for %s's file system: %s (%s of %d x %d MiB each way, with fsync: "
        "O_DIRECT %.2f GB/s, page cache %.2f GB/s)",
        directory,
        "O_DIRECT" if result.prefer_direct else "page cache",
        what,
        len(result.pairs),
        result.nbytes >> 20,
        result.nbytes * len(result.pairs) / max(result.direct_s, 1e-9) / 1e9,
        result.nbytes * len(result.pairs) / max(result.buffered_s, 1e-9) / 1e9,
    )


def combine(probes: Sequence[Optional[WriteProbe]]) -> Optional[WriteProbe]:
    """Every rank's measurements as one: the page cache is chosen only if it was clearly
    faster in every pair of every rank (`WriteProbe.prefer_direct` over all the pairs).

    A save waits for its slowest rank, and ranks probing on their own can choose
    differently (as the read probes did, `storage.probe.combine`): on this project's 2-core
    VM, writes through the page cache of 4 ranks x 4 GiB took 2.50 s against 1.23 s with
    O_DIRECT (alternated), so one rank writing buffered would set the pace.

    Ranks that took the same record (`storage.records`) count it once, so that a
    combination of records decides as the save that measured them did, and is not recorded
    again (`keep`).

    Returns:
        The combined measurement, or None when no rank measured.
    """
    fresh = [p for p in probes if p is not None and not p.recorded]
    got = fresh + list(dict.fromkeys(p for p in probes if p is not None and p.recorded))
    if not got:
        return None
    return WriteProbe(
        tuple(pair for p in got for pair in p.pairs), got[0].nbytes, recorded=not fresh
    )


def keep(directory: PathLike, result: WriteProbe) -> None:
    """Uses `result` (see `combine`) for `directory`'s file system from now on, and records
    it on the node for later processes where it holds a new measurement."""
    d = os.fspath(directory)
    dev = os.stat(d).st_dev
    with _lock:
        before = _results.get(dev)
        _results[dev] = result
    if before is None or before.prefer_direct != result.prefer_direct:
        _log_choice(d, "all ranks' probes", result)
    _records.record(dev, d, result)


def write_probe_result(directory: PathLike) -> Optional[WriteProbe]:
    """The measurement kept for `directory`'s file system, or None if not measured yet."""
    with _lock:
        return _results.get(os.stat(os.fspath(directory)).st_dev)


def forget_write_probes() -> None:
    """Forgets every measurement (tests; a remounted or reconfigured file system)."""
    with _lock:
        _results.clear()
        _local.clear()
    _records.forget()
