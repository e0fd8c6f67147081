"""Retrieving every rank's part of an iteration at load (`BaseCheckpointManager.load`).

Each rank wants its own part. A plan (`plan_retrieval`) names, for each part, a holder that
keeps it (a copy held by its owner) or sends it; every copy is verified where it lands
(`manager._checked`). Copies found unusable are dropped and the exchange planned again,
until every part is held or has no copy left: such parts are rebuilt from parity by the
caller (`_parity_rebuild`), or named by `plan_retrieval` where there is no parity.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Any, Dict, List, Set, Tuple

import torch

from ... import _dist
from ...errors import describe_ckpt_id
from .strategies import CkptID, ExchangePlan, host_group, plan_retrieval, transfer_parts

__all__ = ["retrieve_parts"]

logger = logging.getLogger(__name__)


def retrieve_parts(manager: Any, iteration: int) -> Tuple[Dict[CkptID, torch.Tensor], Set[int]]:
    """Collective: `(held, lost)` for `iteration` after the manager's last `find_latest`:
    the verified parts read or received here, and the ranks whose part has no copy left
    (to rebuild from parity; empty where the checkpoint has no parity records).

    Raises:
        NoReplicasAvailableError: on every rank, a part without any usable copy and no
            parity to rebuild it from (from `plan_retrieval`).
    """
    available = {
        r: [tuple(i) for i in ids if i[0] == iteration]
        for r, ids in enumerate(manager.globally_available_ids)
    }
    # every rank wants its own part of the same iteration: no need to ask
    everyone = {r: [(iteration, r, manager.session_id)] for r in range(_dist.get_world_size())}
    held: Dict[CkptID, torch.Tensor] = {}  # parts read here or received, verified
    while True:
        # parts without any copy left are rebuilt from parity by the caller (or reported there)
        copies = {tuple(i) for ids in available.values() for i in ids}
        lost = {r for r, ids in everyone.items() if tuple(ids[0]) not in copies}
        if not any(manager.globally_available_parity):
            lost = set()  # nothing to rebuild from: `plan_retrieval` names the part
        wanted = {r: ids for r, ids in everyone.items() if r not in lost}
        plan = plan_retrieval(available, wanted)  # type: ignore[arg-type]
        bad = _attempt(manager, plan, held)
        reports = _dist.all_gather_object((bad, sorted(held)))
        if not any(b for b, _ in reports):
            return held, lost
        # unusable copies are dropped, copies now in memory count as held there
        for rank, (b, got) in enumerate(reports):
            for holder, id_ in b:
                available[holder] = [i for i in available[holder] if i != tuple(id_)]
            for id_ in got:
                if tuple(id_) not in available[rank]:
                    available[rank].append(tuple(id_))


def _attempt(manager: Any, plan: ExchangePlan, held: Dict[CkptID, torch.Tensor]) -> List[Any]:
    """Collective: one attempt at `plan`; usable parts (kept or received) go into `held`.
    Returns the copies found unusable, as `(holder rank, id)`."""
    me = manager.rank
    keep = [id_ for s, r, id_ in plan.transfers if s == r == me and id_ not in held]

    def check_kept() -> List[Any]:
        return [(me, i, manager._checked(i)) for i in keep]

    if all(s == r for s, r, _ in plan.transfers):
        # every rank keeps its own copy (the plan is the same everywhere, so every rank
        # skips the exchange): nothing to overlap the checks with, no sizes to announce
        outcomes = check_kept()
        got: Dict[CkptID, Tuple[int, torch.Tensor]] = {}
        unsent: List[CkptID] = []
    else:
        with concurrent.futures.ThreadPoolExecutor(1, "dc-local-keep") as pool:
            kept = pool.submit(check_kept)
            try:
                got, unsent = transfer_parts(
                    plan, lambda id_: manager._load_image(id_)[0], host_group()
                )
            finally:
                outcomes = kept.result()
    for id_, (sender, buffer) in got.items():
        where = f"local checkpoint part {describe_ckpt_id(id_)} (sent by rank {sender})"
        outcomes.append((sender, id_, manager._checked(id_, (buffer, where))))
    bad = [(me, id_) for id_ in unsent]
    for holder, id_, outcome in outcomes:
        if isinstance(outcome, torch.Tensor):
            held[id_] = outcome
        else:
            msg = "copy of part %s held by rank %d unusable, trying another: %s"
            logger.warning(msg, describe_ckpt_id(id_), holder, outcome)
            bad.append((holder, id_))
    return bad
