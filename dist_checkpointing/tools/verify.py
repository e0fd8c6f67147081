"""`verify_checkpoint`: every check a load runs, plus reading every byte.

The checks `load` runs are called, not copied: the strategy selection (`metadata.json`), the
seal (`seal.check_seal`: every file the commit record binds present, its own and not a link, no
file of another save), the load index (`check_index`). Then, with `checksums.json` (ours),
items and whole files are checked against their digests (tensor data per block, to locate
damage to a byte range); without (megatron-core, stock DCP), every file must be long enough
and every item decode. Local parts: their images' checksums.
"""

from __future__ import annotations

import io
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Set

import numpy as np

from .._claim import node_local_claim_name, read_claim
from .._safe_load import torch_load
from ..core import CONFIG_FNAME, maybe_load_config
from ..errors import CheckpointingException, NotACheckpointError
from ..integrity import ALGORITHM, SUMS_SUFFIX, ItemSum, checksum, new_hasher
from ..seal import MISMATCH, check_seal
from ..storage import objstore
from ..storage.fileio import open_read
from . import _storage
from ._info import TOOLS_READ, PathArg, check_dir, is_stock_dcp, unreadable_backend
from ._local_info import (
    LocalPart,
    local_parity,
    local_parts,
    local_tier,
    parity_status,
    tier_step,
)

__all__ = ["Problem", "VerifyReport", "verify_checkpoint"]

_READ = 16 << 20  # the one read buffer: all the memory verifying needs


@dataclass
class Problem:
    """One damaged or missing piece: file, message, and key and byte range when known."""

    file: str
    message: str
    key: str = ""
    start: Optional[int] = None
    end: Optional[int] = None

    def __str__(self) -> str:
        key = f" [{self.key}]" if self.key else ""
        span = "" if self.start is None else f" bytes {self.start}-{self.end}"
        return f"{self.file}{key}{span}: {self.message}"


@dataclass
class VerifyReport:
    """The outcome of `verify_checkpoint`.

    Attributes:
        path, kind: the checkpoint, and its kind as in `describe` ('torch_dist', 'dcp', ...).
        step: the iteration checked, for a checkpoint manager's local tier.
        checksummed: whether checksums were available (else structure only).
        items, bytes: stored items checked, bytes read.
        problems: everything found wrong (empty when clean).
        parity: for a local checkpoint with parity records: its groups and which parts are
            present, rebuildable and lost (a damaged record or a lost part is a problem).
    """

    path: str
    kind: str
    checksummed: bool
    items: int = 0
    bytes: int = 0
    problems: List[Problem] = field(default_factory=list)
    step: Optional[int] = None
    parity: str = ""

    @property
    def ok(self) -> bool:
        """No problem found."""
        return not self.problems


def verify_checkpoint(path: PathArg, step: Optional[int] = None) -> VerifyReport:
    """Reads every byte of a checkpoint and checks every checksum. Not collective.

    Args:
        path: a `torch_dist`, stock DCP or local checkpoint, or a manager's local tier.
        step: which iteration of a local tier (default: the newest complete one).

    Returns:
        A report; damage is listed in `problems`, not raised.

    Raises:
        NotACheckpointError: `path` does not exist or holds no checkpoint files, or `step` is
            given for anything but a local tier holding it.
        CheckpointingException: a committed checkpoint of a backend the tools do not read
            (named, with what reads it).
    """
    ckpt = Path(path)
    check_dir(ckpt)
    report = VerifyReport(str(ckpt), "incomplete", False)
    _verify(ckpt, step, report)
    for p in report.problems:  # files named relative to the checkpoint, as in load errors
        p.message = p.message.replace(os.path.join(str(ckpt), ""), "")
    return report


def _verify(ckpt: Path, step: Optional[int], report: VerifyReport) -> None:
    config = None
    try:
        config = maybe_load_config(ckpt)
    except CheckpointingException as e:
        report.problems.append(Problem(CONFIG_FNAME, str(e)))
    has_dcp = objstore.exists(ckpt / _storage.DCP_METADATA_FNAME)
    if config is None and has_dcp and not is_stock_dcp(ckpt) and not report.problems:
        report.problems.append(
            Problem(CONFIG_FNAME, "missing: the save did not commit (incomplete checkpoint)")
        )
    tier = local_tier(ckpt) if config is None and not report.problems else {}
    if tier and _claimed_ranks(ckpt):  # a node-local save's directory, not a manager's tier
        report.problems.append(
            Problem(CONFIG_FNAME, "missing: the save did not commit (incomplete checkpoint)")
        )
    if tier:
        info = tier_step(ckpt, tier, step)
        report.step = info.step
        if info.problem:
            report.problems.append(Problem(".", info.problem))
    elif step is not None:
        raise NotACheckpointError(f"{ckpt}: step={step} selects an iteration of a local tier")
    if tier or (config is not None and config.sharded_backend == "local"):
        report.kind, report.checksummed = "local", True
        if config is not None:  # the strategies it names, as a load finds them
            _check_strategies(ckpt, report)
        _verify_local(ckpt, local_parts(ckpt, report.step), report)
        return
    if config is None and not has_dcp:
        if not report.problems:
            raise NotACheckpointError(
                f"{ckpt}: no {CONFIG_FNAME} and no {_storage.DCP_METADATA_FNAME}: not a "
                f"checkpoint, or a save that did not finish"
            )
        return
    report.kind = "dcp" if is_stock_dcp(ckpt) else "incomplete"
    if config is not None and not has_dcp and config.sharded_backend not in TOOLS_READ:
        b, v = config.sharded_backend, config.sharded_backend_version
        raise CheckpointingException(f"{ckpt}: {unreadable_backend(b, v, 'verify')}")
    if config is not None:
        report.kind = config.sharded_backend
        _check_strategies(ckpt, report)
    _verify_dcp(ckpt, report)


def _check_strategies(ckpt: Path, report: VerifyReport) -> None:
    """Whether the backends and versions `metadata.json` names load (as `load` checks)."""
    try:
        from ..serialization import verify_checkpoint_and_load_strategy

        verify_checkpoint_and_load_strategy(ckpt)
    except CheckpointingException as e:
        report.problems.append(Problem(CONFIG_FNAME, str(e)))


def _verify_dcp(ckpt: Path, report: VerifyReport) -> None:
    findings, checksums = check_seal(ckpt)  # what a load checks, on its first rank
    for name, message in findings:
        if name not in {p.file for p in report.problems}:  # a damaged file is reported once
            report.problems.append(Problem(name, message))
    report.checksummed = checksums is not None
    for name, digest in sorted(checksums.files.items()) if checksums is not None else []:
        if name not in {p.file for p in report.problems}:
            _verify_whole_file(ckpt / name, name, digest, report)
    reported = {p.file for p in report.problems}
    try:
        metadata = _storage.read_dcp_metadata(ckpt)
    except CheckpointingException as e:
        if _storage.DCP_METADATA_FNAME not in reported:
            report.problems.append(Problem(_storage.DCP_METADATA_FNAME, str(e)))
        return
    try:
        _storage.check_index(ckpt, metadata)  # the file loads plan from
    except CheckpointingException as e:
        if _storage.INDEX_FNAME not in reported:
            report.problems.append(Problem(_storage.INDEX_FNAME, str(e)))
    common = ckpt / _storage.COMMON_FNAME
    if objstore.exists(common) and _storage.COMMON_FNAME not in reported:
        try:
            with open_read(common) as f:
                torch_load(io.BytesIO(f.read()), str(common))
        except CheckpointingException as e:
            report.problems.append(Problem(_storage.COMMON_FNAME, str(e)))
    tensors = _storage.tensor_entries(metadata)
    for item in sorted(_storage.stored_items(metadata), key=lambda i: (i.file, i.offset)):
        report.items += 1
        if {item.file, item.file + SUMS_SUFFIX} & reported:  # missing, linked, swapped: said once
            continue
        expected = None
        if checksums is not None:
            try:
                expected = checksums.expected_range(
                    item.file, item.offset, item.length, f"{item.file}@{item.offset}"
                )
            except CheckpointingException as e:
                report.problems.append(_at(item, str(e)))
                continue
        _verify_item(ckpt, item, expected, item.key in tensors, report)


def _at(item: _storage.StoredItem, message: str) -> Problem:
    return Problem(item.file, message, item.key, item.offset, item.offset + item.length)


def _digest(f: Any, report: VerifyReport, length: float = math.inf) -> int:
    """The checksum of the next `length` bytes of `f` (or up to its end), counted as read."""
    h = new_hasher()
    while length > 0 and (piece := f.read(int(min(_READ, length)))):
        h.update(piece)
        report.bytes += len(piece)
        length -= len(piece)
    return h.intdigest()


def _verify_whole_file(path: Path, name: str, digest: int, report: VerifyReport) -> None:
    try:
        with open_read(path) as f:
            ok, size = _digest(f, report) == digest, f.tell()
    except OSError as e:
        report.problems.append(Problem(name, f"cannot be read ({e.strerror or e})"))
        return
    if not ok:
        report.problems.append(Problem(name, MISMATCH, "", 0, size))


def _verify_item(
    ckpt: Path,
    item: _storage.StoredItem,
    expected: Optional[ItemSum],
    is_tensor: bool,
    report: VerifyReport,
) -> None:
    try:
        f = open_read(ckpt / item.file)
    except OSError as e:
        report.problems.append(_at(item, f"cannot be read ({e.strerror or e})"))
        return
    with f:
        size = f.seek(0, os.SEEK_END)
        if size < item.offset + item.length:
            report.problems.append(_at(item, f"truncated: the file has {size} bytes"))
            return
        f.seek(item.offset)
        if expected is None:
            payload = f.read(item.length)
            report.bytes += len(payload)
            if is_tensor:
                _decode_tensor(payload, item, report)
        elif expected.blocked:
            _verify_blocked(f, item, expected, report)
        elif _digest(f, report, item.length) != expected.digest:
            report.problems.append(_at(item, f"checksum mismatch ({ALGORITHM})"))


def _verify_blocked(
    f: Any, item: _storage.StoredItem, expected: ItemSum, report: VerifyReport
) -> None:
    head = f.read(expected.data_off)
    data_start = item.offset + expected.data_off
    for k in range(len(expected.blocks)):
        n = min(expected.block, expected.data_len - k * expected.block)
        block = f.read(n)
        report.bytes += len(block)
        if checksum(block) != expected.blocks[k]:
            b0 = data_start + k * expected.block
            msg = f"checksum mismatch ({ALGORITHM}) in tensor data block {k}"
            report.problems.append(Problem(item.file, msg, item.key, b0, b0 + n))
    tail = f.read(item.length - expected.data_off - expected.data_len)
    report.bytes += len(head) + len(tail)
    if checksum(head + tail) != expected.digest:  # the records before and after the data
        msg = (
            f"checksum mismatch ({ALGORITHM}) in the item's records around its data "
            f"(bytes {item.offset}-{data_start} or after {data_start + expected.data_len})"
        )
        report.problems.append(_at(item, msg))


def _decode_tensor(payload: bytes, item: _storage.StoredItem, report: VerifyReport) -> None:
    """Without checksums: the item must decode to a tensor."""
    import torch

    try:
        value = torch_load(io.BytesIO(payload), f"{item.file}@{item.offset} ({item.key!r})")
        if not isinstance(value, torch.Tensor):
            raise CheckpointingException(f"expected a tensor, got {type(value).__name__}")
    except CheckpointingException as e:
        report.problems.append(_at(item, str(e)))


def _verify_local(ckpt: Path, parts: List[LocalPart], report: VerifyReport) -> None:
    if not parts:
        if not report.problems:  # (an incomplete tier's iteration is already reported)
            report.problems.append(Problem(".", "a local checkpoint without any part"))
        return
    save_ids = {}
    for part in parts:
        report.items += 1
        try:
            report.bytes += part.path.stat().st_size
            save_ids[part] = _storage.read_local_part(part).get("save_id")
        except (CheckpointingException, OSError) as e:
            report.problems.append(Problem(str(part.path.relative_to(ckpt)), str(e)))
    _verify_one_save(ckpt, parts, save_ids, report)
    _verify_parity(ckpt, parts, report)


def _verify_one_save(
    ckpt: Path, parts: List[LocalPart], save_ids: Dict[LocalPart, Any], report: VerifyReport
) -> None:
    """What a load checks of a node-local checkpoint's parts (`strategies.local`): each names
    the save that claimed the directory; and each rank that claimed it left its part."""
    claims = _claimed_ranks(ckpt)
    claim = read_claim(ckpt, node_local_claim_name(0)) if 0 in claims else None
    named = [i for i in save_ids.values() if i]
    expected = claim.token if claim is not None else (named[0] if named else None)
    if expected == "?":
        msg = "damaged (unreadable): the parts cannot be checked against the save it names"
        report.problems.append(Problem(node_local_claim_name(0), msg))
    for part, save_id in save_ids.items():
        if named and save_id != expected and expected != "?":
            where = str(part.path.relative_to(ckpt))
            msg = f"belongs to another save ({save_id}) than this checkpoint's ({expected})"
            report.problems.append(Problem(where, msg + ": another checkpoint's file"))
    if not local_parity(ckpt, parts[0].iteration):
        for rank in sorted(claims - {p.owner for p in parts}):
            msg = f"missing: rank {rank} saved into this directory ({node_local_claim_name(rank)})"
            report.problems.append(Problem(str(rank), msg + " but no copy of its part is here"))


def _claimed_ranks(ckpt: Path) -> Set[int]:
    """The ranks whose node-local claims (`claim_<rank>.json`) are in `ckpt`."""
    names = os.listdir(ckpt) if ckpt.is_dir() else []
    return {int(n[6:-5]) for n in names if re.fullmatch(r"claim_\d+\.json", n)}


def _verify_parity(ckpt: Path, parts: List[LocalPart], report: VerifyReport) -> None:
    """Checks every parity record of the parts' iteration (each chunk against its checksum)
    and says which parts are present, rebuildable and lost."""
    from ..local._parity_math import parse_record

    iteration = parts[0].iteration
    records = local_parity(ckpt, iteration)
    for record in records:
        report.items += 1
        where = str(record.path.relative_to(ckpt))
        try:
            data = np.fromfile(record.path, dtype=np.uint8)
            report.bytes += int(data.size)
            parse_record(data, where)
        except (OSError, ValueError) as e:
            report.problems.append(Problem(where, str(e)))
    owners = {p.owner for p in parts}
    text, rebuildable, world = parity_status(ckpt, iteration, owners, max(owners) + 1)
    report.parity = text
    lost = sorted(set(range(world)) - owners - rebuildable)
    if records and lost and not any(p.file == "." for p in report.problems):
        report.problems.append(Problem(".", f"part(s) of rank(s) {lost} lost: {text}"))
