"""Sealing: `checksums.json` as a checkpoint's commit record, and the checks of it.

A `torch_dist` save with checksums writes `checksums.json` binding, by xxh3-64 digest,
`.metadata`, its load index, `common.pt` and every data file's `.sums` sidecar (and, through
each sidecar's item digests, every item of the data file). At the commit, just before
`metadata.json` is written, rank 0 seals it (`seal_record`): it adds the digest of the
`metadata.json` about to be written and a random save id. `metadata.json` itself keeps its
four fields (megatron-core 0.16 refuses any other field), so the record points at it, not the
other way round; the record's own digest protects the record.

`check_seal` is the one judge of the record against the directory, called by `load` (rank 0)
and by `dist-ckpt verify`: every bound file present, a regular file (not a link into another
directory), no data file, sidecar or metadata file that the record does not bind, a
`metadata.json` matching its digest, and no `checksums.json` missing where sidecars show the
save wrote one. Reading each file's bytes against its digest is done where the bytes are read
(`integrity.Checksums`), and here for the whole files a load does not read.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

from ._claim import CLAIM_FNAME
from .core import CONFIG_FNAME, PathArg
from .errors import CheckpointCorruptedError, CheckpointingException
from .integrity import (
    ALGORITHM,
    CHECKSUMS_FNAME,
    SUMS_SUFFIX,
    Checksums,
    checksum,
    file_checksum,
    read_checksums,
    write_checksums,
)
from .storage import objstore
from .storage.fileio import read_capped

__all__ = [
    "Finding",
    "MISMATCH",
    "check_seal",
    "config_damage",
    "raise_findings",
    "seal_record",
    "warn_unverified",
]

logger = logging.getLogger(__name__)

#: names a file of a checkpoint's own has (data files, sidecars, DCP metadata, common
#: state): one of these that the record does not bind is reported as not part of the save;
#: other files (a user's notes, another tool's marker) are left alone
_DATA_SUFFIXES = (".distcp", SUMS_SUFFIX)
_METADATA_NAMES = (".metadata", ".metadata.index", "common.pt", CLAIM_FNAME)
_MAX_CONFIG_BYTES = 1 << 20
#: checkpoints already warned about as unverified (a warning once per checkpoint)
_warned: Set[str] = set()

#: what a whole file whose digest differs from the record's is (the record cannot tell which
#: of the two is foreign: neither names the other's save)
MISMATCH = (
    f"checksum mismatch ({ALGORITHM}): damaged, or it (or {CHECKSUMS_FNAME}) is a file of "
    "another checkpoint"
)

#: a problem found: (file name relative to the checkpoint, what is wrong with it)
Finding = Tuple[str, str]


def seal_record(checkpoint_dir: PathArg, config_payload: bytes) -> None:
    """Seals `checksums.json` (when the save wrote one) before `metadata.json` is written:
    binds `config_payload`, the exact bytes of `metadata.json`, the save's claim
    (`claim.json`, when it has one) and a new random save id. Not collective: the process
    that commits calls it."""
    ckpt = Path(checkpoint_dir)
    sums = read_checksums(ckpt)
    if sums is None:
        return
    sums.files[CONFIG_FNAME] = checksum(config_payload)
    claim = read_capped(ckpt / CLAIM_FNAME, _MAX_CONFIG_BYTES)
    if claim is not None:
        sums.files[CLAIM_FNAME] = checksum(claim)
    sums.save_id = secrets.token_hex(8)
    write_checksums(ckpt, sums)


def config_damage(checkpoint_dir: PathArg, sums: Optional[Checksums] = None) -> Optional[str]:
    """Why `metadata.json` is damaged, when a sealed record (`sums`, else read) says so (its
    digest differs from the one recorded at the commit); None otherwise (no record, or it
    matches)."""
    ckpt = Path(checkpoint_dir)
    try:
        sums = read_checksums(ckpt) if sums is None else sums
        raw = read_capped(ckpt / CONFIG_FNAME, _MAX_CONFIG_BYTES)
    except CheckpointingException:
        return None  # the record itself is reported where it is read
    bound = None if sums is None else sums.files.get(CONFIG_FNAME)
    if raw is None or bound is None or checksum(raw) == bound:
        return None
    return (
        f"{ckpt / CONFIG_FNAME} is damaged: its {ALGORITHM} digest differs from the one "
        f"{CHECKSUMS_FNAME} recorded when the checkpoint was committed (or it is another "
        "checkpoint's)"
    )


def _listing(ckpt: Path) -> Dict[str, str]:
    """`{name: ''}` for regular files, else a description of what the entry is."""
    if objstore.split(ckpt) is not None:
        return {name: "" for name in objstore.listdir(ckpt)}
    out: Dict[str, str] = {}
    with os.scandir(ckpt) as entries:
        for e in entries:
            if e.is_symlink():
                target = os.readlink(e.path)
                out[e.name] = (
                    f"a symbolic link (to {target}), not a file of its own: a checkpoint's "
                    "files are never links (relinked from another checkpoint?)"
                )
            elif not e.is_file(follow_symlinks=False):
                out[e.name] = "not a regular file"
            else:
                out[e.name] = ""
    return out


def _is_checkpoint_file(name: str) -> bool:
    return name.endswith(_DATA_SUFFIXES) or name in _METADATA_NAMES


def check_seal(
    checkpoint_dir: PathArg, *, hash_files: bool = False
) -> Tuple[List[Finding], Optional[Checksums]]:
    """Checks a checkpoint's files against its commit record. Not collective.

    Args:
        checkpoint_dir: a committed checkpoint directory.
        hash_files: also check the digest of each whole file the record binds other than
            the sidecars (`.metadata`, its index, `common.pt`): a load, which reads only
            the index, calls it so on one rank.

    Returns:
        `(findings, the record)`: findings name each file at fault (empty: sealed and
        intact); the record is None when the checkpoint has none (unverified).
    """
    ckpt = Path(checkpoint_dir)
    try:
        entries = _listing(ckpt)
    except OSError as e:
        return [(".", f"cannot be listed ({e.strerror or e})")], None
    try:
        sums = read_checksums(ckpt)
    except CheckpointingException as e:
        return [(CHECKSUMS_FNAME, str(e))], None
    if sums is None:
        sidecars = sorted(n for n in entries if n.endswith(SUMS_SUFFIX))
        if not sidecars:
            return [], None
        msg = (
            f"missing, although the checkpoint was saved with checksums (it has sidecars such "
            f"as {sidecars[0]}): the record that verifies its files is gone"
        )
        return [(CHECKSUMS_FNAME, msg)], None
    if sums.save_id is None:  # a record written before sealing: files only, as then
        return [], sums
    findings: List[Finding] = []
    damage = config_damage(ckpt, sums)
    if damage is not None:
        findings.append((CONFIG_FNAME, damage.replace(f"{ckpt / CONFIG_FNAME} is ", "")))
    data_files = {n[: -len(SUMS_SUFFIX)] for n in sums.files if n.endswith(SUMS_SUFFIX)}
    bound = set(sums.files) | data_files | {CHECKSUMS_FNAME, CONFIG_FNAME}
    for name in sorted(bound):
        kind = entries.get(name)
        if kind is None:
            findings.append((name, f"missing: the commit record ({CHECKSUMS_FNAME}) lists it"))
        elif kind:
            findings.append((name, kind))
    for name in sorted(set(entries) - bound):
        if _is_checkpoint_file(name):
            msg = f"not part of this save ({sums.save_id}): a file of another checkpoint or save"
            findings.append((name, msg))
    if hash_files and not findings:
        for name, digest in sorted(sums.files.items()):
            if name == CONFIG_FNAME or name.endswith(SUMS_SUFFIX):
                continue  # compared above / where each is read
            try:
                if file_checksum(ckpt / name) != digest:
                    findings.append((name, MISMATCH))
            except OSError as e:
                findings.append((name, f"cannot be read ({e.strerror or e})"))
    return findings, sums


def raise_findings(checkpoint_dir: PathArg, findings: List[Finding]) -> None:
    """Raises `CheckpointCorruptedError` naming every file of `findings` (if any)."""
    if findings:  # (each file by its path: a load's message names them relative to the dir)
        at = os.fspath(checkpoint_dir)
        listed = "; ".join(f"{os.path.join(at, name)}: {msg}" for name, msg in findings[:8])
        more = f" (and {len(findings) - 8} more)" if len(findings) > 8 else ""
        raise CheckpointCorruptedError(f"{listed}{more}")


def warn_unverified(checkpoint_dir: PathArg) -> None:
    """Warns, once per checkpoint and process, that a checkpoint has no checksums."""
    key = os.fspath(checkpoint_dir)
    if key not in _warned:
        _warned.add(key)
        logger.warning(
            "%s has no %s (written by another tool, or saved without checksums): its files "
            "are loaded without verification",
            key,
            CHECKSUMS_FNAME,
        )
