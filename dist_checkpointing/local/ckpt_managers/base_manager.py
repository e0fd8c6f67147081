"""`BaseCheckpointManager`: save, find and load local checkpoints, with replication.

A checkpoint of iteration I is one part `(I, r, session)` per rank r, stored by subclasses.
Save copies the tensors into a host image; one background thread per process removes older
parts of I held here, then writes this rank's part while the replication exchange writes the
peers'. Finalize commits the parts and removes older iterations; if any rank failed, every
rank removes I's files. `load` takes the newest iteration whose every part some rank holds.
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
    describe_ckpt_id,
)
from .._image import LocalImage, decode_image, finish_image, release_image, start_image
from .._parity_math import parse_record
from ..base_state_dict import TensorAwareStateDict
from ..replication._parity_rebuild import ParityReader, rebuild_lost_parts, rebuildable
from ..replication._retrieve import retrieve_parts
from ..replication.strategies import (
    CkptID,
    ImageSink,
    ReplicationStrategy,
)

__all__ = [
    "BaseCheckpointManager",
    "CheckpointingException",
    "SameMachineReplicationException",
    "CkptID",
]

logger = logging.getLogger(__name__)


_executor: Optional[concurrent.futures.ThreadPoolExecutor] = None


def _background_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The process's one background thread, so that saves never interleave their collectives."""
    global _executor
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(1, "dc-local-ckpt")
        _dist.at_teardown(_stop_background_thread)
    return _executor


def _stop_background_thread() -> None:
    """At teardown: waits for the thread before the groups it uses are destroyed."""
    global _executor
    if _executor is not None:
        _executor.shutdown(wait=True)
        _executor = None


class _MemorySink:
    """A received part collected in memory, stored with `_save_image` when complete."""

    def __init__(self, manager: BaseCheckpointManager, ckpt_id: CkptID, nbytes: int) -> None:
        self.manager, self.ckpt_id = manager, ckpt_id
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)

    def write(self, data: np.ndarray, offset: int) -> None:
        self.buffer.numpy()[offset : offset + data.size] = data

    def close(self) -> None:
        flat = self.buffer.numpy()
        image = LocalImage(self.ckpt_id, self.buffer, [], 0, 0, [], flat, finished=True)
        self.manager._save_image(image, self.ckpt_id)

    def abort(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)


class BaseCheckpointManager(ABC):
    """Saves and loads `TensorAwareStateDict`s as local checkpoints (collective methods).

    Args:
        session_id: names this training job's checkpoints (part of every checkpoint id).
        repl_strategy: where copies of each part go; None keeps each part on its owner only.
        use_replicas: whether parts held by other ranks count in `find_latest` and `load`
            (default: when `repl_strategy` is given).
        fsync: True: parts and the directory are fsync'd, so a committed part survives a
            machine crash; False: a crash can leave a part torn or missing, which checksums
            detect at load (a replica is used). Default: False with a `repl_strategy`.
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
        #: per rank, `(iteration, holder, group)` of its parity records (last `find_latest`)
        self.globally_available_parity: List[List[Tuple[int, int, Tuple[int, ...]]]] = []
        self._newest_committed = -1
        #: this rank's part as last verified by `_checked`, `(image, state)`, for `load`
        self._decoded: Optional[Tuple[torch.Tensor, TensorAwareStateDict]] = None
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

    @abstractmethod
    def _my_ckpt_ids(self) -> Iterable[CkptID]:
        """Committed parts stored here (dirty ones never count)."""

    def _parity_records(self) -> List[Tuple[int, int, Tuple[int, ...]]]:
        """`(iteration, holder, group)` of each committed parity record stored here."""
        return []

    @abstractmethod
    def _load_image(self, ckpt_id: CkptID) -> Tuple[torch.Tensor, str]:
        """Reads a committed part's bytes: `(image, where)` (CheckpointingException if unreadable)."""

    def _parity_reader(self, ckpt_id: CkptID) -> ParityReader:
        """Opens a parity record stored here for a rebuild: its checked trailer and a reader
        of its parity bytes (default: the whole record, read by `_load_image` and checked).

        Raises:
            CheckpointingException, OSError, ValueError: missing, unreadable or malformed.
        """
        image, where = self._load_image(ckpt_id)
        record, parity = parse_record(image.numpy(), where)

        def read(offset: int, out: np.ndarray) -> None:
            out[:] = parity[offset : offset + out.size]

        return record, read, where

    @abstractmethod
    def _save_image(self, image: LocalImage, ckpt_id: CkptID) -> None:
        """Stores a part as dirty (SameMachineReplicationException if that exists here)."""

    def _open_image(self, ckpt_id: CkptID, nbytes: int) -> ImageSink:
        """Opens where a received part is written (dirty once closed); default: via memory."""
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
        """Reads and verifies a committed part stored here (else CheckpointCorruptedError)."""
        image, where = self._load_image(ckpt_id)
        return decode_image(image, where, weights_only=self.weights_only)[1]

    def find_latest(self) -> int:
        """Collective: the newest complete iteration (see the module docstring), or -1."""
        if self.latest_iteration != -1:
            return self.latest_iteration
        local = sorted(set(self._my_ckpt_ids()))
        if not self.use_replicas:
            local = [i for i in local if i[1] == self.rank]
        records = self._parity_records() if self.use_replicas else []
        gathered = _dist.all_gather_object((local, records))
        self.globally_available_ids = [ids for ids, _ in gathered]
        self.globally_available_parity = [recs for _, recs in gathered]
        world = set(range(_dist.get_world_size()))
        complete = [
            it
            for it, o in self._owners_by_iteration().items()
            if o >= world or rebuildable(it, world - o, o, self.globally_available_parity)
        ]
        self.latest_iteration = max(complete, default=-1)
        return self.latest_iteration

    def save(
        self, state_dict: TensorAwareStateDict, iteration: int, is_async: bool = False
    ) -> Optional[AsyncRequest]:
        """Collective: saves this rank's part of `iteration` (see the module docstring).

        Args:
            state_dict: this rank's state; unchanged, and free to change once `save` returns.
            iteration: the global iteration; must be newer than any saved by this manager.
            is_async: return an `AsyncRequest` instead of waiting for the writes (None).

        Raises:
            SameMachineReplicationException: a dirty file of `iteration` exists on some rank
                (a save in progress or interrupted; raised on every rank).
            CheckpointingException: any other failure, on every rank (with `is_async`,
                background failures surface as `AsyncSaveError` from the queue).
        """
        start = time.perf_counter()
        ckpt_id = self._ckpt_id(iteration)
        what = f"local checkpoint save of iteration {iteration}"
        image: Optional[LocalImage] = None
        error: Optional[BaseException] = None
        try:
            image = self._start_save(state_dict, ckpt_id, is_async)
        except Exception as e:  # agreed on below
            error = e
        # an async rank beside a sync one would wait in other collectives until killed
        flow = f"iteration={iteration}, is_async={is_async}"
        try:
            _dist.agree_on_errors(error, what, flow=flow, alike="iteration and is_async")
        except CheckpointingException:
            if image is not None:
                release_image(image)
            raise
        assert image is not None
        self.latest_iteration = -1
        nbytes = image.nbytes
        future = _background_thread().submit(self._write_parts, image, iteration)

        def finalize() -> None:
            self._finalize_save(iteration, future)
            msg = "local checkpoint of iteration %d: %.1f MB (own part) in %.2f s"
            logger.info(msg, iteration, nbytes / 1e6, time.perf_counter() - start)

        request = AsyncRequest.from_future(
            future,
            [finalize],
            cleanup_fns=[lambda: self._drop_dirty(iteration, future)],
            description=f"local checkpoint iteration {iteration}",
        )
        if is_async:
            return request
        try:
            _dist.run_collectively(
                f"local checkpoint write of iteration {iteration}", future.result
            )
        except CheckpointingException:
            self._drop_dirty(iteration, future)
            raise
        finalize()
        return None

    def _start_save(
        self, state_dict: TensorAwareStateDict, ckpt_id: CkptID, is_async: bool
    ) -> LocalImage:
        """Checks that `ckpt_id` may be saved here, then copies `state_dict` into an image."""
        iteration = ckpt_id[0]
        if iteration <= self._newest_committed:
            raise CheckpointingException(
                f"Iteration {iteration} is not newer than the last saved iteration {self._newest_committed}"
            )
        in_progress = self._dirty_ids(iteration)
        if in_progress:  # another writer of this iteration on this machine
            raise SameMachineReplicationException(in_progress[0])
        if self.repl_strategy is not None:
            self.repl_strategy.prepare()
        # a sync save of CPU tensors writes and sends from the tensors themselves: the
        # caller waits until they are written and sent, so they cannot change
        return start_image(state_dict, ckpt_id, state_dict.tensor_names(), stage=is_async)

    def _write_parts(self, image: LocalImage, iteration: int) -> None:
        """Background: removes an older save of `iteration`, then writes all parts kept here."""
        try:
            if any(i[0] == iteration for i in self._my_ckpt_ids()):
                logger.info("local checkpoint of iteration %d replaces an earlier one", iteration)
                self._cleanup_failed_save(iteration)
            finish_image(image)  # before any byte is sent: replicas carry the same checksums
            if self.repl_strategy is None:
                self._save_image(image, image.ckpt_id)
                return
            with concurrent.futures.ThreadPoolExecutor(1, "dc-local-io") as pool:
                own = pool.submit(self._save_image, image, image.ckpt_id)
                try:
                    self.repl_strategy.replicate_stream(image, image.ckpt_id, self._open_image)
                finally:
                    own_error = own.exception()  # waits for the own write in every case
            if own_error is not None:
                raise own_error
        finally:
            release_image(image)

    def _drop_dirty(self, iteration: int, future: concurrent.futures.Future) -> None:
        """Removes this iteration's uncommitted files once its background work ended."""
        if future.done() and iteration > self._newest_committed:
            self._cleanup_failed_save(iteration)

    def _finalize_save(self, iteration: int, future: concurrent.futures.Future) -> None:
        """Collective: commits every part written here, agrees, then removes older iterations."""

        def commit() -> None:
            future.result()  # done on every rank (the queue or `save` waited)
            for ckpt_id in self._dirty_ids(iteration):
                self._commit(ckpt_id)

        try:
            _dist.run_collectively(f"local checkpoint commit of iteration {iteration}", commit)
        except CheckpointingException:
            self._cleanup_failed_save(iteration)
            raise
        self._newest_committed = iteration
        self._cleanup(iteration)
        self.latest_iteration = -1

    def _checked(self, ckpt_id: CkptID, received: Optional[Tuple[torch.Tensor, str]] = None) -> Any:
        """Verifies the copy of a part held here (or `received`, `(image, where)`): its bytes,
        or the error saying why not, also when its header names another part (a recycled
        file torn by a crash holds an older part's valid bytes)."""
        try:
            image, where = received or self._load_image(ckpt_id)
            held, state = decode_image(image, where, weights_only=self.weights_only)
            if tuple(held) != tuple(ckpt_id):
                raise CheckpointCorruptedError(
                    f"{where}: holds local checkpoint part {tuple(held)}, expected "
                    f"{tuple(ckpt_id)} (an older part's bytes: torn by a crash?)"
                )
            if ckpt_id[1] == self.rank:  # `load` returns it: its header is not decoded twice
                self._decoded = (image, state)
            return image
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

    def load(self) -> Tuple[TensorAwareStateDict, CkptID]:
        """Collective: loads this rank's part of the newest complete iteration (from itself
        when possible, else from a holder; a corrupted copy counts as missing).

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
        owners = self._owners_by_iteration()
        if not owners:
            raise CheckpointingException(
                f"No local checkpoint found on any rank (session {self.session_id!r})"
            )
        if iteration == -1:  # the same message on every rank
            gone = sorted(set(range(_dist.get_world_size())) - owners[max(owners)])
            raise NoReplicasAvailableError(
                f"No complete local checkpoint: no rank holds a usable copy of iteration "
                f"{max(owners)}'s part of rank(s) {gone}, nor parity to rebuild it from "
                f"(session {self.session_id!r})"
            )
        mine = self._ckpt_id(iteration)
        try:
            held, lost = retrieve_parts(self, iteration)
            if lost:
                rebuild_lost_parts(self, iteration, lost, held, self.globally_available_parity)
            decoded = self._decoded
        finally:
            self._decoded = None  # never keeps a part's buffer alive past this load
        image = held[mine]
        if decoded is not None and decoded[0] is image:
            state = decoded[1]
        else:
            where = f"local checkpoint part {describe_ckpt_id(mine)}"
            _, state = decode_image(image, where, verify=False, weights_only=self.weights_only)
        state.restore_tensor_device(non_blocking=False)
        msg = "loaded local checkpoint %s: %.1f MB in %.2f s"
        logger.info(msg, describe_ckpt_id(mine), image.numel() / 1e6, time.perf_counter() - start)
        return state, mine
