"""Finalizing a torch_dist save: each rank sends rank 0 its compact report (`encode_report`),
or only its digest while unchanged, and the digests of its sidecars; rank 0 builds and writes
`.metadata` (no work while no report changed) and `checksums.json` (binding every sidecar),
and broadcasts the outcome: a failure anywhere raises on every rank."""

from __future__ import annotations

import hashlib
import json
import logging
import time
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ..._dist import broadcast_object, describe_rank_failures, gather_object
from ...errors import CheckpointCorruptedError, CheckpointingException, ShardingIntegrityError
from ...integrity import SUMS_SUFFIX, Checksums, checksum, file_checksum, write_checksums
from ...storage import objstore
from ..common import COMMON_STATE_FNAME
from .metadata_file import serialize_metadata, write_metadata_files
from .plan import is_empty_chunk

__all__ = [
    "SaveFinalizer",
    "gbps",
    "encode_report",
    "build_global_metadata",
    "write_global_metadata",
]

logger = logging.getLogger(__name__)


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (for log lines)."""
    return nbytes / max(seconds, 1e-9) / 1e9


class _UnresolvedKey(CheckpointingException):
    """A report names a key by digest and no report gives it whole."""


def _key_ref(key: str, dtype: str, shape: Sequence[int]) -> str:
    return format(checksum("\0".join((key, dtype, repr(list(shape)))).encode()), "016x")


def encode_report(
    items: Sequence[WriteItem], results: Sequence[WriteResult], *, full_keys: bool = False
) -> bytes:
    """A rank's finalize report: its write items and where it wrote them (no process group).

    zlib-compressed JSON `[files, keys, rows]`. A key is `[key]` (an object), `[key, dtype,
    shape]` (a tensor) or, where this rank holds neither the tensor's chunk at the origin nor
    an empty one, `[digest of those, 0]`: a name travels about once, not once per chunk. A
    row: `[key number, offsets..., sizes..., file number, byte offset, length]` (no offsets
    or sizes for an object, no location for an empty chunk). `full_keys`: no digests.

    Raises:
        CheckpointingException: a non-empty item has no write result.
    """
    where = {r.index: r.storage_data for r in results}
    whole = {
        it.index.fqn
        for it in items
        if it.tensor_data is None
        or full_keys
        or is_empty_chunk(it)
        or not any(it.tensor_data.chunk.offsets)
    }
    files: Dict[str, int] = {}
    keys: Dict[str, int] = {}
    entries: List[List[Any]] = []
    rows: List[List[Any]] = []
    for it in items:
        fqn, td = it.index.fqn, it.tensor_data
        if fqn not in keys:
            keys[fqn] = len(entries)
            if td is None:
                entries.append([fqn])
            else:
                dtype, shape = str(td.properties.dtype)[6:], list(td.size)
                full = fqn in whole
                entries.append([fqn, dtype, shape] if full else [_key_ref(fqn, dtype, shape), 0])
        row = [keys[fqn]] if td is None else [keys[fqn], *td.chunk.offsets, *td.chunk.sizes]
        info = None if is_empty_chunk(it) else where.get(it.index)
        if info is not None:
            name = str(info.relative_path)
            row += [files.setdefault(name, len(files)), info.offset, info.length]
        elif not is_empty_chunk(it):
            raise CheckpointingException(f"{fqn!r} at {it.index.offset} was not written")
        rows.append(row)
    body = json.dumps([list(files), entries, rows], separators=(",", ":"))
    return zlib.compress(body.encode())


def build_global_metadata(reports: Sequence[bytes], dedup: bool = False) -> Metadata:
    """DCP's global metadata, storage locations included, from every rank's `encode_report`
    (no process group). Work proportional to the items reported; chunks in rank order.

    Args:
        dedup: keep the first of identical chunks written by several ranks, not raise.

    Raises:
        ShardingIntegrityError: ranks disagree on a tensor's shape or dtype, a key is both
            a tensor and an object, or a chunk or object is written twice.
        CheckpointingException: a digest no report gives whole (every rank then resends
            with `full_keys=True`), or a malformed report.
    """
    try:
        decoded = [json.loads(zlib.decompress(raw)) for raw in reports]
    except (zlib.error, ValueError) as e:
        raise CheckpointCorruptedError(f"malformed finalize report: {e}") from e
    whole = {_key_ref(*k): k for _, keys, _ in decoded for k in keys if len(k) == 3}
    sdm: Dict[str, Any] = {}
    storage: Dict[MetadataIndex, _StorageInfo] = {}
    seen: Dict[str, Set[torch.Size]] = {}
    for rank, (files, keys, rows) in enumerate(decoded):
        resolved = [_register(sdm, whole.get(k[0]) if len(k) == 2 else k, rank) for k in keys]
        for row in rows:
            fqn, md = resolved[row[0]]
            if md is None:  # an object
                if fqn in sdm:
                    if dedup and isinstance(sdm[fqn], BytesStorageMetadata):
                        continue
                    raise ShardingIntegrityError(f"{fqn!r} is written twice (again by rank {rank})")
                sdm[fqn] = BytesStorageMetadata()
                storage[MetadataIndex(fqn)] = _StorageInfo(files[row[1]], row[2], row[3])
                continue
            n = len(md.size)
            if len(row) == 1 + 2 * n:  # an empty chunk: registers the tensor, holds no data
                continue
            offsets = torch.Size(row[1 : 1 + n])
            if offsets in seen.setdefault(fqn, set()):
                if dedup:
                    continue
                raise ShardingIntegrityError(
                    f"{fqn!r}: chunk at {tuple(offsets)} is written twice (again by rank {rank})"
                )
            seen[fqn].add(offsets)
            md.chunks.append(ChunkStorageMetadata(offsets, torch.Size(row[1 + n : 1 + 2 * n])))
            storage[MetadataIndex(fqn, offsets)] = _StorageInfo(files[row[-3]], row[-2], row[-1])
    return Metadata(state_dict_metadata=sdm, storage_data=storage, version="1.0.0")


def _register(
    sdm: Dict[str, Any], entry: Optional[List[Any]], rank: int
) -> Tuple[str, Optional[TensorStorageMetadata]]:
    """A report's key as `(key, its tensor metadata, registered in sdm; None: an object)`."""
    if entry is None:
        raise _UnresolvedKey(f"rank {rank} names a tensor by a digest no report gives whole")
    if len(entry) == 1:
        return entry[0], None
    key, dtype, shape = entry
    md = sdm.get(key)
    if md is None:
        props = TensorProperties(dtype=getattr(torch, dtype))
        md = sdm[key] = TensorStorageMetadata(props, torch.Size(shape), [])
    elif not isinstance(md, TensorStorageMetadata):
        raise ShardingIntegrityError(f"{key!r} is both a tensor and an object")
    elif list(md.size) != shape or str(md.properties.dtype) != f"torch.{dtype}":
        raise ShardingIntegrityError(
            f"{key!r}: rank {rank} writes shape {tuple(shape)} torch.{dtype}, "
            f"another rank {tuple(md.size)} {md.properties.dtype}"
        )
    return key, md


def write_global_metadata(ckpt: Path, reports: Sequence[bytes], dedup: bool) -> Dict[str, int]:
    """Writes `.metadata` and its index from every rank's report (no process group);
    returns `{file name: xxh3-64}` of the written files."""
    return write_metadata_files(ckpt, serialize_metadata(build_global_metadata(reports, dedup)))


class SaveFinalizer:
    """A save strategy's finalization and its caches: on rank 0, each rank's last report and
    the files serialized from them; on every rank, the digest of the report it sent last."""

    def __init__(self) -> None:
        self.sent_digest: Optional[bytes] = None
        self.full_keys = False  # once a digest did not resolve: keys always go whole
        self.reports: Dict[int, Tuple[bytes, bytes]] = {}
        self.files_cache: Optional[Tuple[Tuple[bytes, ...], Dict[str, bytes]]] = None

    def finalize(
        self,
        ckpt: Path,
        items: List[WriteItem],
        results: List[WriteResult],
        error: Optional[BaseException],
        start: float,
        *,
        dedup: bool,
        checksums: bool,
        planner_data: Optional[Dict[str, Any]] = None,
    ) -> None:
        """Collective: rank 0 gathers every rank's report (its `items`, `results`, or its
        `error`), writes `.metadata` (`dedup`: one copy of each chunk) and, with `checksums`,
        `checksums.json`; `start` (`time.perf_counter`) dates the save in the log line;
        `planner_data` (rank 0's plain values, `_dcp_plain`) goes into `.metadata`. Raises
        `CheckpointingException` (this rank's error class when it is one) on every rank if
        any rank failed."""
        opts = (dedup, checksums, start, planner_data)
        files = {str(r.storage_data.relative_path) for r in results}
        stats = (len(results), sum(r.size_in_bytes for r in results), len(files))
        report = digest = b""
        sidecars: Dict[str, int] = {}  # what binds this rank's data files into the record
        if error is None:
            try:
                report = encode_report(items, results, full_keys=self.full_keys)
                digest = hashlib.blake2b(report, digest_size=16).digest()
                for name in sorted(files) if checksums else ():
                    sidecar = name + SUMS_SUFFIX
                    sidecars[sidecar] = file_checksum(ckpt / sidecar)
            except Exception as e:  # reported to rank 0 and re-raised on every rank
                error = e
        send = None if digest == self.sent_digest else report
        outcome = self._gather_and_finish(ckpt, error, (digest, send, stats, sidecars), opts)
        if outcome in (_RESEND, _RESEND_WHOLE):  # everyone sends its report
            if outcome == _RESEND_WHOLE and not self.full_keys:
                self.full_keys = True
                report = encode_report(items, results, full_keys=True)
                digest = hashlib.blake2b(report, digest_size=16).digest()
            message = (digest, report, stats, sidecars)
            outcome = self._gather_and_finish(ckpt, error, message, opts)
        if outcome is not None:  # the same outcome on every rank: all raise, no more collectives
            msg = f"torch_dist save to {ckpt} failed on {outcome}"
            cls = type(error) if isinstance(error, CheckpointingException) else None
            try:
                exc = (cls or CheckpointingException)(msg)
            except TypeError:
                exc = CheckpointingException(msg)
            raise exc from error
        self.sent_digest = digest

    def _gather_and_finish(
        self, ckpt: Path, error: Optional[BaseException], message: Any, opts: Any
    ) -> Optional[str]:
        """Collective: one gather to rank 0 and one broadcast of its outcome."""
        sent = message if error is None else f"{type(error).__name__}: {error}"
        gathered = gather_object(sent)
        outcome = self._finish_on_coordinator(ckpt, gathered, *opts) if gathered else None
        return broadcast_object(outcome)

    def _finish_on_coordinator(
        self,
        ckpt: Path,
        gathered: List[Any],
        dedup: bool,
        checksums: bool,
        start: float,
        planner_data: Optional[Dict[str, Any]],
    ) -> Optional[str]:
        failed = [(r, g) for r, g in enumerate(gathered) if isinstance(g, str)]
        if failed:
            return describe_rank_failures(failed)
        try:
            reports = []
            for rank, (digest, report, _, _) in enumerate(gathered):
                if report is None:
                    if self.reports.get(rank, (None,))[0] != digest:
                        return _RESEND
                    report = self.reports[rank][1]
                self.reports[rank] = (digest, report)
                reports.append(report)
            key = (*(g[0] for g in gathered), repr(planner_data).encode())
            if self.files_cache is None or self.files_cache[0] != key:
                try:
                    metadata = build_global_metadata(reports, dedup)
                except _UnresolvedKey:
                    return _RESEND_WHOLE
                except ShardingIntegrityError as e:  # say so where it names a plain value
                    clash = [k for k in planner_data or {} if repr(k) in str(e)]
                    if not clash:
                        raise
                    raise ShardingIntegrityError(
                        f"{e}: {clash[0]!r} is the flat name of a plain value of the common state "
                        "(stored for DCP readers) and the key of another rank's sharded tensor or "
                        "object; rename one"
                    ) from e
                if planner_data:
                    metadata.planner_data = dict(planner_data)
                self.files_cache = (key, serialize_metadata(metadata))
            digests = write_metadata_files(ckpt, self.files_cache[1])
            common = ckpt / COMMON_STATE_FNAME
            if checksums and objstore.is_file(common):  # written before the sharded part
                digests[COMMON_STATE_FNAME] = file_checksum(common)
            if checksums:
                for g in gathered:
                    digests.update(g[3])
                write_checksums(ckpt, Checksums(files=digests))
        except Exception as e:  # turned into an error on every rank by the caller
            return f"rank 0 (metadata): {type(e).__name__}: {e}"
        items, nbytes, files = (sum(g[2][i] for g in gathered) for i in range(3))
        secs = time.perf_counter() - start
        msg = "torch_dist save %s: %d items, %.3f GB (%d bytes) in %d file(s) from %d rank(s) in "
        msg += "%.2f s (until the slowest rank finished), %.2f GB/s"
        rate = gbps(nbytes, secs)
        logger.info(msg, ckpt, items, nbytes / 1e9, nbytes, files, len(gathered), secs, rate)
        return None


# rank 0's answers when a rank sent only a digest that rank 0 has no report for, and when a
# key was named by digest only (a save that does not cover a tensor's origin)
_RESEND = "\x00resend reports"
_RESEND_WHOLE = "\x00resend reports with every key whole"
