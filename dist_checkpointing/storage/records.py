"""Measured I/O choices remembered on the node, across processes.

The read-path probe (`storage.probe`) measures both read paths on the first load into a
process: at 4 ranks x 1 GiB it took 0.23 s of a first load of 0.68-0.71 s, where a load
without it took 0.45-0.47 s (docs/performance.md, sixteenth pass). A job restarting after a
failure pays that on the one load it waits for with every accelerator idle. So an agreed
measurement is written to a small record on the node, and a later process on the same
machine, booted the same way, takes it instead of measuring again, for `MAX_AGE_S`.

A record is one JSON file per kind of measurement, machine boot and device:
`<directory>/<kind>-<boot id>-<device>.json`, where the directory is `DIST_CKPT_CACHE_DIR`,
else `$XDG_CACHE_HOME/dist_checkpointing`, else `~/.cache/dist_checkpointing`
(`DIST_CKPT_CACHE_DIR=` set empty turns records off). The boot id (Linux's
`/proc/sys/kernel/random/boot_id`) keeps one machine's records from another's where home
directories are shared, and drops them at a reboot (a disk or kernel may have changed);
the age limit bounds a record on a machine moved under a running system (a migrated VM).

A record only ever picks between read paths that return the same bytes: a stale or
foreign one costs speed, never correctness. Reading or writing one never raises: a
missing, unreadable or malformed record is measured anew.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Generic, Optional, Protocol, TypeVar

from ..errors import CheckpointCorruptedError
from .fileio import atomic_write, read_capped

__all__ = ["ENV", "MAX_AGE_S", "Measurements", "directory", "recall", "remember"]

logger = logging.getLogger(__name__)

#: the environment variable naming the records' directory (set empty: no records)
ENV = "DIST_CKPT_CACHE_DIR"
#: seconds a record is taken after its measurement
MAX_AGE_S = 24 * 3600.0
#: a record's format (records of another are measured anew)
VERSION = 1
#: the largest record read (a record is a few hundred bytes)
_LIMIT = 1 << 16


def directory() -> Optional[Path]:
    """Where records are kept, or None where they are turned off (`ENV` set empty)."""
    chosen = os.environ.get(ENV)
    if chosen is not None:
        return Path(chosen) if chosen.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dist_checkpointing"


def _boot_id() -> Optional[str]:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return None
    return boot if boot and all(c.isalnum() or c == "-" for c in boot) else None


def _record_path(kind: str, path: str) -> Optional[Path]:
    """The record of `kind` for `path`'s device on this boot (None: no records here)."""
    where = directory()
    boot = _boot_id()
    if where is None or boot is None:
        return None
    return where / f"{kind}-{boot}-{os.stat(path).st_dev}.json"


def recall(kind: str, path: str) -> Optional[Dict[str, Any]]:
    """The value remembered for `kind` on `path`'s device, if recorded on this machine since
    its boot and at most `MAX_AGE_S` ago; else None.

    Args:
        kind: what was measured (e.g. "read-path").
        path: a file or directory on the device.
    """
    try:
        where = _record_path(kind, path)
        if where is None:
            return None
        raw = read_capped(where, _LIMIT)
        if raw is None:
            return None
        record = json.loads(raw)
        age = time.time() - float(record["measured_at"])
        if record.get("version") != VERSION or not -60.0 <= age <= MAX_AGE_S:
            return None
        value = record["value"]
        if not isinstance(value, dict):
            raise ValueError("no value")
        return value
    except (OSError, CheckpointCorruptedError, ValueError, KeyError, TypeError) as e:
        logger.debug("no %s record for %s: %s", kind, path, e)
        return None


def remember(kind: str, path: str, value: Dict[str, Any]) -> None:
    """Records `value` (JSON-serializable) for `kind` on `path`'s device, measured now.

    Several processes of a node may record the same kind at once: each record is written
    whole and renamed into place, so a reader sees one of them, never a mix. Nothing is
    synced to disk: a record lost in a crash is only measured again, and a load should not
    wait for a sync (home directories are often on network file systems).
    """
    try:
        where = _record_path(kind, path)
        if where is None:
            return
        where.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps(
            {"version": VERSION, "measured_at": time.time(), "value": value}, sort_keys=True
        ).encode()
        atomic_write(where, lambda f: f.write(body), sync=False)
    except (OSError, ValueError, TypeError) as e:
        logger.debug("%s not recorded for %s: %s", kind, path, e)


class Measurement(Protocol):
    """What `Measurements` needs of a measurement."""

    @property
    def recorded(self) -> bool: ...

    def value(self) -> Dict[str, Any]: ...


M = TypeVar("M", bound=Measurement)


class Measurements(Generic[M]):
    """One kind of measurement's records, as a probe module uses them: an earlier process's
    record taken (`take`), and each new measurement recorded once (`record`).

    Args:
        kind: the records' kind (e.g. "read-path").
        parse: a measurement from a record's value, marked recorded; raises ValueError,
            KeyError or TypeError on a malformed value (then it is measured anew).
    """

    def __init__(self, kind: str, parse: Callable[[Dict[str, Any]], M]) -> None:
        self.kind = kind
        self._parse = parse
        self._lock = threading.Lock()
        self._recorded: Dict[int, M] = {}  # per device: what this process recorded

    def take(self, path: str) -> Optional[M]:
        """The measurement recorded on this node for `path`'s device by an earlier process,
        or None (none, too old, of another boot, or malformed)."""
        value = recall(self.kind, path)
        if value is None:
            return None
        try:
            return self._parse(value)
        except (ValueError, KeyError, TypeError) as e:
            logger.debug("%s record for %s not taken: %s", self.kind, path, e)
            return None

    def record(self, dev: int, path: str, result: M) -> None:
        """Records `result` for device `dev` (`path` on it) unless it came from a record or
        this process recorded it already: the ranks exchange the same measurements at every
        save or load, and recording them again would renew their date without measuring."""
        if result.recorded:
            return
        with self._lock:
            if self._recorded.get(dev) == result:
                return
            self._recorded[dev] = result
        remember(self.kind, path, result.value())

    def forget(self) -> None:
        """Forgets what this process recorded (a new process, in tests)."""
        with self._lock:
            self._recorded.clear()
