"""Checksums of a checkpoint's bytes: `checksums.json` and item sidecars, ignored by others.

`checksums.json` records xxh3-64 digests of whole small files (`.metadata`, its index,
`common.pt`) and of itself; each data file's sidecar `<file>.sums`, written by its rank, those
of its items (format 1 `checksums.json`, written before, held them all). Sealed at the commit
(`seal`), it is the commit record: it also binds every sidecar and `metadata.json` by digest
and names the save (`save_id`). xxh3-64 is fast and catches accidental corruption (bit flips,
truncation, torn writes) and files of another checkpoint, not an attacker. A checkpoint
without `checksums.json` (megatron-core, stock DCP) loads unverified, with a warning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import xxhash

from .core import PathArg
from .errors import CheckpointCorruptedError
from .storage.fileio import atomic_write, open_read, read_capped

__all__ = [
    "CHECKSUMS_FNAME",
    "ALGORITHM",
    "BLOCK",
    "ItemSum",
    "blocked_sum",
    "BlockSums",
    "Checksums",
    "checksum",
    "new_hasher",
    "file_checksum",
    "read_checksums",
    "write_checksums",
    "SUMS_SUFFIX",
    "write_item_sums",
]

CHECKSUMS_FNAME = "checksums.json"
ALGORITHM = "xxh3_64"
SUMS_SUFFIX = ".sums"
_MAX_BYTES = 1 << 30


def checksum(data: Any) -> int:
    """xxh3-64 of a bytes-like object."""
    return xxhash.xxh3_64_intdigest(data)


def new_hasher() -> Any:
    """A streaming xxh3-64 hasher (`update(bytes)`, `intdigest()`)."""
    return xxhash.xxh3_64()


def file_checksum(path: PathArg) -> int:
    """xxh3-64 of a whole file, streamed through one 4 MiB buffer."""
    h, buf = new_hasher(), memoryview(bytearray(BLOCK))
    with open_read(path) as f:
        while n := f.readinto(buf):
            h.update(buf[:n])
    return h.intdigest()


#: Data block size of tensor items: partial (resharded) reads verify only the blocks they touch.
BLOCK = 4 << 20


@dataclass(frozen=True)
class ItemSum:
    """The digest(s) of one stored item: `digest` of the whole item (`data_len == 0`), or of
    the frame around a data region `[data_off, data_off + data_len)` hashed per `block`."""

    length: int
    digest: int
    data_off: int = 0
    data_len: int = 0
    block: int = 0
    blocks: Tuple[int, ...] = ()

    @property
    def blocked(self) -> bool:
        return self.data_len > 0

    def matches_whole(self, payload: Any) -> bool:
        """Whether an item's full bytes match."""
        view = memoryview(payload).cast("B")
        if not self.blocked:
            return checksum(view) == self.digest
        if len(view) != self.length:
            return False
        end = self.data_off + self.data_len
        h = new_hasher()
        h.update(view[: self.data_off])
        h.update(view[end:])
        return h.intdigest() == self.digest and self.bad_block(view[self.data_off : end], 0) is None

    def bad_block(self, data: Any, start: int) -> Optional[int]:
        """The first mismatching block of `data`, the data region's bytes from `start` (a
        block boundary) to a block boundary or the region's end; or None."""
        view = memoryview(data).cast("B")
        first = start // self.block
        for i in range(0, len(view), self.block):
            k = first + i // self.block
            if k >= len(self.blocks) or checksum(view[i : i + self.block]) != self.blocks[k]:
                return k
        return None


def blocked_sum(length: int, frame: int, data_off: int, data: Any) -> ItemSum:
    """The `ItemSum` of a framed item whose data region is `data` (hashed per block)."""
    view = memoryview(data).cast("B")
    blocks = tuple(checksum(view[i : i + BLOCK]) for i in range(0, len(view), BLOCK))
    return ItemSum(length, frame, data_off, len(view), BLOCK, blocks)


class BlockSums:
    """The `blocked_sum` of a data region fed in pieces of any size."""

    def __init__(self) -> None:
        self.blocks: List[int] = []
        self._hasher: Any = None
        self._filled = 0
        self.nbytes = 0

    def update(self, piece: Any) -> None:
        """Feeds the next bytes of the data region (a bytes-like object)."""
        view = memoryview(piece).cast("B")
        pos = 0
        while pos < len(view):
            if self._hasher is None and len(view) - pos >= BLOCK:  # a whole block at once
                self.blocks.append(checksum(view[pos : pos + BLOCK]))
                pos += BLOCK
                continue
            if self._hasher is None:
                self._hasher, self._filled = new_hasher(), 0
            n = min(BLOCK - self._filled, len(view) - pos)
            self._hasher.update(view[pos : pos + n])
            self._filled += n
            pos += n
            if self._filled == BLOCK:
                self.blocks.append(self._hasher.intdigest())
                self._hasher = None
        self.nbytes += len(view)

    def item_sum(self, length: int, head: bytes, tail: bytes) -> ItemSum:
        """The `ItemSum` of the item `head + region + tail` (call once, after the region)."""
        if self._hasher is not None:
            self.blocks.append(self._hasher.intdigest())
            self._hasher = None
        frame = new_hasher()
        frame.update(head)
        frame.update(tail)
        return ItemSum(length, frame.intdigest(), len(head), self.nbytes, BLOCK, tuple(self.blocks))


@dataclass
class Checksums:
    """Digests of a checkpoint's whole files (`files`) and stored items (`ranges`: file ->
    {offset: ItemSum}; with `directory` set, each file's read from its sidecar when needed)."""

    files: Dict[str, int] = field(default_factory=dict)
    ranges: Dict[str, Dict[int, ItemSum]] = field(default_factory=dict)
    directory: Optional[Path] = None
    #: the identity of the save, set when the commit sealed the record (None: not sealed,
    #: written before sealing existed)
    save_id: Optional[str] = None

    def item_sums(self, name: str) -> Optional[Dict[int, ItemSum]]:
        """The item digests of data file `name` (None: not recorded); raises
        `CheckpointCorruptedError` if its sidecar is missing or damaged."""
        if name not in self.ranges and self.directory is not None:
            path = self.directory / (_name(name) + SUMS_SUFFIX)
            raw = read_capped(path, _MAX_BYTES)
            if raw is None:
                raise CheckpointCorruptedError(f"{path}: item checksums of {name} missing")
            bound = self.files.get(name + SUMS_SUFFIX)  # sealed records bind each sidecar
            if bound is not None and checksum(raw) != bound:
                raise CheckpointCorruptedError(
                    f"{path}: does not match the digest {CHECKSUMS_FNAME} records: a file of "
                    "another checkpoint (or of another save into this directory), or damaged"
                )
            self.ranges[name] = Checksums.from_json(raw, str(path)).ranges.get(name, {})
        return self.ranges.get(name)

    def expected_range(self, name: str, offset: int, length: int, where: str) -> Optional[ItemSum]:
        """The digests of an item, or None when the file's items were not recorded; raises
        `CheckpointCorruptedError` if they are recorded but not this one."""
        table = self.item_sums(name)
        if table is None:
            return None
        entry = table.get(int(offset))
        if entry is None or entry.length != int(length):
            raise CheckpointCorruptedError(
                f"{where}: bytes {offset}-{offset + length} of {name} were not written as one "
                f"item (its checksums disagree with the metadata)"
            )
        return entry

    def verify_file(self, name: str, data: Any, where: str) -> None:
        """Raises `CheckpointCorruptedError` if a recorded whole-file digest mismatches."""
        expected = self.files.get(name)
        if expected is not None and checksum(data) != expected:
            raise CheckpointCorruptedError(
                f"{where}: checksum mismatch ({ALGORITHM}), file damaged"
            )

    def to_json(self) -> bytes:
        """Format 2 (`files` only, items in sidecars), or 1 with `ranges` (a sidecar)."""
        inline = self.directory is None and bool(self.ranges)
        body: Dict[str, Any] = {
            "format": 1 if inline else 2,
            "algorithm": ALGORITHM,
            "files": {k: f"{v:016x}" for k, v in sorted(self.files.items())},
        }
        if self.save_id is not None:
            body["save_id"] = self.save_id
        if inline:
            body["ranges"] = {
                name: {str(off): _encode_item(item) for off, item in sorted(table.items())}
                for name, table in sorted(self.ranges.items())
            }
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        body["digest"] = f"{checksum(canonical):016x}"
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str, directory: Optional[Path] = None) -> Checksums:
        """Parses and checks `checksums.json` (format 2: item sidecars read from
        `directory`) or a sidecar; raises `CheckpointCorruptedError` if it is malformed,
        damaged, or of an unknown format or algorithm."""
        try:
            body = json.loads(raw.decode("utf-8"))
            if not isinstance(body, dict):
                raise ValueError("not an object")
            digest = body.pop("digest")
            canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
            if not isinstance(digest, str) or int(digest, 16) != checksum(canonical):
                raise CheckpointCorruptedError(f"{where}: its own digest does not match (damaged)")
            if body.get("format") not in (1, 2) or body.get("algorithm") != ALGORITHM:
                raise CheckpointCorruptedError(
                    f"{where}: unsupported format {body.get('format')!r} / algorithm "
                    f"{body.get('algorithm')!r} (written by a newer version?)"
                )
            out = cls(directory=directory if body["format"] == 2 else None)
            save_id = body.get("save_id")
            if save_id is not None and not isinstance(save_id, str):
                raise ValueError(f"save_id {save_id!r} is not a string")
            out.save_id = save_id
            for name, d in body["files"].items():
                out.files[_name(name)] = int(d, 16)
            for name, table in body["ranges"].items() if body["format"] == 1 else ():
                out.ranges[_name(name)] = {int(off): _decode_item(v) for off, v in table.items()}
            return out
        except CheckpointCorruptedError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as e:
            raise CheckpointCorruptedError(f"{where}: malformed ({type(e).__name__}: {e})") from e


def _encode_item(item: ItemSum) -> list:
    head = [item.length, f"{item.digest:016x}"]
    if not item.blocked:
        return head
    return head + [item.data_off, item.data_len, item.block, [f"{b:016x}" for b in item.blocks]]


def _decode_item(v: Any) -> ItemSum:
    if not isinstance(v, list) or len(v) not in (2, 6):
        raise ValueError(f"malformed item entry {v!r}")
    length, digest = int(v[0]), int(v[1], 16)
    if length < 0:
        raise ValueError("negative length")
    if len(v) == 2:
        return ItemSum(length, digest)
    data_off, data_len, block = int(v[2]), int(v[3]), int(v[4])
    blocks = tuple(int(b, 16) for b in v[5])
    if block <= 0 or data_off < 0 or data_len <= 0 or data_off + data_len > length:
        raise ValueError(f"malformed block layout {v[:5]!r}")
    if len(blocks) != -(-data_len // block):
        raise ValueError("block count does not match the data length")
    return ItemSum(length, digest, data_off, data_len, block, blocks)


def _name(name: Any) -> str:
    if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
        raise ValueError(f"invalid file name {name!r}")
    return name


def write_checksums(checkpoint_dir: PathArg, checksums: Checksums) -> None:
    """Writes `checksums.json` atomically."""
    payload = checksums.to_json()
    atomic_write(Path(checkpoint_dir) / CHECKSUMS_FNAME, lambda f: f.write(payload))


def read_checksums(checkpoint_dir: PathArg) -> Optional[Checksums]:
    """Reads `checksums.json` (None when absent); raises `CheckpointCorruptedError` if it
    is damaged or unsupported."""
    path = Path(checkpoint_dir) / CHECKSUMS_FNAME
    raw = read_capped(path, _MAX_BYTES)
    return None if raw is None else Checksums.from_json(raw, str(path), Path(checkpoint_dir))


def write_item_sums(directory: PathArg, name: str, entries: Sequence[Tuple[int, ItemSum]]) -> None:
    """Writes the sidecar of data file `name` (its items' `(offset, ItemSum)`) atomically."""
    payload = Checksums(ranges={name: dict(entries)}).to_json()
    atomic_write(Path(directory) / (name + SUMS_SUFFIX), lambda f: f.write(payload))
