"""Maintenance of saved torch_dist checkpoints: removing the keys of a separated group.

Not collective: these run on one process against a checkpoint nobody is writing.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ...errors import CheckpointingException
from ...integrity import SUMS_SUFFIX, read_checksums, write_checksums
from ...storage import objstore
from .metadata_file import INDEX_FNAME, read_metadata, serialize_metadata, write_metadata_files
from .plan import DATA_SUFFIX

__all__ = ["remove_sharded_tensors"]

logger = logging.getLogger(__name__)


def remove_sharded_tensors(ckpt: Path, key_prefix: str) -> None:
    """Drops every key starting with `key_prefix` (a checkpoint's `separation_hint`), and the
    data files named with it (and their checksums); `.metadata` and its index (atomically)
    and `checksums.json` first.

    Raises:
        CheckpointingException: if no data file starts with the prefix, or kept keys live
            in those files (removing them would lose data).
    """
    ckpt = Path(ckpt)
    if not key_prefix:
        raise CheckpointingException("key_prefix must be non-empty")
    names = objstore.listdir(ckpt)
    doomed = sorted(n for n in names if n.endswith(DATA_SUFFIX) and n.startswith(key_prefix))
    if not doomed:
        raise CheckpointingException(
            f"No data file in {ckpt} starts with {key_prefix!r}; was it saved with separation_hint?"
        )
    metadata = read_metadata(ckpt)
    doomed_set = set(doomed)
    for index, info in metadata.storage_data.items():
        if not index.fqn.startswith(key_prefix) and str(info.relative_path) in doomed_set:
            raise CheckpointingException(
                f"Key {index.fqn!r} is stored in {info.relative_path}, which would be removed"
            )
    metadata.state_dict_metadata = {
        k: v for k, v in metadata.state_dict_metadata.items() if not k.startswith(key_prefix)
    }
    metadata.storage_data = {
        i: s for i, s in metadata.storage_data.items() if not i.fqn.startswith(key_prefix)
    }
    if isinstance(metadata.planner_data, dict):
        metadata.planner_data = {
            k: v for k, v in metadata.planner_data.items() if not str(k).startswith(key_prefix)
        }
    sums = read_checksums(ckpt)
    digests = write_metadata_files(ckpt, serialize_metadata(metadata))
    if sums is not None:
        sums.files.pop(INDEX_FNAME, None)
        sums.files.update(digests)
        for name in doomed:
            sums.ranges.pop(name, None)
        write_checksums(ckpt, sums)
    for name in doomed:
        objstore.remove(ckpt / name)
        objstore.remove(ckpt / (name + SUMS_SUFFIX))
    logger.info("Removed keys with prefix %r and %d file(s) from %s", key_prefix, len(doomed), ckpt)
