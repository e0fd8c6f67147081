"""`BaseCheckpointManager`: save, find and load local checkpoints, with replication.

A checkpoint of iteration I is the set of parts `(I, r, session)`, one per rank r. The base
class owns the protocol; subclasses store parts (`LocalCheckpointManager`: files).

Save (collective):
1. Caller: agree that no save of iteration I is in progress here (no dirty part of I: as in
   the reference, another writer on this machine is a `SameMachineReplicationException`),
   copy the tensors into a pooled host image (the only part the training loop waits for; a
   synchronous save of CPU tensors copies nothing: its file is written and its replicas
   are sent from the tensors themselves), queue the rest on the manager's one background thread, in call
   order (so background exchanges run in the same order on every rank).
2. Background: remove the committed parts of I held here, if any (a job restarted from an
   older checkpoint reaches I again: the new save overwrites the old one), then checksums
   (without replication: computed as the part is written, `write_image`);
   the write of this rank's own part as a dirty file (created exclusively) runs while the
   replication exchange sends it and receives the peers' parts, each written to its own
   dirty file chunk by chunk as it arrives (`_open_image`). Whether
   the files are fsync'd is the durability policy (`fsync`, below). Every rank removes its
   old parts before the agreement that precedes any commit, so old and new parts of I
   never coexist committed: a failure or crash leaves I incomplete, never mixed.
3. Finalize (collective, after every rank's background work succeeded): commit (rename)
   the parts, agree that every rank committed, then remove older iterations. If any rank
   failed, every rank removes the iteration's files and raises; the previous checkpoint
   stays.

`find_latest` (collective) returns, on every rank alike, the newest iteration whose every
part is held by some rank (by its owner only, without replication), or -1. `load`
(collective) reads and verifies the parts held here, plans who provides each rank's part,
and moves missing parts from holders; a part with no usable copy raises
`NoReplicasAvailableError` on every rank.

Why this module is over 400 lines: the template-method protocol (save, find_latest,
load) stays in one class, as in the reference layout, and its call order is documented
here at length.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from abc import ABC, abstractmethod
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from ... import _dist
from ...async_save import AsyncRequest
from ...errors import (
    CheckpointCorruptedError,
    CheckpointingException,
    NoReplicasAvailableError,
    SameMachineReplicationException,
)
from .._image import LocalImage, decode_image, finish_image, release_image, start_image
from .._read import Part, release_part
from ..base_state_dict import TensorAwareStateDict
from ..replication._retrieve import MemorySource, PartSource, stream_transfers
from ..replication.strategies import (
    CkptID,
    ExchangePlan,
    ImageSink,
    ReplicationStrategy,
    describe_id,
    host_group,
    plan_retrieval,
)

__all__ = [
    "BaseCheckpointManager",
    "CheckpointingException",
    "SameMachineReplicationException",
    "CkptID",
]

logger = logging.getLogger(__name__)


_executor: Optional[concurrent.futures.ThreadPoolExecutor] = None


_io_executor: Optional[concurrent.futures.ThreadPoolExecutor] = None


def _io_threads() -> concurrent.futures.ThreadPoolExecutor:
    """Writer threads for the parts a save keeps here (own part and received copies)."""
    global _io_executor
    if _io_executor is None:
        _io_executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="dc-local-io"
        )
    return _io_executor


def _background_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The one background thread of the process, shared by every manager.

    One thread for all managers keeps background exchanges in program order, which is the
    same on every rank, so two saves never interleave their collectives.
    """
    global _executor
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="dc-local-ckpt"
        )
        _dist.at_teardown(_stop_background_thread)
    return _executor


def _stop_background_thread() -> None:
    """At exit: waits for the background thread, before the groups it uses are destroyed."""
    global _executor
    if _executor is not None:
        _executor.shutdown(wait=True)
        _executor = None


def _check_id(held: Tuple[Any, ...], expected: CkptID, where: str) -> None:
    """Raises when a part's header names another part than the one its name says.

    A file recycled for a newer save holds an older part's bytes, with valid checksums,
    until it is written over; a machine crash (without fsync) can leave a committed file
    that still does.

    Raises:
        CheckpointCorruptedError: the ids differ.
    """
    if tuple(held) != tuple(expected):
        raise CheckpointCorruptedError(
            f"{where}: holds local checkpoint part {tuple(held)}, expected {tuple(expected)} "
            "(an older part's bytes: torn by a crash?)"
        )


class _MemorySink:
    """A received part collected in memory, stored with `_save_image` when complete."""

    def __init__(self, manager: BaseCheckpointManager, ckpt_id: CkptID, nbytes: int) -> None:
        self.manager, self.ckpt_id = manager, ckpt_id
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)

    def write(self, data: np.ndarray, offset: int) -> None:
        self.buffer.numpy()[offset : offset + data.size] = data

    def close(self) -> None:
        image = LocalImage(self.ckpt_id, self.buffer, [], 0, 0, finished=True)
        self.manager._save_image(image, self.ckpt_id)

    def abort(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)


class BaseCheckpointManager(ABC):
    """Saves and loads `TensorAwareStateDict`s as local checkpoints (collective methods).

    Args:
        session_id: names this training job's checkpoints (part of every checkpoint id).
        repl_strategy: where copies of each part go; None keeps each part on its owner only.
        use_replicas: whether parts held by other ranks count in `find_latest` and `load`
            (default: when `repl_strategy` is given). A loader that did not save may set it
            to recover from copies made by an earlier run.
        fsync: the durability policy. True: every part is written with O_DIRECT where
            possible and fsync'd before it is renamed, and the directory is fsync'd after
            the rename, so a committed part survives a machine crash. False: buffered
            writes, no fsync; a crash of the machine (not of the process) can leave a
            committed part torn or missing, which its checksums detect at load, and the
            copy on another node is used. Default (None): False with a `repl_strategy`
            (the replica protects against losing this node), True without.
    """

    def __init__(
        self,
        session_id: str,
        repl_strategy: Optional[ReplicationStrategy] = None,
        *,
        use_replicas: Optional[bool] = None,
        fsync: Optional[bool] = None,
    ) -> None:
        self.session_id = session_id
        self.repl_strategy = repl_strategy
        self.fsync = repl_strategy is None if fsync is None else bool(fsync)
        self.use_replicas = repl_strategy is not None if use_replicas is None else use_replicas
        self.latest_iteration = -1
        self.globally_available_ids: Optional[List[List[CkptID]]] = None
        self._newest_committed = -1
        #: False unpickles hollow states without the allowlist (trusted checkpoints only)
        self.weights_only = True

    @property
    def rank(self) -> int:
        """This process's rank in the default process group."""
        return _dist.get_rank()

    def _ckpt_id(self, iteration: int) -> CkptID:
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise CheckpointingException(f"iteration must be a non-negative int, got {iteration!r}")
        return (iteration, self.rank, self.session_id)

    # ---- storage hooks (subclasses) -------------------------------------------------------
    @abstractmethod
    def _my_ckpt_ids(self) -> Iterable[CkptID]:
        """Committed parts stored here (dirty ones never count)."""

    @abstractmethod
    def _load_image(self, ckpt_id: CkptID) -> Tuple[torch.Tensor, str]:
        """Reads a committed part's bytes; returns `(image, where)` (`where` names it).

        Raises:
            CheckpointingException: the part cannot be read.
        """

    def _read_part(self, ckpt_id: CkptID, own: bool) -> Tuple[Part, str, bool]:
        """Reads a committed part for `load`; returns `(part, where, verified)`.

        This default reads with `_load_image` (`verified` False: `load` verifies);
        subclasses may verify while reading.

        Args:
            ckpt_id: the part.
            own: it is this rank's part (its tensors are restored here).

        Raises:
            CheckpointingException: the part cannot be read (or fails verification).
        """
        image, where = self._load_image(ckpt_id)
        return Part(image), where, False

    def _part_source(self, ckpt_id: CkptID) -> PartSource:
        """Opens a committed part held here for sending it to another rank at load.

        This default reads the whole part with `_load_image`; subclasses that store files
        read it piece by piece as it is sent.

        Raises:
            CheckpointingException: the part cannot be opened.
        """
        return MemorySource(self._load_image(ckpt_id)[0])

    @abstractmethod
    def _save_image(self, image: LocalImage, ckpt_id: CkptID) -> None:
        """Stores a part durably, uncommitted (dirty).

        Raises:
            SameMachineReplicationException: the part already exists here.
        """

    def _open_image(self, ckpt_id: CkptID, nbytes: int) -> ImageSink:
        """Opens where a received part is written chunk by chunk, stored as `_save_image`
        stores (dirty); the part is stored once the sink is closed.

        This default collects the chunks in memory and calls `_save_image` at close;
        subclasses that store files write the chunks straight to the file.

        Raises:
            SameMachineReplicationException: the part already exists here.
        """
        return _MemorySink(self, ckpt_id, nbytes)

    @abstractmethod
    def _dirty_ids(self, iteration: int) -> List[CkptID]:
        """Parts of `iteration` stored here but not committed yet."""

    @abstractmethod
    def _commit(self, ckpt_id: CkptID) -> None:
        """Makes a stored dirty part committed (atomically)."""

    @abstractmethod
    def _cleanup(self, iteration: int) -> None:
        """After `iteration` committed everywhere: removes older parts and stray dirty ones."""

    @abstractmethod
    def _cleanup_failed_save(self, iteration: int) -> None:
        """Removes every part of `iteration` stored here, dirty or committed."""

    def _load(self, ckpt_id: CkptID) -> TensorAwareStateDict:
        """Reads and verifies one committed part stored here.

        Raises:
            CheckpointCorruptedError: it is missing, truncated or fails verification.
        """
        image, where = self._load_image(ckpt_id)
        return decode_image(image, where, weights_only=self.weights_only)[1]

    def _save(self, state_dict: TensorAwareStateDict, ckpt_id: CkptID) -> None:
        """Stores and commits one part here (no replication)."""
        self._save_image(finish_image(start_image(state_dict, ckpt_id)), ckpt_id)
        self._commit(ckpt_id)

    # ---- protocol -------------------------------------------------------------------------
    def _background(self) -> concurrent.futures.ThreadPoolExecutor:
        return _background_thread()

    def find_latest(self) -> int:
        """Collective: the newest complete iteration (see the module docstring), or -1."""
        if self.latest_iteration != -1:
            return self.latest_iteration
        local = sorted(set(self._my_ckpt_ids()))
        if not self.use_replicas:
            local = [i for i in local if i[1] == self.rank]
        self.globally_available_ids = _dist.all_gather_object(local)
        world = set(range(_dist.get_world_size()))
        complete = [it for it, o in self._owners_by_iteration().items() if o >= world]
        self.latest_iteration = max(complete, default=-1)
        return self.latest_iteration

    def save(
        self, state_dict: TensorAwareStateDict, iteration: int, is_async: bool = False
    ) -> Optional[AsyncRequest]:
        """Collective: saves this rank's part of `iteration` (see the module docstring).

        Args:
            state_dict: this rank's state; unchanged by the save, and free to change as soon
                as `save` returns.
            iteration: the global iteration; must be newer than any saved by this manager.
            is_async: return an `AsyncRequest` for `AsyncCallsQueue.schedule_async_request`
                instead of waiting for the writes.

        Returns:
            None, or the request when `is_async`.

        Raises:
            SameMachineReplicationException: a save of `iteration` is in progress (or was
                interrupted) on some rank: its dirty file exists (raised on every rank).
                Committed parts of `iteration` do not raise: the new save replaces them.
            CheckpointingException: any other failure, on every rank (with `is_async`,
                background failures surface as `AsyncSaveError` from the queue).
        """
        start = time.perf_counter()
        ckpt_id = self._ckpt_id(iteration)
        image: Optional[LocalImage] = None
        error: Optional[BaseException] = None
        try:
            if iteration <= self._newest_committed:
                raise CheckpointingException(
                    f"Iteration {iteration} is not newer than the last saved iteration {self._newest_committed}"
                )
            in_progress = self._dirty_ids(iteration)
            if in_progress:  # another writer of this iteration on this machine
                raise SameMachineReplicationException(in_progress[0])
            if self.repl_strategy is not None:
                self.repl_strategy.prepare()
            # a sync save of CPU tensors writes and sends from the tensors themselves (the
            # caller waits until they are written and sent, so they cannot change)
            stage = is_async
            image = start_image(state_dict, ckpt_id, state_dict.tensor_names(), stage=stage)
        except Exception as e:  # agreed on below
            error = e
        _dist.agree_on_errors(error, f"local checkpoint save of iteration {iteration}")
        assert image is not None
        self.latest_iteration = -1
        nbytes = image.nbytes
        future = self._background().submit(self._write_parts, image, iteration)
        blocked = time.perf_counter() - start

        def finalize() -> None:
            self._finalize_save(iteration, future)
            elapsed = time.perf_counter() - start
            logger.info(
                "local checkpoint of iteration %d: %.1f MB (own part) in %.2f s (%.0f MB/s), caller blocked %.3f s",
                iteration,
                nbytes / 1e6,
                elapsed,
                nbytes / 1e6 / max(elapsed, 1e-9),
                blocked,
            )

        request = AsyncRequest.from_future(
            future,
            [finalize],
            cleanup_fns=[lambda: self._drop_dirty(iteration, future)],
            description=f"local checkpoint iteration {iteration}",
        )
        if is_async:
            return request
        error = None
        try:
            future.result()
        except Exception as e:  # agreed on below
            error = e
        try:
            _dist.agree_on_errors(error, f"local checkpoint write of iteration {iteration}")
        except CheckpointingException:
            self._drop_dirty(iteration, future)
            raise
        finalize()
        return None

    def _write_parts(self, image: LocalImage, iteration: int) -> int:
        """Background: removal of an older save of `iteration`, checksums, then this rank's
        write overlapping the replication exchange, which writes each received part chunk
        by chunk as it arrives."""
        try:
            old = [i for i in self._my_ckpt_ids() if i[0] == iteration]
            if old:  # committed by an earlier run that reached this iteration too
                logger.info(
                    "local checkpoint of iteration %d replaces %d part(s) saved before here",
                    iteration,
                    len(old),
                )
                self._cleanup_failed_save(iteration)
            if self.repl_strategy is None:  # checksums computed as the part is written
                self._save_image(image, image.ckpt_id)
                return image.nbytes
            finish_image(image)  # before any byte is sent: replicas carry the same checksums
            own = _io_threads().submit(self._save_image, image, image.ckpt_id)
            try:
                received = self.repl_strategy.replicate_stream(
                    image, image.ckpt_id, self._open_image
                )
            finally:
                own_error = own.exception()  # waits for the own write in every case
            if own_error is not None:
                raise own_error
            return image.nbytes + sum(n for _, n in received)
        finally:
            release_image(image)

    def _drop_dirty(self, iteration: int, future: concurrent.futures.Future) -> None:
        """Removes this iteration's uncommitted files once its background work ended."""
        if future.done() and iteration > self._newest_committed:
            self._cleanup_failed_save(iteration)

    def _finalize_save(self, iteration: int, future: concurrent.futures.Future) -> None:
        """Collective: commits every part written here, agrees, then removes older iterations."""
        error: Optional[BaseException] = None
        try:
            future.result()  # done on every rank (the queue or `save` waited)
            for ckpt_id in self._dirty_ids(iteration):
                self._commit(ckpt_id)
        except Exception as e:  # agreed on below
            error = e
        try:
            _dist.agree_on_errors(error, f"local checkpoint commit of iteration {iteration}")
        except CheckpointingException:
            self._cleanup_failed_save(iteration)
            raise
        self._newest_committed = iteration
        self._cleanup(iteration)
        self.latest_iteration = -1

    def _checked_part(self, ckpt_id: CkptID, wanted: CkptID) -> Any:
        """Reads and verifies a part held here: the `Part`, or the error saying why not."""
        try:
            part, where, verified = self._read_part(ckpt_id, own=ckpt_id == wanted)
            try:
                held, _ = decode_image(
                    part.buffer, where, verify=not verified, weights_only=self.weights_only
                )
                _check_id(held, ckpt_id, where)
            except BaseException:
                release_part(part)
                raise
            return part
        except CheckpointingException as e:
            return e

    def _owners_by_iteration(self) -> Dict[int, set]:
        """iteration -> the owners whose parts some rank holds (from the last `find_latest`)."""
        assert self.globally_available_ids is not None
        owners: Dict[int, set] = {}
        for ids in self.globally_available_ids:
            for iteration, owner, _ in ids:
                owners.setdefault(iteration, set()).add(owner)
        return owners

    def _raise_nothing_complete(self) -> None:
        """Raises (identically on every rank) why no iteration is complete."""
        owners = self._owners_by_iteration()
        if not owners:
            raise CheckpointingException(
                f"No local checkpoint found on any rank (session {self.session_id!r})"
            )
        newest = max(owners)
        lost = sorted(set(range(_dist.get_world_size())) - owners[newest])
        raise NoReplicasAvailableError(
            f"No complete local checkpoint: no rank holds a usable copy of iteration {newest}'s "
            f"part of rank(s) {lost} (session {self.session_id!r})"
        )

    def _retrieve(
        self,
        plan: ExchangePlan,
        wanted: CkptID,
        parts: Dict[CkptID, Part],
        received: Dict[CkptID, torch.Tensor],
    ) -> List[Tuple[int, CkptID]]:
        """Collective: one attempt at `plan`. Reads and verifies the parts kept here (into
        `parts`) while the parts other ranks need are streamed from their files and the
        parts this rank needs arrive (verified, into `received`); see `_retrieve.py`.

        Returns:
            The copies found unusable here, as `(holder rank, id)`.
        """
        me = self.rank
        keep = [
            id_
            for s, r, id_ in plan.transfers
            if s == r == me and id_ not in parts and id_ not in received
        ]
        bad: List[Tuple[int, CkptID]] = []
        with concurrent.futures.ThreadPoolExecutor(1, "dc-local-keep") as pool:
            kept = pool.submit(lambda: [(i, self._checked_part(i, wanted)) for i in keep])
            try:
                got, unsent = stream_transfers(host_group(), plan.transfers, me, self._part_source)
            finally:
                outcomes = kept.result()
        for id_, outcome in outcomes:
            if isinstance(outcome, Part):
                parts[id_] = outcome
            else:
                logger.warning(
                    "local checkpoint part %s unusable, trying another copy: %s",
                    describe_id(id_),
                    outcome,
                )
                bad.append((me, id_))
        bad += [(me, id_) for id_ in unsent]
        for id_, (sender, buffer) in got.items():
            where = f"local checkpoint part {describe_id(id_)} (sent by rank {sender})"
            try:
                held, _ = decode_image(buffer, where, verify=True, weights_only=self.weights_only)
                _check_id(held, id_, where)
            except CheckpointingException as e:
                logger.warning("copy from rank %d unusable, trying another: %s", sender, e)
                bad.append((sender, id_))
                continue
            received[id_] = buffer
        return bad

    def load(self) -> Tuple[TensorAwareStateDict, CkptID]:
        """Collective: loads this rank's part of the newest complete iteration.

        Parts held here are read and verified; a corrupted one counts as missing. Each rank's
        part comes from itself when possible, else from a holder.

        Returns:
            `(state_dict, ckpt_id)`, tensors on the devices they were saved from.

        Raises:
            CheckpointingException: no local checkpoint exists at all (on every rank).
            NoReplicasAvailableError: a rank's part of the newest iteration has no usable
                copy (on every rank, naming the iteration and rank).
        """
        start = time.perf_counter()
        iteration = self.find_latest()
        assert self.globally_available_ids is not None
        if iteration == -1:
            self._raise_nothing_complete()
        wanted = self._ckpt_id(iteration)
        available = {
            r: [tuple(i) for i in ids if i[0] == iteration]
            for r, ids in enumerate(self.globally_available_ids)
        }
        # every rank wants its own part of the same iteration: no need to ask
        everyone = {r: [(iteration, r, self.session_id)] for r in range(_dist.get_world_size())}
        parts: Dict[CkptID, Part] = {}  # parts read here, verified
        received: Dict[CkptID, torch.Tensor] = {}  # copies from other ranks, verified
        try:
            while True:
                plan = plan_retrieval(available, everyone)  # type: ignore[arg-type]
                bad = self._retrieve(plan, wanted, parts, received)
                reports = _dist.all_gather_object((bad, sorted(received)))
                if not any(b for b, _ in reports):
                    break
                # unusable copies are dropped, copies now in memory count as held there
                for rank, (b, got) in enumerate(reports):
                    for holder, id_ in b:
                        available[holder] = [i for i in available[holder] if i != tuple(id_)]
                    for id_ in got:
                        if tuple(id_) not in available[rank]:
                            available[rank].append(tuple(id_))
            image = parts[wanted].buffer if wanted in parts else received[wanted]
            _, state = decode_image(
                image,
                f"local checkpoint part {describe_id(wanted)}",
                verify=False,  # verified as it was read, or as it was received
                weights_only=self.weights_only,
            )
            own = parts.get(wanted)
            pinned = own is not None and own.pooled is not None
            # from a page-locked buffer the device copies run asynchronously, then one wait
            state.restore_tensor_device(non_blocking=pinned)
            if pinned:
                for device in {t.device for t in state.tensors if t.is_cuda}:
                    torch.cuda.synchronize(device)
        finally:
            for part in parts.values():
                release_part(part)
        elapsed = time.perf_counter() - start
        logger.info(
            "loaded local checkpoint %s: %.1f MB in %.2f s (%.0f MB/s)",
            describe_id(wanted),
            image.numel() / 1e6,
            elapsed,
            image.numel() / 1e6 / max(elapsed, 1e-9),
        )
        return state, wanted
