"""One save's hold on its directory, from the claim to the end of the save.

A save claims its directory (`_claim`) before any rank writes; every rank checks the claim
before writing and before the commit. The commit (`metadata.json`) splits a save in two:
- before it, a failure every rank agreed on removes what the save wrote (the torch_dist
  strategy its data files, here `common.pt` and the claim); where a rank was lost (its
  collective failed) the outcome elsewhere is unknown, so the claim and the common state
  stay and the directory reads as an incomplete, claimed checkpoint;
- once rank 0 wrote the marker the checkpoint is complete: a rank lost in the closing
  agreement makes the survivors raise `RankLostAfterCommitError`, which says so.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Tuple

from . import _dist
from ._claim import (
    CLAIM_FNAME,
    Claim,
    new_claim,
    node_local_claim_name,
    release_claim,
    token_lanes,
    token_of_lanes,
    verify_claim,
    write_claim,
)
from .core import CONFIG_FNAME, check_is_distributed_checkpoint
from .errors import CheckpointingException, DistributedFailureError, RankLostAfterCommitError
from .storage import objstore

__all__ = ["Ownership"]

logger = logging.getLogger(__name__)

#: the common state file of the ('torch', 1) common strategy (removed with a failed save)
_COMMON_FNAME = "common.pt"
#: how long a survivor that did not write the marker looks for it after losing a peer
_MARKER_GRACE_S = 3.0


@dataclass
class Ownership:
    """What one rank knows of its save's claim and how far the save got.

    Attributes:
        ckpt: the checkpoint directory.
        node_local: every rank claims its own directory (node-local backends).
        claim: the claim this rank created (rank 0, or every rank when node-local).
        token: the save's token, the same on every rank once agreed.
        phase: 'preparing', 'writing', 'committing' or 'committed'.
        in_doubt: a failure came from a lost peer: what other ranks did is unknown.
        save_id: rank 0's claim token, the same on every rank once agreed (node-local
            parts record it: the save's identity).
    """

    ckpt: Path
    node_local: bool
    claim: Optional[Claim] = None
    token: Optional[str] = None
    phase: str = "preparing"
    in_doubt: bool = False
    save_id: Optional[str] = None

    @property
    def name(self) -> str:
        """This rank's claim file name."""
        return node_local_claim_name(_dist.get_rank()) if self.node_local else CLAIM_FNAME

    def take(self) -> None:
        """Rank 0 claims the directory (local; may raise `CheckpointClaimedError`, which the
        preparation's agreement raises everywhere). The other ranks of a node-local save
        claim theirs in `take_node_local`, once the agreement says rank 0's claim holds."""
        if _dist.get_rank() == 0:
            self._claim()

    def take_node_local(self) -> None:
        """Collective (node-local saves, after the preparation's agreement): every other rank
        claims its own directory; a claim refused anywhere is raised on every rank.

        Claiming after rank 0 makes of two jobs racing for one directory the one rank 0
        refused claim nothing: had every rank claimed at once, each job could hold some
        claims and both would fail."""
        mine = self._claim if _dist.get_rank() != 0 else (lambda: None)
        _dist.run_collectively(f"claims of {self.ckpt}", mine)
        if self.claim is not None:
            self.token = self.claim.token

    def _claim(self) -> None:
        claim = new_claim()
        write_claim(self.ckpt, claim, self.name)
        self.claim = claim

    def lanes(self) -> Tuple[int, ...]:
        """What this rank adds to the preparation's agreement: rank 0's token (zeros else)."""
        shared = self.claim is not None and _dist.get_rank() == 0
        return token_lanes(self.claim.token if shared and self.claim else None)

    def agreed(self, lanes: Sequence[int]) -> None:
        """Takes the token the agreement delivered; the save may write from now on."""
        token = self.claim.token if self.node_local and self.claim else None
        self.save_id = token_of_lanes(tuple(lanes))
        self.token = token or self.save_id
        if self.token is None:
            raise CheckpointingException(f"save to {self.ckpt}: no claim token was agreed")
        self.phase = "writing"

    def refused(self) -> None:
        """The save was refused before anything was written: gives the claim back."""
        if self.claim is not None:
            release_claim(self.ckpt, self.claim.token, self.name)

    def check(self, when: str) -> None:
        """Raises `CheckpointClaimedError` unless the claim is still this save's."""
        assert self.token is not None
        verify_claim(self.ckpt, self.token, _dist.get_rank(), when, self.name)

    def watch(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """`fn`, noting a failure that came from a lost peer."""

        def watched() -> Any:
            try:
                return fn()
            except BaseException as e:
                self.in_doubt = self.in_doubt or _dist.peer_lost(e)
                raise

        return watched

    def failed(self, error: BaseException) -> None:
        """After a failure before the commit: removes `common.pt` and the claim where every
        rank agreed on the failure (rank 0; node-local: each rank its claim)."""
        self.in_doubt = self.in_doubt or _dist.peer_lost(error)
        self.discard()

    def discard(self) -> None:
        """Removes what this rank's part of the save wrote besides the sharded strategy's
        files, unless the commit began or the outcome is in doubt."""
        if self.phase != "writing" or self.in_doubt or self.claim is None:
            return
        if not self.node_local:
            try:
                objstore.remove(self.ckpt / _COMMON_FNAME)
            except Exception as e:  # the save's own error is what the caller raises
                logger.warning("could not remove %s of a failed save: %s", _COMMON_FNAME, e)
        release_claim(self.ckpt, self.claim.token, self.name)
        self.phase = "discarded"

    def commit(self, write_marker: Callable[[], None]) -> None:
        """Collective: checks the claim on every rank, then runs `write_marker` (rank 0
        writes `metadata.json`) and the closing agreement.

        Raises:
            CheckpointClaimedError: on every rank, the claim is no longer this save's.
            RankLostAfterCommitError: a rank was lost after the marker was written: the
                checkpoint is complete.
            CheckpointingException: the commit failed on some rank (every rank raises).
        """
        self.phase = "committing"
        _dist.run_collectively(
            f"claim check of {self.ckpt} before its commit", self.check, "the commit"
        )
        try:
            _dist.run_collectively(f"commit of {self.ckpt}", write_marker)
        except DistributedFailureError as e:
            if _dist.peer_lost(e) and self._marker_written():
                raise RankLostAfterCommitError(self._after_commit_message(e)) from e
            raise
        self.phase = "committed"

    def _marker_written(self) -> bool:
        """Whether the commit marker is there (ranks that did not write it wait a little for
        rank 0, which may still be writing it)."""
        writes_it = self.node_local or _dist.get_rank() == 0
        deadline = time.monotonic() + (0.0 if writes_it else _MARKER_GRACE_S)
        while True:
            if check_is_distributed_checkpoint(self.ckpt):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def _after_commit_message(self, error: BaseException) -> str:
        lost = _dist.lost_ranks(error)
        if lost:
            what = f"{_dist.ranks_label(lost)} failed right after the commit (its process is gone)"
        else:
            what = (
                f"a rank other than {_dist.get_rank()} failed right after the commit (no "
                "process is gone: a rank is stuck, or a whole host went down unseen)"
            )
        return (
            f"The checkpoint at {self.ckpt} is committed and complete ({CONFIG_FNAME} was "
            f"written; it loads), but {what}, in the save's closing agreement; the process "
            f"group is unusable from here. ({error})"
        )
