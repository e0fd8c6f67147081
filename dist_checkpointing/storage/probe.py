"""Choosing the read path (page cache or O_DIRECT) by measuring it, once per file system.

Which path reads a file faster depends on the machine: on the VMs we measured, reads through
the page cache beat O_DIRECT (the host's cache and readahead sit behind the virtual disk);
on local NVMe, O_DIRECT saves the copy out of the page cache. So the first large read on a
file system times both paths as a load runs them (the same read functions, into a
destination placed as torch places tensors, which O_DIRECT reaches through a bounce buffer) on
a few small regions of the file it is about to read (cold: O_DIRECT never hits the cache, and
the buffered regions are evicted from it first), and the answer is kept for every later read
on that file system (keyed by device number).

A `torch_dist` load starts with an exchange: every rank probes one data file (`local_probe`)
and all keep the combination (`combine`, `keep`), so every rank reads the same way
(`ReadProbe.prefer_direct` over all ranks' pairs). Reads outside a load probe on their own.

The probe costs `4 * PROBE_BYTES` of reads (two pairs) once per process and file system, or
`2 * PROBE_BYTES` (one pair) per rank in a load of several ranks, where every rank's pair
counts: at 4 ranks x 1 GiB one pair per rank took 0.23 s of a first load of 0.68-0.71 s,
whose later repeats took 0.45-0.47 s. A job restarting on the same node pays it on the one
load it waits for, so every measurement is also recorded on the node (`storage.records`,
for a day, until a reboot) and a later process takes the record instead of measuring
(`ReadProbe.recorded`). The regions read through the page cache stay there for the load that
follows. The page cache is chosen only where it wins clearly, in total and in at least half
of the pairs (one probe on a busy machine is noisy), else O_DIRECT; even then a region
already in the page cache (`cached`: e.g. a checkpoint loaded a moment ago) is read from
there. Its reads bypass the `faults` seam: they are
measurements, their bytes are never returned to anyone.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import buffers, records
from .direct import (
    BUFFERED_DEPTH,
    _buffered,
    _direct,
    direct_allowed,
    libc_function,
    refuse_direct,
)
from .inflight import DEPTH

__all__ = [
    "PROBE_BYTES",
    "ReadProbe",
    "cached",
    "combine",
    "keep",
    "local_probe",
    "prefer_direct_reads",
    "probe_result",
    "forget_probes",
]

logger = logging.getLogger(__name__)

#: size of each probed region (four are read: two per path, alternating): large enough for
#: the page cache's readahead to reach its pace. With 8 MiB regions the two paths measured
#: even here, or O_DIRECT 1.7-3x faster (2 ranks' 4 pairs, in one benchmark run)
#: where whole-file raw reads in the same runs were 1.0-3.4x faster through the page
#: cache (`benchmarks.bench_disk`'s ceiling); with 32 MiB regions the
#: page cache measured 1.8-2.1x faster in 8 of 8 pairs, as whole files read
PROBE_BYTES = 32 << 20
#: bytes per probe request: a load's (`torch_dist.reader.READ_REQUEST`)
PROBE_REQUEST = 8 << 20
#: the page cache is chosen only when it is faster than O_DIRECT by this factor (in total
#: and in at least half of the pairs)
DIRECT_MARGIN = 0.9


@dataclass(frozen=True)
class ReadProbe:
    """One file system's measurement: seconds for the same bytes by each path."""

    direct_s: float
    buffered_s: float
    nbytes: int
    #: the same per pair of regions (one O_DIRECT, one buffered read each); empty: unknown
    pairs: Tuple[Tuple[float, float], ...] = ()
    #: taken from the node's record of an earlier process's measurement (`storage.records`),
    #: not measured by this one
    recorded: bool = False

    def value(self) -> Dict[str, Any]:
        """The measurement as a record's value (`storage.records`)."""
        return {
            "direct_s": self.direct_s,
            "buffered_s": self.buffered_s,
            "nbytes": self.nbytes,
            "pairs": [list(p) for p in self.pairs],
        }

    @classmethod
    def from_value(cls, value: Dict[str, Any]) -> ReadProbe:
        """A measurement from a record's value, marked `recorded`.

        Raises:
            ValueError, KeyError, TypeError: a malformed value.
        """
        pairs = tuple((float(d), float(b)) for d, b in value["pairs"])
        direct_s, buffered_s = float(value["direct_s"]), float(value["buffered_s"])
        nbytes = int(value["nbytes"])
        if not (direct_s > 0 and buffered_s > 0 and nbytes > 0 and pairs):
            raise ValueError(f"not a measurement: {value!r}")
        return cls(direct_s, buffered_s, nbytes, pairs, recorded=True)

    @property
    def prefer_direct(self) -> bool:
        """Whether to read with O_DIRECT: unless the page cache was clearly faster, in total
        and in at least half of the pairs (so that one outlying pair cannot decide alone:
        one probe is a few small reads on a shared machine).

        Why a tie goes to O_DIRECT: the two mistakes cost differently. At 4 ranks x 4 GiB
        the probe tied twice (O_DIRECT 0.171 s in total against 0.176 s, and 0.236 s against
        0.246 s) while whole loads forced to O_DIRECT ran at 0.82x the raw ceiling (plain),
        0.87x (rows) and 0.80x (columns) and forced through the page cache at 0.44x, 0.55x
        and 0.78x; the worst the other way, over every benchmark run on our VMs, was a
        2-rank plain load 0.89x as fast with O_DIRECT as through the page cache
        (docs/performance.md, twelfth and fourteenth passes). Before, O_DIRECT had to win
        clearly, and the page cache was chosen on those ties.
        """
        if not self.buffered_s < DIRECT_MARGIN * self.direct_s:
            return True
        won = sum(b < DIRECT_MARGIN * d for d, b in self.pairs)
        return 2 * won < len(self.pairs)


#: the kind of this module's records on the node (`storage.records`)
RECORD = "read-path"
#: earlier processes' records taken, and new measurements recorded once
_records: records.Measurements[ReadProbe] = records.Measurements(RECORD, ReadProbe.from_value)

_results: Dict[int, ReadProbe] = {}
#: this process's own measurements (`local_probe`), kept apart from the combined results
_local: Dict[int, ReadProbe] = {}
_lock = threading.Lock()


def _destination(nbytes: int) -> np.ndarray:
    """A resident buffer placed as torch places tensor storage: 64-byte aligned, never at a
    512-byte boundary, so O_DIRECT cannot read into it and goes through a bounce buffer."""
    raw = np.zeros(nbytes + 2 * buffers.ALIGN, dtype=np.uint8)
    # np.zeros maps no page: written here, so that the first timed region (an O_DIRECT one)
    # does not pay the destination's page faults; at 2 ranks x 1 GiB that region took
    # 0.07-0.10 s where the next O_DIRECT one took 0.014-0.024 s, and O_DIRECT lost the
    # only pair each rank measures. A loaded model's tensors are resident too.
    raw[:: buffers.ALIGN] = 1
    shift = (-raw.ctypes.data) % buffers.ALIGN + _TORCH_ALIGN
    return raw[shift : shift + nbytes]


#: the alignment of torch's CPU allocations (c10's default), which O_DIRECT cannot use
_TORCH_ALIGN = 64


def _measure(path: str, pairs: int = 2, direct_first: bool = True) -> Optional[ReadProbe]:
    size = os.path.getsize(path)
    if size < 4 * PROBE_BYTES + buffers.ALIGN:  # whatever `pairs`: the same files measured
        return None
    # `2 * pairs` aligned regions at the file's end, alternating paths to share the noise;
    # each is read as a load reads a chunk (the same functions, 8 MiB requests into a
    # tensor-like destination), so O_DIRECT pays its bounce copies and the page cache keeps
    # its readahead: single raw requests into aligned memory favoured O_DIRECT on this
    # project's CI VM where whole loads through it took 1.5-2.1x as long
    last = (size - 2 * pairs * PROBE_BYTES) // buffers.ALIGN * buffers.ALIGN
    regions = [last + i * PROBE_BYTES for i in range(2 * pairs)]
    out = _destination(PROBE_BYTES)
    # the bounce buffer that O_DIRECT reads through is made and faulted in before the clock
    # starts, as a load finds it pooled: a probe's only pair per rank (in a load of
    # several) counted a fresh buffer's page faults against O_DIRECT
    warm = buffers.bounce()
    warm[:: buffers.ALIGN] = 0
    buffers.give_back(warm)
    times: Dict[bool, List[float]] = {True: [], False: []}
    for i, offset in enumerate(regions):
        use_direct = (i % 2 == 0) == direct_first
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if use_direct else 0))
        try:
            if not use_direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, offset, PROBE_BYTES, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            if use_direct:
                _direct(fd, offset, out, path, None, PROBE_REQUEST, DEPTH)
            else:
                _buffered(fd, offset, out, path, None, PROBE_REQUEST, BUFFERED_DEPTH)
            times[use_direct].append(time.perf_counter() - t0)
        finally:
            os.close(fd)
    return ReadProbe(
        sum(times[True]),
        sum(times[False]),
        pairs * PROBE_BYTES,
        tuple(zip(times[True], times[False])),
    )


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

#: cachestat(2), Linux 6.5+ (new system calls share one number on every architecture)
_SYS_CACHESTAT = 451
_syscall: Any = None  # None: not looked up yet; False: unavailable


def cached_pages(fd: int, offset: int, length: int) -> Optional[int]:
    """Pages of the region resident in the page cache, by `cachestat(2)`, which starts no
    I/O; None where the kernel (before 6.5) or the platform lacks it."""
    global _syscall
    if _syscall is None:
        _syscall = libc_function("syscall") or False
    if not _syscall:
        return None
    rng, stat = _CachestatRange(offset, length), _Cachestat()
    got = _syscall(
        ctypes.c_long(_SYS_CACHESTAT),
        ctypes.c_int(fd),
        ctypes.byref(rng),
        ctypes.byref(stat),
        ctypes.c_uint(0),
    )
    if got != 0:
        if ctypes.get_errno() == errno.ENOSYS:
            _syscall = False
        return None
    return int(stat.nr_cache)


def cached(path: str, offset: int, length: int, samples: int = 8) -> bool:
    """Whether the region is resident in the page cache (then it is read from there).

    A checkpoint loaded a moment ago (or written through the page cache) is read from
    memory instead of from the disk with O_DIRECT. Counted with `cachestat(2)` where the
    kernel has it: every page of the region must be resident. Elsewhere, one byte is asked
    for at `samples` spread offsets with RWF_NOWAIT, which fails instead of waiting for the
    disk (a miss still starts readahead, which a later sample may find done: an evicted
    region can then look resident, and is read through the page cache). False where
    neither is supported.

    Args:
        path: the file.
        offset: where the region starts.
        length: its size in bytes.
        samples: offsets probed without `cachestat`.
    """
    if length <= 0:
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        first = offset - offset % _PAGE
        pages = cached_pages(fd, first, offset + length - first)
        if pages is not None:
            return pages >= -(-(offset + length - first) // _PAGE)
        flag = getattr(os, "RWF_NOWAIT", None)
        if flag is None:
            return False
        one = bytearray(1)
        for i in range(samples):
            at = offset + (length - 1) * i // max(1, samples - 1)
            if os.preadv(fd, [one], at, flag) != 1:
                return False
    except OSError:  # EAGAIN: not resident; EOPNOTSUPP and others: cannot tell
        return False
    finally:
        os.close(fd)
    return True


def local_probe(path: str, pairs: int = 2, direct_first: bool = True) -> Optional[ReadProbe]:
    """This process's own measurement for `path`'s file system (made once): what ranks
    combine (`combine`) before one result is kept for reads (`keep`).

    Args:
        path: a data file the load is about to read.
        pairs: pairs of regions to read (one O_DIRECT, one through the page cache each):
            ranks that combine their probes can each read fewer, since the decision is
            made over every rank's pairs.
        direct_first: whether each pair reads its O_DIRECT region first. Ranks that
            combine their probes alternate it, so that a disk slow when the probes start
            weighs on both paths alike: with O_DIRECT first on every rank, 3 of 4 ranks
            measured it at 0.066-0.072 s (the fourth 0.028 s) against 0.054-0.075 s through
            the page cache, and the page cache was chosen for a 4-rank x 4 GiB load that
            ran at 0.67x the raw ceiling, where O_DIRECT had given 0.85-0.90x at 1 GiB
            (docs/performance.md, fourteenth pass).

    Returns:
        The measurement, or None where none can be made (no O_DIRECT, a small file, an
        error).
    """
    dev = _probe_device(path)
    if dev is None:
        return None
    with _lock:
        if dev not in _local:
            got = _records.take(path) or _measured(path, pairs, direct_first)
            if got is None:  # e.g. a small file: a later, larger one is measured
                return None
            _local[dev] = got
        return _local[dev]


def combine(probes: List[Optional[ReadProbe]]) -> Optional[ReadProbe]:
    """Every rank's measurements as one, decided over all their pairs together
    (`ReadProbe.prefer_direct`), so that every rank reads the same way (ranks probing on
    their own disagreed: on this project's 2-core VM, 4 ranks
    loading 1 GiB chose O_DIRECT on 1 to 3 of them, which then read for up to 1.05 s where
    the others took 0.40-0.68 s through the page cache, and the load waited for the
    slowest).

    Ranks that took the same record (`storage.records`: every node of an earlier job
    recorded the same combination) count it once, so that a combination of records decides
    as the load that measured them did and is not recorded again.

    Returns:
        The combined measurement, or None when no rank measured.
    """
    fresh = [p for p in probes if p is not None and not p.recorded]
    got = fresh + list(dict.fromkeys(p for p in probes if p is not None and p.recorded))
    if not got:
        return None
    return ReadProbe(
        sum(p.direct_s for p in got),
        sum(p.buffered_s for p in got),
        sum(p.nbytes for p in got),
        tuple(pair for p in got for pair in p.pairs),
        recorded=not fresh,
    )


def keep(path: str, result: ReadProbe) -> None:
    """Keeps `result` (see `combine`) for `path`'s file system, replacing what was kept, and
    records it on the node for later processes where it holds a new measurement."""
    dev = os.stat(path).st_dev
    with _lock:
        before = _results.get(dev)
        _results[dev] = result
    if before is None or before.prefer_direct != result.prefer_direct:
        _log_choice(os.path.dirname(path), result)
    _records.record(dev, path, result)


def _probe_device(path: str) -> Optional[int]:
    """`path`'s device number, where O_DIRECT may be probed there; else None."""
    if not hasattr(os, "O_DIRECT") or not direct_allowed(os.path.dirname(path)):
        return None
    try:
        return os.stat(path).st_dev
    except OSError:
        return None


def _measured(path: str, pairs: int = 2, direct_first: bool = True) -> Optional[ReadProbe]:
    """`_measure`, or None on an error (a refusal of O_DIRECT is recorded for the directory)."""
    try:
        return _measure(path, pairs, direct_first)
    except OSError as e:
        if e.errno == errno.EINVAL:
            refuse_direct(os.path.dirname(path), e, "reads")
        return None


def _log_choice(directory: str, result: ReadProbe) -> None:
    logger.info(
        "read path for %s's file system: %s (%s%d probe pairs of %d MiB: O_DIRECT %.2f GB/s, "
        "page cache %.2f GB/s)",
        directory,
        "O_DIRECT" if result.prefer_direct else "page cache",
        "recorded on this node: " if result.recorded else "",
        len(result.pairs),
        PROBE_BYTES >> 20,
        result.nbytes / max(result.direct_s, 1e-9) / 1e9,
        result.nbytes / max(result.buffered_s, 1e-9) / 1e9,
    )


def prefer_direct_reads(path: str) -> bool:
    """Whether whole-chunk reads of `path` should use O_DIRECT, by measurement.

    Measured on the first call for a file system with a file large enough to probe (see the
    module docstring) and remembered; smaller files, and file systems refusing O_DIRECT,
    read through the page cache.

    Args:
        path: a file about to be read.

    Returns:
        True when O_DIRECT measured clearly faster than the page cache on its file system.
    """
    dev = _probe_device(path)
    if dev is None:
        return False
    with _lock:  # one probe per file system, also when several threads ask at once
        result = _results.get(dev)
        if result is None:
            result = _records.take(path)
            if result is None:
                result = _measured(path)
                if result is None:
                    return False
            _results[dev] = result
            _log_choice(os.path.dirname(path), result)
    _records.record(dev, path, result)  # a new measurement, once
    return result.prefer_direct


def probe_result(path: str) -> Optional[ReadProbe]:
    """The measurement kept for `path`'s file system, or None if not measured yet."""
    with _lock:
        return _results.get(os.stat(path).st_dev)


def forget_probes() -> None:
    """Forgets every measurement (tests; a remounted or reconfigured file system)."""
    with _lock:
        _results.clear()
        _local.clear()
    _records.forget()
