"""`LocalCheckpointManager`: local checkpoint parts as files (layout in docs/formats.md).

Superseded parts are renamed to `spare_<hex>.bin` and the next save writes over one in place
(skipping block allocation); `load` rejects a recycled file's older bytes by the part id.
A load maps its part (`map_image`): a part whose tensors are still alive is never recycled.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import uuid
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Tuple, TypeVar, Union

import torch

from ...errors import CheckpointCorruptedError, CheckpointingException
from ...storage import StreamedFile, fsync_dir, read_region
from .._image import LocalImage, is_mapped, map_image, write_image
from .._parity_math import read_record_info
from ..memory import is_memory_path
from ..replication._parity_rebuild import ParityReader
from ..replication.parity import PARITY
from ..replication.strategies import CkptID, ReplicationStrategy
from .base_manager import BaseCheckpointManager, SameMachineReplicationException

__all__ = ["LocalCheckpointManager"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

_NAME = re.compile(r"iter_(\d{7,})_(\d+)_local(\.dirty)?\.pt")
#: a parity record (`ParityReplicationStrategy`) held by rank <holder>: id (it, holder, session, PARITY)
_PARITY_NAME = re.compile(r"iter_(\d{7,})_(\d+)_parity(\.dirty)?\.bin")
#: a superseded part kept for the next save to write over (never a checkpoint)
_SPARE = re.compile(r"spare_[0-9a-f]{32}\.bin")
#: a spare being moved to a dirty name by process <pid> (left only by a crash)
_CLAIM = re.compile(r"claim_(\d+)_\d+\.bin")


class LocalCheckpointManager(BaseCheckpointManager):
    """Keeps local checkpoints as files under `root_local_ckpt_dir/session_id/rank/`.

    Args:
        root_local_ckpt_dir: node-local directory (SSD, RAM disk); need not be shared. On a
            memory file system (a directory in /dev/shm: the host-memory tier, which
            outlives the training processes but not the machine) parts are written
            buffered and `fsync` defaults to False (see `dist_checkpointing.local.memory`).
        session_id: subdirectory and id component separating jobs under one root.
        repl_strategy: where copies of each part go (e.g. `CliqueReplicationStrategy`).
        use_replicas, fsync: as for `BaseCheckpointManager`.
    """

    def __init__(
        self,
        root_local_ckpt_dir: Union[str, Path],
        session_id: str = "",
        repl_strategy: Optional[ReplicationStrategy] = None,
        *,
        use_replicas: Optional[bool] = None,
        fsync: Optional[bool] = None,
    ) -> None:
        super().__init__(session_id, repl_strategy, use_replicas=use_replicas, fsync=fsync)
        self.root_local_ckpt_dir = Path(root_local_ckpt_dir)
        #: the root is in host memory (tmpfs, e.g. /dev/shm): buffered writes, no fsync
        self.in_memory = is_memory_path(self.root_local_ckpt_dir)
        if self.in_memory and fsync is None:
            self.fsync = False  # nothing to flush: the files are memory
        if session_id and (os.sep in session_id or session_id in (".", "..")):
            raise CheckpointingException(f"session_id must be a plain name, got {session_id!r}")
        self._spare_lock = threading.Lock()  # the own part and replicas are written at once

    @property
    def local_ckpt_dir(self) -> Path:
        """This rank's directory."""
        return self.root_local_ckpt_dir / self.session_id / str(self.rank)

    def _path(self, ckpt_id: Tuple, dirty: bool = False) -> Path:
        iteration, owner, session, *kind = ckpt_id
        if session != self.session_id:
            raise CheckpointingException(
                f"Checkpoint id {ckpt_id} belongs to session {session!r}, not {self.session_id!r}"
            )
        suffix = ".dirty" if dirty else ""
        if kind == [PARITY]:
            return self.local_ckpt_dir / f"iter_{iteration:07d}_{owner}_parity{suffix}.bin"
        return self.local_ckpt_dir / f"iter_{iteration:07d}_{owner}_local{suffix}.pt"

    def _scan(self) -> List[Tuple[Tuple, bool, Path]]:
        """This rank's parts and parity records: `(id, dirty, path)` (a record's id has a
        fourth element, `PARITY`)."""
        return [
            ((int(m.group(1)), int(m.group(2)), self.session_id, *extra), bool(m.group(3)), p)
            for pattern, extra in ((_NAME, ()), (_PARITY_NAME, (PARITY,)))
            for p, m in self._named(pattern)
            if p.is_file()
        ]

    def _my_ckpt_ids(self) -> Iterable[CkptID]:
        return [ckpt_id for ckpt_id, dirty, _ in self._scan() if not dirty and len(ckpt_id) == 3]  # type: ignore[misc]

    def _parity_records(self) -> List[Tuple[int, int, Tuple[int, ...]]]:
        out = []
        for ckpt_id, dirty, path in self._scan():
            if dirty or len(ckpt_id) != 4:
                continue
            try:
                record = read_record_info(str(path))
            except (OSError, ValueError) as e:  # unusable: as if it were missing
                logger.warning("ignoring parity record %s: %s", path, e)
                continue
            if (record.iteration, record.holder, record.session) == tuple(ckpt_id[:3]):
                out.append(record.info())
        return out

    def _dirty_ids(self, iteration: int) -> List[CkptID]:
        return [ckpt_id for ckpt_id, dirty, _ in self._scan() if dirty and ckpt_id[0] == iteration]

    def _load_image(self, ckpt_id: CkptID) -> Tuple[torch.Tensor, str]:
        path = self._path(ckpt_id)
        try:
            return map_image(str(path)), str(path)
        except FileNotFoundError as e:
            raise CheckpointCorruptedError(f"{path}: local checkpoint file is missing") from e
        except OSError as e:
            raise CheckpointCorruptedError(f"{path}: cannot be read: {e}") from e

    def _parity_reader(self, ckpt_id: CkptID) -> ParityReader:
        # the trailer only: the parity bytes are read (and checked) chunk by chunk, while the
        # kernel reads them ahead (the rebuild reads one chunk at a time, in order)
        path = str(self._path(ckpt_id))
        try:
            record = read_record_info(path)
        except FileNotFoundError as e:
            raise CheckpointCorruptedError(f"{path}: parity record is missing") from e
        if hasattr(os, "posix_fadvise"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, record.segment, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
        return record, lambda offset, out: read_region(path, offset, out), path

    def _named(self, pattern: re.Pattern[str]) -> List[Tuple[Path, re.Match[str]]]:
        """This rank's files whose names match `pattern`, sorted, with their matches."""
        try:
            entries = sorted(self.local_ckpt_dir.iterdir())
        except FileNotFoundError:
            return []
        return [(p, m) for p in entries for m in [pattern.fullmatch(p.name)] if m]

    def _spares(self) -> List[Path]:
        return [p for p, _ in self._named(_SPARE)]

    def _claim_spare(self, dirty: Path) -> bool:
        """Moves a spare to the new name `dirty` (False: none), via a name of this thread's own
        then a hard link, so `dirty` is never overwritten (FileExistsError if it exists)."""
        if dirty.exists():
            raise FileExistsError(str(dirty))
        with self._spare_lock:
            for spare in self._spares():
                if is_mapped(spare):  # a load's tensors still read it
                    continue
                claim = dirty.parent / f"claim_{os.getpid()}_{threading.get_ident()}.bin"
                try:
                    os.rename(spare, claim)
                except FileNotFoundError:  # taken by another writer meanwhile
                    continue
                try:
                    os.link(claim, dirty)
                except FileExistsError:
                    os.replace(claim, spare)  # still a spare
                    raise
                except OSError as e:  # no hard links here: write a new file
                    logger.debug("cannot recycle %s (%s); writing a new file", spare, e)
                    os.unlink(claim)
                    return False
                os.unlink(claim)
                st = os.lstat(dirty)
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:  # a link to another file:
                    os.unlink(dirty)  # never written through; a new file instead
                    return False
                return True
        return False

    def _write_dirty(self, ckpt_id: CkptID, write: Callable[[str, bool], T]) -> T:
        """`write(path, reused)` of a new dirty part, created exclusively (as the reference's
        "bx"): an existing dirty file (another writer's) is left alone."""
        self.local_ckpt_dir.mkdir(parents=True, exist_ok=True)
        dirty = self._path(ckpt_id, dirty=True)
        try:
            return write(str(dirty), self._claim_spare(dirty))
        except FileExistsError as e:
            raise SameMachineReplicationException(ckpt_id) from e

    def _save_image(self, image: LocalImage, ckpt_id: CkptID) -> None:
        self._write_dirty(
            ckpt_id, lambda p, reused: write_image(image, p, fsync=self.fsync, overwrite=reused)
        )

    def _open_image(self, ckpt_id: CkptID, nbytes: int) -> StreamedFile:
        # O_DIRECT: a replica is read back only after its owner is lost
        return self._write_dirty(
            ckpt_id,
            lambda p, reused: StreamedFile(
                p, nbytes, fsync=self.fsync, direct=not self.in_memory, overwrite=reused
            ),
        )

    def _commit(self, ckpt_id: CkptID) -> None:
        os.replace(self._path(ckpt_id, dirty=True), self._path(ckpt_id))
        if self.fsync:
            fsync_dir(self.local_ckpt_dir)

    def _remove(self, paths: Iterable[Path], durable: bool = True, changed: bool = False) -> None:
        """Unlinks `paths`; with `durable`, fsyncs the directory after any change (or `changed`)."""
        for path in paths:
            path.unlink(missing_ok=True)
            changed = True
        if changed and durable:
            fsync_dir(self.local_ckpt_dir)

    def _cleanup(self, iteration: int) -> None:
        # newer dirty files may belong to a save still running in the background
        scan = self._scan()
        older = sorted((ckpt_id, dirty, p) for ckpt_id, dirty, p in scan if ckpt_id[0] < iteration)
        # as many spares as the next save writes here (its parts of `iteration`)
        wanted = sum(1 for ckpt_id, dirty, _ in scan if ckpt_id[0] == iteration and not dirty)
        room = max(0, wanted - len(self._spares()))
        recycled = False
        for _, dirty, path in reversed(older):  # the newest older parts: likely the same sizes
            if room and not dirty and not is_mapped(path):  # mapped: unlinked, not recycled
                os.rename(path, self.local_ckpt_dir / f"spare_{uuid.uuid4().hex}.bin")
                room, recycled = room - 1, True
        # Durable only with `fsync`: a crash that loses these renames and unlinks brings
        # back an older name, either never chosen or rejected by the part id in its header.
        claims = [p for p, m in self._named(_CLAIM) if int(m.group(1)) != os.getpid()]
        self._remove([p for _, _, p in older if p.exists()] + claims, self.fsync, recycled)

    def _cleanup_failed_save(self, iteration: int) -> None:
        # always durable: this also removes an earlier save's committed parts of `iteration`
        # before a new save of it commits anywhere (old and new parts must never both
        # survive a crash, whatever the durability policy)
        self._remove(p for ckpt_id, _, p in self._scan() if ckpt_id[0] == iteration)
