"""`LocalCheckpointManager`: local checkpoint parts as files on node-local storage.

Layout (the reference layout, so operators' scripts keep working):
`<root>/<session_id>/<rank>/iter_<iteration, 7+ digits>_<owner rank>_local.pt`, written
first as `..._local.dirty.pt` and renamed at commit; with `fsync` (the default without
replication) the file is fsync'd before and the directory after the rename.
The files are our byte images (see `.._image`), not pickles: loading one never runs code.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Iterable, List, Optional, Tuple, Union

import torch

from ..._fileio import fsync_dir
from ...errors import CheckpointCorruptedError, CheckpointingException
from ...storage import StreamedFile
from .._image import LocalImage, read_image, write_image
from .._read import FilePartSource, Part, read_part
from ..replication.strategies import CkptID, ReplicationStrategy
from .base_manager import BaseCheckpointManager, SameMachineReplicationException

__all__ = ["LocalCheckpointManager"]

logger = logging.getLogger(__name__)

_NAME = re.compile(r"iter_(\d{7,})_(\d+)_local(\.dirty)?\.pt")


class LocalCheckpointManager(BaseCheckpointManager):
    """Keeps local checkpoints as files under `root_local_ckpt_dir/session_id/rank/`.

    Args:
        root_local_ckpt_dir: node-local directory (SSD, RAM disk); need not be shared.
        session_id: subdirectory and id component separating jobs under one root.
        repl_strategy: where copies of each part go (e.g. `CliqueReplicationStrategy`).
        use_replicas: see `BaseCheckpointManager`.
        fsync: the durability policy, see `BaseCheckpointManager` (default: fsync only
            without `repl_strategy`).
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
        if session_id and (os.sep in session_id or session_id in (".", "..")):
            raise CheckpointingException(f"session_id must be a plain name, got {session_id!r}")

    @property
    def local_ckpt_dir(self) -> Path:
        """This rank's directory."""
        return self.root_local_ckpt_dir / self.session_id / str(self.rank)

    def _path(self, ckpt_id: CkptID, dirty: bool = False) -> Path:
        iteration, owner, session = ckpt_id
        if session != self.session_id:
            raise CheckpointingException(
                f"Checkpoint id {ckpt_id} belongs to session {session!r}, not {self.session_id!r}"
            )
        suffix = ".dirty" if dirty else ""
        return self.local_ckpt_dir / f"iter_{iteration:07d}_{owner}_local{suffix}.pt"

    def _scan(self) -> List[Tuple[CkptID, bool, Path]]:
        try:
            entries = list(self.local_ckpt_dir.iterdir())
        except FileNotFoundError:
            return []
        out = []
        for path in entries:
            m = _NAME.fullmatch(path.name)
            if m and path.is_file():
                out.append(
                    ((int(m.group(1)), int(m.group(2)), self.session_id), bool(m.group(3)), path)
                )
        return out

    def _my_ckpt_ids(self) -> Iterable[CkptID]:
        return [ckpt_id for ckpt_id, dirty, _ in self._scan() if not dirty]

    def _dirty_ids(self, iteration: int) -> List[CkptID]:
        return [ckpt_id for ckpt_id, dirty, _ in self._scan() if dirty and ckpt_id[0] == iteration]

    def _load_image(self, ckpt_id: CkptID) -> Tuple[torch.Tensor, str]:
        path = self._path(ckpt_id)
        try:
            return read_image(str(path)), str(path)
        except FileNotFoundError as e:
            raise CheckpointCorruptedError(f"{path}: local checkpoint file is missing") from e
        except OSError as e:
            raise CheckpointCorruptedError(f"{path}: cannot be read: {e}") from e

    def _read_part(self, ckpt_id: CkptID, own: bool) -> Tuple[Part, str, bool]:
        path = self._path(ckpt_id)
        try:
            return read_part(str(path), own), str(path), True
        except FileNotFoundError as e:
            raise CheckpointCorruptedError(f"{path}: local checkpoint file is missing") from e
        except OSError as e:
            raise CheckpointCorruptedError(f"{path}: cannot be read: {e}") from e

    def _part_source(self, ckpt_id: CkptID) -> FilePartSource:
        path = self._path(ckpt_id)
        try:
            return FilePartSource(str(path))
        except FileNotFoundError as e:
            raise CheckpointCorruptedError(f"{path}: local checkpoint file is missing") from e
        except OSError as e:
            raise CheckpointCorruptedError(f"{path}: cannot be read: {e}") from e

    def _save_image(self, image: LocalImage, ckpt_id: CkptID) -> None:
        self.local_ckpt_dir.mkdir(parents=True, exist_ok=True)
        dirty = self._path(ckpt_id, dirty=True)
        try:
            # created exclusively, as the reference opens it with "bx": an existing dirty
            # file belongs to another writer (or an interrupted save) and is left alone
            write_image(image, str(dirty), fsync=self.fsync)
        except FileExistsError as e:
            raise SameMachineReplicationException(ckpt_id) from e

    def _open_image(self, ckpt_id: CkptID, nbytes: int) -> StreamedFile:
        self.local_ckpt_dir.mkdir(parents=True, exist_ok=True)
        try:
            # O_DIRECT: a replica is read only after its owner is lost; the page cache and
            # the CPU are left to this rank's own part and to training
            path = str(self._path(ckpt_id, dirty=True))
            return StreamedFile(path, nbytes, fsync=self.fsync, direct=True)
        except FileExistsError as e:
            raise SameMachineReplicationException(ckpt_id) from e

    def _commit(self, ckpt_id: CkptID) -> None:
        os.replace(self._path(ckpt_id, dirty=True), self._path(ckpt_id))
        if self.fsync:
            fsync_dir(self.local_ckpt_dir)

    def _remove(self, paths: Iterable[Path]) -> None:
        removed = False
        for path in paths:
            logger.debug("removing %s", path)
            path.unlink(missing_ok=True)
            removed = True
        if removed:
            fsync_dir(self.local_ckpt_dir)

    def _cleanup(self, iteration: int) -> None:
        # newer dirty files may belong to a save still running in the background
        self._remove(p for ckpt_id, _, p in self._scan() if ckpt_id[0] < iteration)

    def _cleanup_failed_save(self, iteration: int) -> None:
        self._remove(p for ckpt_id, _, p in self._scan() if ckpt_id[0] == iteration)
