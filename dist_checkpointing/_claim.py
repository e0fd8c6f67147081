"""A save's claim on its checkpoint directory: `claim.json`, created exclusively.

Before any rank writes, rank 0 (every rank for node-local backends, each in its own
directory) creates `claim.json` with O_CREAT | O_EXCL (on an object store: a PUT with
`If-None-Match: *`), holding a random token, its host, pid and time. A second save into the
same directory cannot create it and fails before writing anything, naming the claim it
found. Every rank checks that the claim still holds its save's token before it writes and
before the commit. The claim is kept in a committed checkpoint (its token names the save)
and removed when the save fails before its commit. A claim is never taken over: a stale one
(its job died) is reported with how to clear it.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Tuple

from .errors import CheckpointClaimedError
from .storage import fsync_dir, objstore
from .storage.direct import create_new
from .storage.fileio import read_capped

__all__ = [
    "CLAIM_FNAME",
    "Claim",
    "new_claim",
    "write_claim",
    "read_claim",
    "verify_claim",
    "release_claim",
    "node_local_claim_name",
    "SAVE_ID_KEY",
    "token_lanes",
    "token_of_lanes",
]

logger = logging.getLogger(__name__)

CLAIM_FNAME = "claim.json"
#: the common-state key under which each part of a node-local checkpoint records its save's
#: id (rank 0's claim token): parts of another save, swapped or linked in, are told apart
SAVE_ID_KEY = "__dist_checkpointing_save_id__"
_MAX_BYTES = 1 << 16
_LANES = 4  # a token travels as four 31-bit lanes of the save's first agreement
_LANE_BITS = 31


@dataclass(frozen=True)
class Claim:
    """The content of `claim.json`: which save holds a directory.

    Attributes:
        token: 32 hex digits, random per save (the save's identity).
        host: the claiming process's host name.
        pid: its process id.
        time: when it claimed (UTC, ISO 8601).
    """

    token: str
    host: str
    pid: int
    time: str

    def describe(self) -> str:
        """'token T, pid P on host H, since TIME' (for messages)."""
        return f"token {self.token}, pid {self.pid} on host {self.host!r}, since {self.time}"

    def encode(self) -> bytes:
        """The JSON bytes of `claim.json`."""
        return json.dumps({"format": 1, **asdict(self)}, sort_keys=True).encode() + b"\n"


def new_claim() -> Claim:
    """A claim for a new save by this process (a fresh random token)."""
    lanes = [secrets.randbits(_LANE_BITS) for _ in range(_LANES)]
    token = "".join(f"{lane:08x}" for lane in lanes)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return Claim(token, socket.gethostname(), os.getpid(), now)


def token_lanes(token: Optional[str]) -> Tuple[int, ...]:
    """The token as small ints that survive a sum over ranks (zeros for None)."""
    if token is None:
        return (0,) * _LANES
    return tuple(int(token[i : i + 8], 16) for i in range(0, 8 * _LANES, 8))


def token_of_lanes(lanes: Tuple[int, ...]) -> Optional[str]:
    """The token `token_lanes` encoded (None for all zeros: no claim was sent)."""
    if not any(lanes):
        return None
    return "".join(f"{int(lane):08x}" for lane in lanes)


def node_local_claim_name(rank: int) -> str:
    """The claim file of `rank` in a node-local checkpoint directory (which the ranks of a
    node share, each with a claim of its own)."""
    return f"claim_{rank}.json"


def _path(ckpt: Path, name: str = CLAIM_FNAME) -> Path:
    return Path(ckpt) / name


def read_claim(ckpt: Path, name: str = CLAIM_FNAME) -> Optional[Claim]:
    """The claim `name` of `ckpt` (None when there is none; a damaged one reads with token
    '?')."""
    raw = read_capped(_path(ckpt, name), _MAX_BYTES)
    if raw is None:
        return None
    try:
        data = json.loads(raw.decode())
        return Claim(str(data["token"]), str(data["host"]), int(data["pid"]), str(data["time"]))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return Claim("?", "?", -1, f"unknown (unreadable {CLAIM_FNAME}: {raw[:60]!r})")


def _liveness(other: Claim) -> str:
    """What this process can tell of whether the claiming process still runs."""
    if other.host != socket.gethostname() or other.pid <= 0:
        return "it may still be running"
    if other.pid == os.getpid():
        return "it is this process: an earlier save into this directory still in flight, or one that failed and could not remove its claim"
    try:
        os.kill(other.pid, 0)
    except ProcessLookupError:
        return "that process no longer runs: the claim is stale, left by a save that died"
    except PermissionError:
        pass
    return "that process is still running"


def claimed_error(
    ckpt: Path, other: Optional[Claim], name: str = CLAIM_FNAME
) -> CheckpointClaimedError:
    """The error of a save that finds `ckpt` claimed by `other`."""
    if other is None:  # removed between our attempt and our read
        held = "another save (whose claim was removed again before it could be read)"
    else:
        held = f"another save ({other.describe()}; {_liveness(other)})"
    return CheckpointClaimedError(
        f"{ckpt} is claimed by {held}: two saves must never write into one directory, so "
        "this save wrote nothing. Save to another directory. If no job is saving there any "
        f"more, the directory holds an incomplete checkpoint (it has no metadata.json): "
        f"remove it, or at least {_path(ckpt, name)}, and save again"
    )


def write_claim(ckpt: Path, claim: Claim, name: str = CLAIM_FNAME) -> None:
    """Claims `ckpt` (created if missing) for the save `claim` names, atomically, as the
    file `name`.

    Raises:
        CheckpointClaimedError: the directory is already claimed (naming that claim).
    """
    path, payload = _path(ckpt, name), claim.encode()
    if objstore.split(ckpt) is not None:
        try:
            objstore.put_object(path, payload, new=True)
        except FileExistsError:
            raise claimed_error(ckpt, read_claim(ckpt, name), name) from None
        return
    for attempt in range(3):  # a refused save may remove the empty directory meanwhile
        try:
            fd = create_new(path)
            break
        except FileExistsError:
            raise claimed_error(ckpt, read_claim(ckpt, name), name) from None
        except FileNotFoundError:
            if attempt == 2:
                raise
            os.makedirs(ckpt, exist_ok=True)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(ckpt)
    except BaseException:
        os.unlink(path)
        raise


def verify_claim(ckpt: Path, token: str, rank: int, when: str, name: str = CLAIM_FNAME) -> None:
    """Checks that `ckpt`'s claim `name` holds `token` (this save's).

    Args:
        rank: this rank (for the message).
        when: the step about to run ('writing', 'the commit').

    Raises:
        CheckpointClaimedError: the claim is gone or holds another token.
    """
    found = read_claim(ckpt, name)
    if found is not None and found.token == token:
        return
    if found is None:
        why = (
            f"rank {rank} finds no {name} in {ckpt}, which this save created (token "
            f"{token}): the directory was removed or cleaned during the save, or it is not one "
            "directory shared by every rank (each rank must see the same checkpoint directory)"
        )
    else:
        why = (
            f"rank {rank} finds {ckpt} claimed by another save ({found.describe()}; "
            f"{_liveness(found)}), not this one (token {token}): its claim was removed and "
            "taken while this save ran"
        )
    raise CheckpointClaimedError(f"refusing to go on to {when}: {why}")


def release_claim(ckpt: Path, token: str, name: str = CLAIM_FNAME) -> None:
    """Removes `ckpt`'s claim `name` if it is still this save's (a save that failed before
    its commit); a failure to do so is logged, never raised."""
    try:
        found = read_claim(ckpt, name)
        if found is not None and found.token == token:
            objstore.remove(_path(ckpt, name))
            if objstore.split(ckpt) is None:
                fsync_dir(ckpt)
    except Exception as e:  # the failed save's own error is what the caller raises
        logger.warning("could not remove the claim %s of a failed save: %s", _path(ckpt, name), e)
