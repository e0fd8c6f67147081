"""Saving with the torch_dist backend: each rank writes its main-replica shards to its own
`.distcp` files (`writer`) with no planning exchange (names and placement follow from its
own shards); then `finalize` has rank 0 write `.metadata` from every rank's report. An
async save copies the shards into pooled host images and returns a request whose
background function writes them."""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ..._dcp_plain import PlainItem
from ..._dist import get_rank
from ..._progress import byte_progress
from ..._shard_checks import check_separation_hint
from ..._types import ShardedStateDict
from ...async_save import AsyncRequest
from ...dict_utils import nested_values
from ...errors import CheckpointingException
from ...integrity import CHECKSUMS_FNAME, SUMS_SUFFIX
from ...mapping import ShardedBase, ShardedObject, ShardedTensor, is_main_replica
from ...storage import ImagePool, objstore
from ..base import AsyncSaveShardedStrategy, CheckpointDir
from . import writer
from .finalize import SaveFinalizer
from .metadata_file import DCP_METADATA_FNAME, INDEX_FNAME
from .plan import (
    BACKEND,
    WriteEntry,
    data_file_name,
    is_empty_chunk,
    object_write_item,
    plain_entry,
    serialize_object,
    split_into_files,
    tensor_write_item,
)

__all__ = ["TorchDistSaveShardedStrategy"]

logger = logging.getLogger(__name__)


#: staging images of every torch_dist save strategy in this process
_SHARED_IMAGES = ImagePool()


def _discard(ckpt: Path, names: List[str]) -> None:
    """Removes this rank's data files `names` (and sidecars) of a save that failed before its
    commit; rank 0 also `.metadata`, its index and `checksums.json`. Never raises."""
    doomed = [n for name in names for n in (name, name + SUMS_SUFFIX)]
    if get_rank() == 0:
        doomed += [DCP_METADATA_FNAME, INDEX_FNAME, CHECKSUMS_FNAME]
    for name in doomed:
        try:
            objstore.remove(ckpt / name)
        except Exception as e:  # the save's own error is what the caller sees
            logger.warning("could not remove %s of a failed save: %s", ckpt / name, e)


class TorchDistSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Saves ShardedTensors and ShardedObjects in PyTorch DCP's format.

    Args:
        backend, version: recorded in metadata.json ('torch_dist', 1).
        keep_only_main_replica: write only main replicas, else every replica (the metadata
            keeps one copy of each chunk).
        thread_count: files per rank, written in parallel (one thread each).
        cached_metadata: accepted for API compatibility (plans are always cached).
        separation_hint: keys starting with this prefix go to separate files named with it,
            so `remove_sharded_tensors(dir, prefix)` can drop them.
        background_thread_count: threads of an async save's background writer (one keeps
            its competition with training lowest).
        direct_io: write with O_DIRECT where the file system supports it (else buffered,
            logged once per directory). Either way each file is fsync'd before the commit.
        checksums: record an xxh3-64 of every stored item (beside its data file), and of
            `.metadata`, its index and `common.pt` in `checksums.json` (verified on load).
        plain_values_for_dcp: also store each plain value of the common state as a DCP item
            under its flat name (as `dcp.save` does), so stock `dcp.load` restores it;
            `common.pt` holds them either way (docs/dcp.md).
    """

    can_handle_sharded_objects = True

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = 1,
        keep_only_main_replica: bool = True,
        thread_count: int = 2,
        cached_metadata: bool = False,
        separation_hint: Optional[str] = None,
        *,
        background_thread_count: int = 1,
        checksums: bool = True,
        direct_io: bool = True,
        plain_values_for_dcp: bool = True,
    ) -> None:
        super().__init__(backend, version)
        self.plain_values_for_dcp = plain_values_for_dcp
        if thread_count < 1:
            raise CheckpointingException(f"thread_count must be >= 1, got {thread_count}")
        self.keep_only_main_replica = keep_only_main_replica
        self.thread_count = thread_count
        self.background_thread_count = max(1, background_thread_count)
        self.checksums = checksums
        self.cached_metadata = cached_metadata
        check_separation_hint(separation_hint)
        self.separation_hint = separation_hint
        # process-wide: callers that build a strategy per save (megatron's training loop)
        # still reuse the staging buffers, pinned once, of the saves before
        self._images = _SHARED_IMAGES
        self.direct_io = direct_io is not False  # None (older callers): the default
        self._finalizer = SaveFinalizer()

    @property
    def records_plain_values(self) -> bool:
        """Whether saves hand this strategy the common state's plain values (`_dcp_plain`)."""
        return self.plain_values_for_dcp

    def _local_entries(
        self, sharded_state_dict: ShardedStateDict
    ) -> Tuple[List[WriteEntry], Optional[Dict[str, Any]]]:
        """This rank's write entries, and DCP's `planner_data` of its plain items (None: none)."""
        entries, planner = [], {}
        for sh in nested_values(sharded_state_dict):
            if isinstance(sh, PlainItem):
                entries.append(plain_entry(sh))
                planner[sh.fqn] = sh.path
                continue
            if not isinstance(sh, ShardedBase):
                continue
            if self.keep_only_main_replica and not is_main_replica(sh.replica_id):
                continue
            if isinstance(sh, ShardedTensor):
                if sh.data is None:
                    raise CheckpointingException(f"Cannot save {sh.key!r}: data is None")
                view = sh.data
                for _ in range(sh.prepend_axis_num):
                    view = view.unsqueeze(0)
                entries.append(WriteEntry(tensor_write_item(sh), view))
            elif isinstance(sh, ShardedObject):
                entries.append(WriteEntry(object_write_item(sh), serialize_object(sh.data)))
            else:
                raise CheckpointingException(
                    f"{self} cannot save {type(sh).__name__} {sh.key!r}; apply factories first"
                )
        return entries, planner or None

    def _plan_files(self, entries: List[WriteEntry]) -> List[Tuple[writer.FilePlan, List[Any]]]:
        """`(layout, item sources)` of each of this rank's data files."""
        rank = get_rank()
        # empty shards have no bytes to store; their write items still reach the metadata
        stored = [e for e in entries if not is_empty_chunk(e.item)]
        check_separation_hint(self.separation_hint)  # an attribute set after construction too
        files = split_into_files(stored, self.thread_count, self.separation_hint)
        return [
            (writer.plan_file(data_file_name(group, rank, i), es), [e.data for e in es])
            for i, (group, es) in enumerate(files)
        ]

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir) -> None:
        """Collective: writes this rank's shards from the tensors themselves, then finalizes.

        Raises:
            CheckpointingException: on every rank, if any rank's write or the metadata failed.
        """
        ckpt = Path(checkpoint_dir)
        start = time.perf_counter()
        items: List[WriteItem] = []
        written: List[WriteResult] = []
        error: Optional[BaseException] = None
        jobs: List[Tuple[writer.FilePlan, List[Any], None]] = []
        planner = None
        try:
            entries, planner = self._local_entries(sharded_state_dict)
            items = [e.item for e in entries]
            jobs = [(plan, sources, None) for plan, sources in self._plan_files(entries)]
            with byte_progress(f"save {ckpt.name}", sum(job[0].size for job in jobs)) as progress:
                written = writer.write_files(
                    ckpt, jobs, self.thread_count, self.checksums, self.direct_io, progress
                )
        except Exception as e:  # reported to rank 0 and re-raised on every rank
            error = e
        try:
            self._finalize(ckpt, items, written, error, start, planner=planner)
        except BaseException:  # no commit follows: what this rank wrote goes
            _discard(ckpt, [plan.name for plan, _, _ in jobs])
            raise

    def async_save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir
    ) -> AsyncRequest:
        """Copies this rank's shards to pooled host images; returns the request that writes
        them (its finalize function, collective, writes `.metadata`; the images return to the
        pool when it is finalized or fails).

        Raises:
            CheckpointingException: invalid input (e.g. a ShardedTensor without data), before
                anything is scheduled.
        """
        ckpt = Path(checkpoint_dir)
        start = time.perf_counter()
        entries, planner = self._local_entries(sharded_state_dict)
        devices = {
            e.data.device for e in entries if isinstance(e.data, torch.Tensor) and e.data.is_cuda
        }
        files = self._plan_files(entries)
        plans = [plan for plan, _ in files]
        # the whole set at once: a save of several files finds all of its images again
        bufs = self._images.acquire_group(plans, pin=bool(devices))
        try:
            for (plan, sources), buf in zip(files, bufs):
                writer.stage_image(plan, sources, buf)
            for device in devices:  # the caller may change its tensors once we return
                torch.cuda.synchronize(device)
        except BaseException:
            self._images.release_group(plans, bufs)
            raise
        jobs = [(plan, [None] * len(plan.items), buf) for plan, buf in zip(plans, bufs)]
        items = [e.item for e in entries]
        request = AsyncRequest(
            writer.write_files,
            (ckpt, jobs, self.background_thread_count, self.checksums, self.direct_io),
            [],
            description=f"torch_dist save to {ckpt}",
        )
        finalized: List[bool] = []

        def finalize() -> None:
            self._finalize(ckpt, items, request.result, None, start, planner=planner)
            finalized.append(True)

        def discard_unless_finalized() -> None:  # the writes failed, or the finalization
            if not finalized:
                _discard(ckpt, [plan.name for plan in plans])

        request.add_finalize_fn(finalize)
        request.cleanup_fns.append(functools.partial(self._images.release_group, plans, bufs))
        request.cleanup_fns.append(discard_unless_finalized)
        nbytes = sum(plan.size for plan in plans)
        secs = time.perf_counter() - start
        logger.debug("rank %d staged %d bytes for %s in %.3f s", get_rank(), nbytes, ckpt, secs)
        return request

    def _finalize(self, *args: Any, planner: Optional[Dict[str, Any]]) -> None:
        """Collective: `SaveFinalizer.finalize(ckpt, items, written, error, start)`."""
        dedup = not self.keep_only_main_replica
        self._finalizer.finalize(*args, dedup=dedup, checksums=self.checksums, planner_data=planner)
