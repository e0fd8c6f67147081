"""Finalizing a torch_dist save: rank 0 gathers every rank's items, writes `.metadata`.

Collective. Every rank sends rank 0 its write items (or, when its plan is unchanged since
its previous save, only the plan's digest) and its write results; rank 0 builds DCP's
metadata (cached while no rank's plan changes), writes `.metadata` and `checksums.json`,
and broadcasts the outcome: a failure anywhere raises on every rank.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ..._dist import broadcast_object, describe_rank_failures, gather_object
from ...errors import CheckpointingException
from ...integrity import Checksums, file_checksum, write_checksums
from ..common import COMMON_STATE_FNAME
from .metadata_file import DCP_METADATA_FNAME, write_metadata
from .plan import build_metadata

__all__ = ["SaveFinalizer", "gbps"]

logger = logging.getLogger(__name__)


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (for log lines)."""
    return nbytes / max(seconds, 1e-9) / 1e9


class SaveFinalizer:
    """The finalization step of a save strategy, with its caches (one per strategy object).

    Caches: on rank 0, each rank's last write items by digest (`items_cache`) and the
    metadata built from them (`metadata_cache`); on every rank, the digest of the plan it
    sent last (`sent_fingerprint`).
    """

    def __init__(self) -> None:
        self.sent_fingerprint: Optional[str] = None
        self.items_cache: Dict[int, Tuple[str, List[WriteItem]]] = {}
        self.metadata_cache: Optional[Tuple[Tuple[str, ...], Metadata]] = None

    def finalize(
        self,
        ckpt: Path,
        items: List[WriteItem],
        written: Tuple[List[WriteResult], List[Any]],
        error: Optional[BaseException],
        start: float,
        *,
        dedup: bool,
        checksums: bool,
    ) -> None:
        """Collective: rank 0 gathers every rank's items and locations, writes `.metadata`.

        Args:
            written: this rank's write results and item checksums.
            error: this rank's failure before finalization, if any.
            start: when the save started (`time.perf_counter`), for the log line.
            dedup: keep one copy of each chunk in the metadata (every replica was written).
            checksums: write `checksums.json`.

        Raises:
            CheckpointingException: on every rank, if any rank failed (the class of this
                rank's error when it is one).
        """
        opts = (dedup, checksums)
        fingerprint = _items_fingerprint(items)
        send_items = None if fingerprint == self.sent_fingerprint else items
        outcome = self._gather_and_finish(
            ckpt, fingerprint, send_items, written, error, start, opts
        )
        if outcome == _RESEND_PLANS:  # rank 0 lacked a cached plan: everyone sends theirs
            outcome = self._gather_and_finish(ckpt, fingerprint, items, written, error, start, opts)
        if outcome is not None:  # the same outcome on every rank: all raise, no more collectives
            cls = (
                type(error) if isinstance(error, CheckpointingException) else CheckpointingException
            )
            try:
                exc = cls(f"torch_dist save to {ckpt} failed on {outcome}")
            except TypeError:
                exc = CheckpointingException(f"torch_dist save to {ckpt} failed on {outcome}")
            raise exc from error
        self.sent_fingerprint = fingerprint

    def _gather_and_finish(
        self,
        ckpt: Path,
        fingerprint: str,
        items: Optional[List[WriteItem]],
        written: Tuple[List[WriteResult], List[Any]],
        error: Optional[BaseException],
        start: float,
        opts: Tuple[bool, bool],
    ) -> Optional[str]:
        """Collective: one gather to rank 0 and one broadcast of its outcome."""
        report: Any = (
            (fingerprint, items, written[0], written[1])
            if error is None
            else f"{type(error).__name__}: {error}"
        )
        gathered = gather_object(report)
        outcome = (
            self._finish_on_coordinator(ckpt, gathered, start, opts)
            if gathered is not None
            else None
        )
        return broadcast_object(outcome)

    def _finish_on_coordinator(
        self, ckpt: Path, gathered: List[Any], start: float, opts: Tuple[bool, bool]
    ) -> Optional[str]:
        dedup, checksums = opts
        failed = [(r, g) for r, g in enumerate(gathered) if isinstance(g, str)]
        if failed:
            return describe_rank_failures(failed)
        try:
            all_items = []
            for rank, (fingerprint, items, _, _) in enumerate(gathered):
                if items is None:
                    cached = self.items_cache.get(rank)
                    if cached is None or cached[0] != fingerprint:
                        return _RESEND_PLANS
                    items = cached[1]
                else:
                    self.items_cache[rank] = (fingerprint, items)
                all_items.append(items)
            key = tuple(g[0] for g in gathered)
            if self.metadata_cache is None or self.metadata_cache[0] != key:
                self.metadata_cache = (
                    key,
                    build_metadata(all_items, dedup=dedup),
                )
            # write_metadata replaces top-level fields only: a shallow copy keeps the cache intact
            metadata = copy.copy(self.metadata_cache[1])
            results = [r for g in gathered for r in g[2]]
            metadata_digest = write_metadata(ckpt, metadata, results)
            if checksums:
                self._write_checksums(ckpt, metadata_digest, [c for g in gathered for c in g[3]])
        except Exception as e:  # turned into an error on every rank by the caller
            return f"rank 0 (metadata): {type(e).__name__}: {e}"
        nbytes = sum(r.size_in_bytes for r in results)
        seconds = time.perf_counter() - start
        files = len({str(r.storage_data.relative_path) for r in results})
        logger.info(
            "torch_dist save %s: %d items, %.3f GB (%d bytes) in %d file(s) from %d rank(s) in "
            "%.2f s (until the slowest rank finished), %.2f GB/s",
            ckpt,
            len(results),
            nbytes / 1e9,
            nbytes,
            files,
            len(gathered),
            seconds,
            gbps(nbytes, seconds),
        )
        return None

    @staticmethod
    def _write_checksums(ckpt: Path, metadata_digest: int, items: List[Any]) -> None:
        """Rank 0: writes `checksums.json` (items, `.metadata`, and `common.pt` if present)."""
        sums = Checksums()
        sums.add_ranges(items)
        sums.files[DCP_METADATA_FNAME] = metadata_digest
        common = ckpt / COMMON_STATE_FNAME
        if common.is_file():  # written before the sharded part, by sync and async saves alike
            sums.files[COMMON_STATE_FNAME] = file_checksum(common)
        write_checksums(ckpt, sums)


# rank 0's answer when some rank sent only a digest that rank 0 has no cached plan for
_RESEND_PLANS = "\x00resend plans"


def _items_fingerprint(items: List[WriteItem]) -> str:
    """A digest of a rank's write plan: equal digests mean the same DCP metadata entries."""
    h = hashlib.blake2b(digest_size=16)
    for it in items:
        td = it.tensor_data
        desc = (
            (it.index.fqn, it.type.value)
            if td is None
            else (
                it.index.fqn,
                tuple(td.chunk.offsets),
                tuple(td.chunk.sizes),
                tuple(td.size),
                str(td.properties.dtype),
            )
        )
        h.update(repr(desc).encode())
    return h.hexdigest()
