"""Checksums of a checkpoint's bytes: `checksums.json`, a sidecar that other readers ignore.

The file records xxh3-64 digests of
- each stored item of the data files, by (file, offset): the exact byte range that the
  format's metadata points to;
- whole small files (`.metadata`, `common.pt`);
and a digest of its own content, so a damaged sidecar is detected too.

Why xxh3-64 (the `xxhash` package): it is the fastest well-kept checksum available here
(several GB/s per core, see the README), and it detects the accidental corruption that
checkpoints suffer (bit flips, truncation, torn writes); it is not a defense against an
attacker, who could rewrite the sidecar too.

A checkpoint without the sidecar (written by megatron-core or stock DCP) loads without
verification; a checkpoint with one is verified by default.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Tuple, Union

import xxhash

from ._fileio import atomic_write
from .errors import CheckpointCorruptedError

__all__ = [
    "CHECKSUMS_FNAME",
    "ALGORITHM",
    "Checksums",
    "checksum",
    "new_hasher",
    "file_checksum",
    "read_checksums",
    "write_checksums",
]

logger = logging.getLogger(__name__)

CHECKSUMS_FNAME = "checksums.json"
ALGORITHM = "xxh3_64"
_FORMAT = 1
_MAX_BYTES = 1 << 30
PathArg = Union[str, "os.PathLike[str]"]


def checksum(data: Any) -> int:
    """xxh3-64 of a bytes-like object."""
    return xxhash.xxh3_64_intdigest(data)


def new_hasher() -> Any:
    """A streaming xxh3-64 hasher (`update(bytes)`, `intdigest()`)."""
    return xxhash.xxh3_64()


def file_checksum(path: PathArg) -> int:
    """xxh3-64 of a whole file, streamed."""
    h = new_hasher()
    with open(path, "rb") as f:
        while True:
            block = f.read(16 << 20)
            if not block:
                break
            h.update(block)
    return h.intdigest()


@dataclass
class Checksums:
    """Digests of a checkpoint's files and stored items.

    Attributes:
        files: file name -> digest of the whole file.
        ranges: data file name -> {offset: (length, digest)} of each stored item.
    """

    files: Dict[str, int] = field(default_factory=dict)
    ranges: Dict[str, Dict[int, Tuple[int, int]]] = field(default_factory=dict)

    def add_ranges(self, entries: Iterable[Tuple[str, int, int, int]]) -> None:
        """Adds `(file, offset, length, digest)` entries."""
        for name, offset, length, digest in entries:
            self.ranges.setdefault(name, {})[int(offset)] = (int(length), int(digest))

    def expected_range(self, name: str, offset: int, length: int, where: str) -> Optional[int]:
        """The digest of an item, or None when the file's items were not recorded.

        Raises:
            CheckpointCorruptedError: the file's items are recorded but not this one (the
                metadata points somewhere the writer never wrote).
        """
        table = self.ranges.get(name)
        if table is None:
            return None
        entry = table.get(int(offset))
        if entry is None or entry[0] != int(length):
            raise CheckpointCorruptedError(
                f"{where}: bytes {offset}-{offset + length} of {name} were not written as one "
                f"item (checksums.json disagrees with the metadata)"
            )
        return entry[1]

    def verify_file(self, name: str, data: Any, where: str) -> None:
        """Checks a whole file's bytes when its digest is recorded.

        Raises:
            CheckpointCorruptedError: on a mismatch.
        """
        expected = self.files.get(name)
        if expected is not None and checksum(data) != expected:
            raise CheckpointCorruptedError(
                f"{where}: checksum mismatch ({ALGORITHM}), file damaged"
            )

    def to_json(self) -> bytes:
        body = {
            "format": _FORMAT,
            "algorithm": ALGORITHM,
            "files": {k: f"{v:016x}" for k, v in sorted(self.files.items())},
            "ranges": {
                name: {
                    str(off): [length, f"{d:016x}"] for off, (length, d) in sorted(table.items())
                }
                for name, table in sorted(self.ranges.items())
            },
        }
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        body["digest"] = f"{checksum(canonical):016x}"
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> Checksums:
        """Parses and checks the sidecar.

        Raises:
            CheckpointCorruptedError: malformed, self-digest mismatch, or an unknown format
                or algorithm.
        """
        try:
            body = json.loads(raw.decode("utf-8"))
            if not isinstance(body, dict):
                raise ValueError("not an object")
            digest = body.pop("digest")
            canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
            if not isinstance(digest, str) or int(digest, 16) != checksum(canonical):
                raise CheckpointCorruptedError(f"{where}: its own digest does not match (damaged)")
            if body.get("format") != _FORMAT or body.get("algorithm") != ALGORITHM:
                raise CheckpointCorruptedError(
                    f"{where}: unsupported format {body.get('format')!r} / algorithm "
                    f"{body.get('algorithm')!r} (written by a newer version?)"
                )
            out = cls()
            for name, d in body["files"].items():
                out.files[_name(name)] = int(d, 16)
            for name, table in body["ranges"].items():
                out.ranges[_name(name)] = {
                    int(off): (int(length), int(d, 16)) for off, (length, d) in table.items()
                }
            return out
        except CheckpointCorruptedError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as e:
            raise CheckpointCorruptedError(f"{where}: malformed ({type(e).__name__}: {e})") from e


def _name(name: Any) -> str:
    if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
        raise ValueError(f"invalid file name {name!r}")
    return name


def write_checksums(checkpoint_dir: PathArg, checksums: Checksums) -> None:
    """Writes `checksums.json` atomically."""
    payload = checksums.to_json()
    atomic_write(Path(checkpoint_dir) / CHECKSUMS_FNAME, lambda f: f.write(payload))


def read_checksums(checkpoint_dir: PathArg) -> Optional[Checksums]:
    """Reads `checksums.json`, or returns None when the checkpoint has none.

    Raises:
        CheckpointCorruptedError: the file exists but is damaged or unsupported.
    """
    path = Path(checkpoint_dir) / CHECKSUMS_FNAME
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_BYTES + 1)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise CheckpointCorruptedError(f"{path}: cannot be read ({e})") from e
    if len(raw) > _MAX_BYTES:
        raise CheckpointCorruptedError(f"{path}: larger than {_MAX_BYTES} bytes")
    return Checksums.from_json(raw, str(path))
