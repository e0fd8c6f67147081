"""XOR parity across a group of k parts (pure: no process group, no torch), and the parity
record's on-disk form. Used by `parity.py` (the exchanges) and the tools (which read records).

The scheme (SCR's XOR level, one segment per member). Member j's part, padded with zeros to
`(k-1) * S` bytes, is cut into k-1 segments `s_j[0..k-2]` of S bytes. Member i keeps

    P_i = XOR over j != i of s_j[f(i, j)],   f(i, j) = (i - j - 1) mod k.

Claim: losing any one member m (its part and its parity) loses nothing. Proof: for i != j,
`(i - j) mod k` ranges over 1..k-1, so f(i, j) is in 0..k-2, and for a fixed j the map
i -> f(i, j) over the k-1 members i != j is a bijection onto 0..k-2 (it is a shift mod k).
So every segment t of m's part lies in exactly one parity, that of `h(m, t) = (m + t + 1)
mod k`, and `s_m[t] = P_h XOR (XOR over j not in {h, m} of s_j[f(h, j)])`, where each s_j is
a segment of a surviving part (j != m) and P_h survives (h != m). m's own parity P_m is then
recomputable from the surviving parts alone. Two members lost: the segment of one that lies
in the other's parity has no second source, so two losses are not recoverable (and are
reported). With k = 2, `P_0 = s_1[0]` and `P_1 = s_0[0]`: plain mirroring. Bytes kept per
member: its part plus S, about `1 + 1/(k-1)` times the part.
"""

from __future__ import annotations

import json
import os
import struct
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
from xxhash import xxh3_64_intdigest

__all__ = [
    "PARITY_CHUNK",
    "ParityRecord",
    "assignment",
    "holder_of",
    "segment_size",
    "padded_range",
    "message_cuts",
    "message_ranges",
    "send_ranges",
    "contribution_ranges",
    "xor_into",
    "xor_of",
    "encode",
    "rebuild",
    "record_trailer",
    "read_record_info",
    "parse_record",
    "plan_rebuild",
    "Records",
]

#: bytes per exchanged message and per checksummed piece of a parity record
PARITY_CHUNK = 16 << 20
#: a segment of a part this large or larger is sent from its own memory (smaller: copied)
SMALL_MESSAGE = 1 << 20
_PAGE = 4096
_MAGIC = b"DCLPAR01"
#: magic, segment size S, number of chunk checksums, header length, checksum of both
_FOOTER = struct.Struct("<8sQQQQ")
FORMAT_VERSION = 1


def checksum(data: Any) -> int:
    """xxh3-64 of a bytes-like object (as `integrity.checksum`, without importing torch)."""
    return xxh3_64_intdigest(data)


def assignment(i: int, j: int, k: int) -> int:
    """f(i, j): which segment of member j's part member i's parity covers (i != j)."""
    return (i - j - 1) % k


def holder_of(m: int, t: int, k: int) -> int:
    """h(m, t): the member whose parity covers segment t of member m's part."""
    return (m + t + 1) % k


def segment_size(sizes: Sequence[int], k: int) -> int:
    """S: the largest part cut into k-1 segments, rounded up to a page (0 if all are empty)."""
    biggest = max(sizes, default=0)
    per = -(-biggest // (k - 1))
    return -(-per // _PAGE) * _PAGE


def padded_range(segments: Sequence[np.ndarray], lo: int, hi: int) -> np.ndarray:
    """Bytes `[lo, hi)` of the concatenation of `segments` followed by zeros: a view when the
    range lies inside one segment, else a new array of `hi - lo` bytes."""
    start = 0
    for seg in segments:
        end = start + int(seg.size)
        if start <= lo and hi <= end:
            return seg[lo - start : hi - start]
        start = end
    out = np.empty(hi - lo, dtype=np.uint8)
    start = 0
    for seg in segments:
        end = start + int(seg.size)
        a, b = max(lo, start), min(hi, end)
        if a < b:
            out[a - lo : b - lo] = seg[a - start : b - start]
        start = end
    out[max(0, min(hi, start) - lo) :] = 0  # the padding past the last segment
    return out


def message_cuts(sizes: Sequence[int]) -> List[int]:
    """Where the messages of a part made of segments of `sizes` bytes are cut: at the start
    and end of every segment of `SMALL_MESSAGE` bytes or more, so that each message is a view
    of one segment's memory or a run of small segments (copied together)."""
    cuts: List[int] = []
    pos = 0
    for n in sizes:
        if n >= SMALL_MESSAGE:
            cuts += [pos, pos + int(n)]
        pos += int(n)
    return sorted(set(cuts))


def message_ranges(cuts: Sequence[int], total: int, lo: int, hi: int) -> List[Tuple[int, int]]:
    """`[lo, hi)` of a part of `total` bytes (its padding excluded: nothing is sent for it)
    cut at `cuts`: the byte ranges of the messages that carry it, on both sides alike."""
    end = min(hi, total)
    if lo >= end:
        return []
    out = []
    i = bisect_right(cuts, lo)
    while i < len(cuts) and cuts[i] < end:
        out.append((lo, cuts[i]))
        lo, i = cuts[i], i + 1
    out.append((lo, end))
    return out


def send_ranges(j: int, i: int, k: int, seg: int) -> Tuple[int, int]:
    """The byte range of member j's padded part that goes into member i's parity (at save)."""
    lo = assignment(i, j, k) * seg
    return lo, lo + seg


def contribution_ranges(r: int, m: int, k: int, seg: int) -> List[Tuple[str, int, int]]:
    """What surviving member r sends to rebuild member m's part: for each segment t of m, in
    order, `("parity", lo, hi)` (r holds the parity covering it) or `("part", lo, hi)` (a range
    of r's padded part); the XOR of every survivor's contributions is m's padded part."""
    out = []
    for t in range(k - 1):
        h = holder_of(m, t, k)
        if h == r:
            out.append(("parity", 0, seg))
        else:
            lo = assignment(h, r, k) * seg
            out.append(("part", lo, lo + seg))
    return out


def xor_into(acc: np.ndarray, data: np.ndarray) -> None:
    """`acc ^= data` (equal sizes), eight bytes at a time where both allow it."""
    n = int(data.size)
    if n % 8 == 0 and acc.ctypes.data % 8 == 0 and data.ctypes.data % 8 == 0:
        np.bitwise_xor(acc.view(np.uint64), data.view(np.uint64), out=acc.view(np.uint64))
    else:
        np.bitwise_xor(acc, data, out=acc)


def xor_of(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """`out = a ^ b` (equal sizes), eight bytes at a time where all three allow it."""
    if all(x.size % 8 == 0 and x.ctypes.data % 8 == 0 for x in (out, a, b)):
        np.bitwise_xor(a.view(np.uint64), b.view(np.uint64), out=out.view(np.uint64))
    else:
        np.bitwise_xor(a, b, out=out)


def encode(parts: Sequence[np.ndarray]) -> List[np.ndarray]:
    """Every member's parity segment, `P_i` for each i (reference implementation)."""
    k = len(parts)
    seg = segment_size([int(p.size) for p in parts], k)
    out = []
    for i in range(k):
        acc = np.zeros(seg, dtype=np.uint8)
        for j in range(k):
            if j != i:
                lo, hi = send_ranges(j, i, k, seg)
                xor_into(acc, padded_range([parts[j]], lo, hi))
        out.append(acc)
    return out


def rebuild(
    parts: Sequence[Optional[np.ndarray]],
    parities: Sequence[Optional[np.ndarray]],
    sizes: Sequence[int],
    m: int,
) -> np.ndarray:
    """Member m's part from the others' parts and parities (`parts[m]`, `parities[m]` unused).

    Raises:
        ValueError: another member's part or parity is missing (two losses).
    """
    k = len(sizes)
    seg = segment_size(sizes, k)
    acc = np.zeros((k - 1) * seg, dtype=np.uint8)
    for r in range(k):
        if r == m:
            continue
        part, parity = parts[r], parities[r]
        if part is None or parity is None:
            raise ValueError(f"members {m} and {r} are both lost")
        for t, (kind, lo, hi) in enumerate(contribution_ranges(r, m, k, seg)):
            src = parity[lo:hi] if kind == "parity" else padded_range([part], lo, hi)
            xor_into(acc[t * seg : (t + 1) * seg], src)
    return acc[: sizes[m]]


@dataclass
class ParityRecord:
    """What a parity record says about its group (its header), and where its bytes end."""

    iteration: int
    holder: int
    session: str
    group: List[int]  # the members' ranks, in member order
    segment: int  # S
    chunk: int
    sizes: List[int]  # each member's part size in bytes
    digests: List[int]  # each member's part digest (checksum of its header, table, footer)
    sums: List[int]  # checksum of each chunk of the parity bytes

    @property
    def index(self) -> int:
        """This record's member index in the group."""
        return self.group.index(self.holder)

    def info(self) -> Tuple[int, int, Tuple[int, ...]]:
        """`(iteration, holder, group)`: what `find_latest` gathers."""
        return self.iteration, self.holder, tuple(self.group)


def record_trailer(header: Dict[str, Any], sums: Sequence[int], seg: int) -> np.ndarray:
    """The bytes after a record's S parity bytes: chunk checksums, JSON header, footer."""
    table = np.asarray(list(sums), dtype="<u8").view(np.uint8)
    body = np.concatenate([table, np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)])
    footer = _FOOTER.pack(_MAGIC, seg, len(sums), int(body.size) - table.size, checksum(body))
    return np.concatenate([body, np.frombuffer(footer, dtype=np.uint8)])


def trailer_size(header: Dict[str, Any], seg: int, chunk: int) -> int:
    """The size of `record_trailer(header, sums, seg)` (known before the sums are)."""
    nchunks = -(-seg // chunk) if seg else 0
    return 8 * nchunks + len(json.dumps(header).encode()) + _FOOTER.size


def _parse_trailer(body: bytes, seg: int, nsums: int, where: str) -> ParityRecord:
    try:
        head = json.loads(body[8 * nsums :].decode())
        sums = np.frombuffer(body[: 8 * nsums], dtype="<u8").tolist()
        if head.get("format") != FORMAT_VERSION or head.get("segment") != seg:
            raise ValueError(f"format {head.get('format')!r}, segment {head.get('segment')!r}")
        if int(head["chunk"]) < 1:
            raise ValueError(f"chunk {head['chunk']!r}")
        expected = -(-seg // int(head["chunk"])) if seg else 0
        if nsums != expected:
            raise ValueError(f"{nsums} chunk checksums, expected {expected}")
        it, holder, session = head["id"]
        return ParityRecord(
            int(it), int(holder), str(session), [int(r) for r in head["group"]], seg,
            int(head["chunk"]), [int(s) for s in head["sizes"]],
            [int(d) for d in head["digests"]], [int(s) for s in sums],
        )  # fmt: skip
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: malformed parity record header ({e})") from e


def _check_footer(footer: bytes, size: int, where: str) -> Tuple[int, int, int, int]:
    """`(S, number of sums, body length, body checksum)` from a record's footer."""
    magic, seg, nsums, head_len, digest = _FOOTER.unpack(footer)
    n = 8 * nsums + head_len
    if magic != _MAGIC or seg + n + _FOOTER.size != size:
        raise ValueError(f"{where}: not a parity record (bad magic or sizes)")
    return seg, nsums, n, digest


def read_record_info(path: str) -> ParityRecord:
    """Reads and checks a parity record's trailer only (a few hundred bytes).

    Raises:
        ValueError: not a parity record, or its trailer is damaged.
        OSError: it cannot be read.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < _FOOTER.size:
            raise ValueError(f"{path}: {size} bytes, too short for a parity record")
        f.seek(size - _FOOTER.size)
        seg, nsums, n, digest = _check_footer(f.read(_FOOTER.size), size, path)
        f.seek(seg)
        body = f.read(n)
    if checksum(body) != digest:
        raise ValueError(f"{path}: parity record header checksum mismatch")
    return _parse_trailer(body, seg, nsums, path)


def parse_record(data: np.ndarray, where: str) -> Tuple[ParityRecord, np.ndarray]:
    """A whole record's bytes, checked: `(record, parity bytes)`.

    Raises:
        ValueError: malformed, or a chunk of the parity bytes does not match its checksum
            (the message names the chunk's byte range).
    """
    size = int(data.size)
    if size < _FOOTER.size:
        raise ValueError(f"{where}: {size} bytes, too short for a parity record")
    seg, nsums, n, digest = _check_footer(data[size - _FOOTER.size :].tobytes(), size, where)
    body = data[seg : seg + n].tobytes()
    if checksum(body) != digest:
        raise ValueError(f"{where}: parity record header checksum mismatch")
    record = _parse_trailer(body, seg, nsums, where)
    parity = data[:seg]
    for c, expected in enumerate(record.sums):
        lo, hi = c * record.chunk, min(seg, (c + 1) * record.chunk)
        if checksum(parity[lo:hi]) != expected:
            raise ValueError(f"{where}: parity checksum mismatch (bytes {lo}-{hi})")
    return record, parity


#: per rank, `(iteration, holder, group)` of each parity record it holds
Records = Sequence[Sequence[Tuple[int, int, Tuple[int, ...]]]]


def plan_rebuild(
    iteration: int, lost: Set[int], present: Set[int], records: Records
) -> Tuple[Dict[int, List[int]], List[str]]:
    """The group of each lost owner that can be rebuilt, and why the others cannot.

    Args:
        lost: owners of `iteration` whose part no rank holds.
        present: owners whose part some rank holds.
        records: per rank, `(iteration, holder, group)` of each parity record it holds (a
            record counts only in its holder's list).
    """
    held = {
        (it, h): tuple(g) for rank, infos in enumerate(records) for it, h, g in infos if h == rank
    }
    groups: Dict[int, List[int]] = {}
    problems: List[str] = []
    for m in sorted(lost):
        group = next((list(g) for (it, _), g in held.items() if it == iteration and m in g), None)
        if group is None:
            problems.append(f"rank {m}: no parity record of its group survives")
            continue
        others = [r for r in group if r != m]
        gone = [r for r in others if r not in present]
        nopar = [r for r in others if held.get((iteration, r)) != tuple(group)]
        if gone or nopar:
            why = [f"part(s) of rank(s) {gone} also lost"] if gone else []
            why += [f"no parity record of rank(s) {nopar}"] if nopar else []
            problems.append(f"rank {m} (parity group {group}): {'; '.join(why)}")
            continue
        groups[m] = group
    return groups, problems
