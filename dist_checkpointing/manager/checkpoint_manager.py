"""`CheckpointManager`: when to save, how many to keep, which checkpoint to load.

One manager per training job, on every rank (as Orbax's). Two tiers: persistent `torch_dist`
checkpoints under `<root>/iter_<step>` every `save_interval` steps (reshardable), and
node-local ones every `local_save_interval` steps through `LocalCheckpointManager` (fast
recovery). Public methods are collective except `latest_step`, `all_steps`, `should_save`.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Deque, List, Optional, Tuple, TypeVar, cast

from .. import _dist
from .._types import ShardedStateDict, StateDict
from ..async_save import AsyncCallsQueue
from ..core import check_is_distributed_checkpoint
from ..dict_utils import dict_list_map_outplace
from ..errors import CheckpointingException, NoUsableCheckpointError
from ..local.ckpt_managers.local_manager import LocalCheckpointManager
from ..mapping import ShardedBase
from ..serialization import load, save
from ..storage import objstore
from ..tensor_aware_state_dict import MCoreTensorAwareStateDict
from .layout import (
    LATEST_FNAME,
    CheckpointManagerOptions,
    PathArg,
    RestoreInfo,
    parse_step,
    read_latest,
    step_dir_name,
    steps_to_delete,
    write_latest,
)

__all__ = ["CheckpointManagerOptions", "CheckpointManager", "RestoreInfo"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _fresh(sharded_state_dict: ShardedStateDict) -> ShardedStateDict:
    """A copy whose containers and sharded leaves a load attempt may change (tensors shared)."""
    return dict_list_map_outplace(
        lambda x: copy.copy(x) if isinstance(x, ShardedBase) else x, sharded_state_dict
    )


class CheckpointManager:
    """Saves on a schedule, keeps the newest checkpoints, loads the newest usable one.

    Example (every rank)::

        manager = CheckpointManager("/ckpts/run1", CheckpointManagerOptions(save_interval=100))
        state, start = manager.load(model_sharded_state_dict()) if manager.latest_step() is not None else (None, 0)
        for step in range(start + 1, steps + 1):
            train_step()
            manager.save(step, model_sharded_state_dict())
        manager.close()

    Args:
        root: the persistent tier's directory (shared by all ranks; created if missing).
        options: the policy (defaults: every 1000 steps, keep 2, async, no local tier).

    Raises:
        CheckpointingException: invalid options, or `root` cannot be created (every rank).
    """

    def __init__(self, root: PathArg, options: Optional[CheckpointManagerOptions] = None) -> None:
        self.root = Path(root)
        self.options = options or CheckpointManagerOptions()
        self.failed_saves: List[Tuple[int, str]] = []
        self.last_restore: Optional[RestoreInfo] = None
        self._queue = AsyncCallsQueue()
        # (step, tier) of each scheduled background save, in schedule order: the queue
        # finalizes in order, so a failure belongs to the first entry
        self._in_flight: Deque[Tuple[int, str]] = deque()
        self._last_saved = -1
        self._closed = False
        self._local: Any = None
        self._persistent_latest = self._on_rank0(f"startup scan of {self.root}", self._startup)
        self._local_latest = -1
        if self.options.local_root is not None:
            self._local = LocalCheckpointManager(
                Path(self.options.local_root), self.options.session_id, self.options.replication
            )
            self._local_latest = self._local.find_latest()

    # ---- queries (not collective) -------------------------------------------------------
    def latest_step(self) -> Optional[int]:
        """The newest committed step across both tiers known to this manager, or None."""
        newest = max(self._persistent_latest, self._local_latest)
        return None if newest < 0 else newest

    def all_steps(self) -> List[int]:
        """Steps of the complete persistent checkpoints under the root, ascending."""
        return sorted(self._scan()[0])

    def should_save(self, step: int) -> Tuple[bool, bool]:
        """Whether `step` is due for `(persistent, local)` saves."""
        o = self.options
        local = self._local is not None and step % int(o.local_save_interval or 1) == 0
        return step % o.save_interval == 0, local

    # ---- saving -------------------------------------------------------------------------
    def save(self, step: int, sharded_state_dict: ShardedStateDict, *, force: bool = False) -> bool:
        """Collective: saves `sharded_state_dict` as `step` if a tier is due (or `force`).

        Cheap when nothing is due: it only finalizes finished background saves (one small
        all-reduce while a save is in flight, nothing otherwise).

        Args:
            step: the training step (increasing across calls).
            sharded_state_dict: as for `dist_checkpointing.save`; free to change on return.
            force: save to the persistent tier even if not due. The same on every rank: a
                rank forced alone waits in the save until the collective timeout (agree on
                a flag such as a caught preemption signal first, e.g. with an all-reduce).

        Returns:
            Whether a save was started.

        Raises:
            CheckpointingException: a failed save, on every rank (with `on_error='raise'`).
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointingException(f"step must be a non-negative int, got {step!r}")
        self._check_open()
        self._finalize(blocking=False)
        persistent, local = self.should_save(step)
        persistent = persistent or force
        if not (persistent or local) or step <= self._last_saved:
            return False
        self._last_saved = step
        tier = "local" if local else "persistent"
        try:
            if local:
                self._save_local(step, sharded_state_dict)
            if persistent:
                tier = "persistent"
                self._save_persistent(step, sharded_state_dict)
        except CheckpointingException as e:
            self._failed(step, tier, e)
        return True

    def _schedule(self, step: int, tier: str, request: Any, on_commit: Callable[[], None]) -> None:
        """Queues a background save; `on_commit` runs at its finalization (now if synchronous)."""
        if request is None:
            on_commit()
            return

        def committed() -> None:
            on_commit()  # if this raises, `_finalize` takes the entry as the failed save
            self._in_flight.popleft()

        request.add_finalize_fn(committed)
        self._in_flight.append((step, tier))
        try:
            self._queue.schedule_async_request(request)
        except BaseException:
            self._in_flight.pop()
            raise

    def _save_local(self, step: int, sharded_state_dict: ShardedStateDict) -> None:
        def committed() -> None:
            self._local_latest = max(self._local_latest, step)
            logger.info("local checkpoint of step %d committed", step)

        state, _ = MCoreTensorAwareStateDict.from_state_dict(sharded_state_dict, algo="atomic")
        request = self._local.save(state, step, is_async=self.options.async_save)
        self._schedule(step, "local", request, committed)

    def _save_persistent(self, step: int, sharded_state_dict: ShardedStateDict) -> None:
        path = self.root / step_dir_name(step)
        # ranks saving other steps would go on to save into other directories
        self._on_rank0(f"preparing {path}", self._clear_target, path, flow=f"step={step}")
        request = save(
            sharded_state_dict,
            path,
            sharded_strategy=self.options.sharded_strategy,
            async_sharded_save=self.options.async_save,
        )
        self._schedule(step, "persistent", request, lambda: self._persistent_committed(step))

    def _clear_target(self, path: Path, failed: bool = False) -> None:
        """Rank 0: removes an uncommitted directory at `path` (left by a crash, or by this
        run's `failed` save); before a save, moves a committed one (an earlier run's) aside."""
        if not objstore.exists(path):
            return
        if not check_is_distributed_checkpoint(path):
            if failed:
                logger.warning("removing %s, left by its failed save", path)
            objstore.remove_tree(path)
        elif not failed:
            aside = path.with_name(f"{path.name}.superseded-{int(time.time())}")
            logger.warning("%s exists from an earlier run; moved to %s", path, aside)
            objstore.replace_tree(path, aside)

    def _persistent_committed(self, step: int) -> None:
        """Collective (in finalization): `latest` record, then retention, on rank 0."""
        what = f"latest record and retention after step {step}"
        deleted = self._on_rank0(what, self._retain, step)
        self._persistent_latest = max(self._persistent_latest, step)
        msg = "checkpoint of step %d committed; latest = %d; removed %s"
        _dist.log_rank0(logger, logging.INFO, msg, step, step, deleted or "nothing")

    def _retain(self, step: int) -> List[int]:
        write_latest(self.root, step)
        complete, incomplete = self._scan()
        o = self.options
        doomed = steps_to_delete(complete, incomplete, step, o.keep_last, o.keep_period)
        for s in doomed:
            objstore.remove_tree(self.root / step_dir_name(s))
        return doomed

    def _failed(self, step: int, tier: str, error: CheckpointingException) -> None:
        """Collective: removes a failed save's directory, then raises or records and goes on."""
        if tier == "persistent":
            what = f"cleanup after the failed save of step {step}"
            self._on_rank0(what, self._clear_target, self.root / step_dir_name(step), True)
        if self.options.on_error == "raise":
            raise error
        self.failed_saves.append((step, str(error)))
        msg = "%s checkpoint save of step %d failed (on_error='continue': training goes on): %s"
        _dist.log_rank0(logger, logging.ERROR, msg, tier, step, error)

    def _finalize(self, blocking: bool) -> None:
        while self._queue.get_num_unfinalized_calls():
            try:
                self._queue.maybe_finalize_async_calls(blocking=blocking)
                return
            except CheckpointingException as e:
                # in-order finalization: the failed call is the oldest one not committed;
                # the queue dropped it, later calls stay queued
                step, tier = self._in_flight.popleft() if self._in_flight else (-1, "?")
                self._failed(step, tier, e)

    def wait_until_finished(self) -> None:
        """Collective: waits for and finalizes every save in flight."""
        self._finalize(blocking=True)

    def close(self) -> None:
        """Collective: waits for the saves in flight, then releases the background workers."""
        if self._closed:
            return
        try:
            self.wait_until_finished()
        finally:
            self._closed = True
            self._queue.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointingException(f"CheckpointManager({self.root}) is closed")

    # ---- loading ------------------------------------------------------------------------
    def load(
        self, sharded_state_dict: ShardedStateDict, **load_kwargs: Any
    ) -> Tuple[StateDict, int]:
        """Collective: loads the newest usable checkpoint of either tier.

        Candidates are tried newest first (local first at equal steps); one missing on some
        rank, incomplete or failing its checksums is skipped and logged, and moved aside
        (persistent: renamed `iter_X.unusable-<time>`; local: removed) once an older one
        loaded, so that later saves and retention see one timeline.

        Args:
            sharded_state_dict: what to load, as for `dist_checkpointing.load` (the local
                tier needs the saved layout; the persistent tier reshards).
            **load_kwargs: passed to `dist_checkpointing.load` (e.g. `strict`).

        Returns:
            `(state_dict, step)`; details in `last_restore`.

        Raises:
            NoUsableCheckpointError: no candidate loads (on every rank, listing each and why).
        """
        self._check_open()
        self._finalize(blocking=True)
        candidates = self._candidates()
        skipped: List[Tuple[str, str]] = []
        for step, tier, path in candidates:
            what = f"load of the {tier} checkpoint {path}"
            try:
                state = _dist.run_collectively(
                    what, self._load_one, tier, path, _fresh(sharded_state_dict), load_kwargs
                )
            except CheckpointingException as e:
                skipped.append((f"{tier} step {step} ({path})", str(e)))
                msg = "skipping %s checkpoint of step %d: %s"
                _dist.log_rank0(logger, logging.WARNING, msg, tier, step, e)
                continue
            self.last_restore = RestoreInfo(step, tier, path, skipped)
            self._after_restore(step, tier)
            more = f"; skipped {len(skipped)} newer: " + "; ".join(s for s, _ in skipped)
            msg = "loaded the %s checkpoint of step %d (%s)%s"
            _dist.log_rank0(logger, logging.INFO, msg, tier, step, path, more if skipped else "")
            return state, step
        skipped = _dist.broadcast_object(skipped)  # one message, the same on every rank
        what = "; ".join(f"{c}: {why}" for c, why in skipped) or "none found"
        raise NoUsableCheckpointError(
            f"No usable checkpoint under {self.root}"
            + (f" or local root {self.options.local_root}" if self._local is not None else "")
            + f" ({len(candidates)} tried): {what}"
        )

    def _candidates(self) -> List[Tuple[int, str, str]]:
        out = []
        if self._local is not None:
            self._local.latest_iteration = -1  # rescan: files may have changed since startup
            newest = self._local.find_latest()
            if newest >= 0:
                out.append((newest, "local", str(self._local.local_ckpt_dir)))
        complete = self._on_rank0(f"scan of {self.root}", self.all_steps)
        out += [(s, "persistent", str(self.root / step_dir_name(s))) for s in complete]
        out.sort(key=lambda c: (c[0], c[1] == "local"), reverse=True)
        return out

    def _load_one(self, tier: str, path: str, request: ShardedStateDict, load_kwargs: Any) -> Any:
        if tier == "local":
            return self._local.load()[0].to_state_dict(request, algo="atomic")
        return load(request, path, **load_kwargs)

    def _after_restore(self, step: int, tier: str) -> None:
        """Collective: newer checkpoints that failed to load leave the timeline."""

        def quarantine() -> int:
            complete, _ = self._scan()
            for s in complete:
                if s > step:
                    path = self.root / step_dir_name(s)
                    aside = path.with_name(f"{path.name}.unusable-{int(time.time())}")
                    logger.warning("moving the unusable checkpoint %s to %s", path, aside)
                    objstore.replace_tree(path, aside)
            return self._record_latest(max((s for s in complete if s <= step), default=-1))

        self._persistent_latest = self._on_rank0("quarantine after load", quarantine)
        if self._local is not None:
            # committed and dirty: a save killed with the previous run left its dirty files,
            # which the local manager (as the reference) takes for another writer otherwise
            stale = {ckpt_id[0] for ckpt_id, _, _ in self._local._scan() if ckpt_id[0] > step}
            for iteration in sorted(stale):
                self._local._cleanup_failed_save(iteration)
            self._local.latest_iteration = -1
            self._local_latest = step if tier == "local" else -1
        self._last_saved = step

    def _scan(self) -> Tuple[List[int], List[int]]:
        """`(complete, incomplete)` steps of the `iter_*` directories under the root."""
        try:
            entries = [self.root / name for name in objstore.listdir(self.root)]
        except FileNotFoundError:
            return [], []
        complete: List[int] = []
        incomplete: List[int] = []
        for p in entries:
            step = parse_step(p.name)
            if step is not None and objstore.is_dir(p):
                (complete if check_is_distributed_checkpoint(p) else incomplete).append(step)
        return complete, incomplete

    def _startup(self) -> int:
        """Rank 0: creates the root, removes crashed saves, repairs `latest`; the newest step."""
        objstore.makedirs(self.root)
        complete, incomplete = self._scan()
        for path in (self.root / step_dir_name(s) for s in incomplete):
            logger.warning("removing the incomplete checkpoint %s (a crashed save)", path.name)
            objstore.remove_tree(path)
        if not complete:
            objstore.remove(self.root / LATEST_FNAME)
        return self._record_latest(max(complete, default=-1))

    def _record_latest(self, newest: int) -> int:
        """Rank 0: makes the `latest` record name `newest` (if >= 0), which it may not after a
        crash between a commit and the record update, or when its checkpoint is gone."""
        if newest >= 0 and read_latest(self.root) != newest:
            write_latest(self.root, newest)
        return newest

    @staticmethod
    def _on_rank0(what: str, fn: Callable[..., T], *args: Any, flow: Optional[str] = None) -> T:
        """Collective: runs `fn` on rank 0; every rank gets its result or its failure (and,
        with `flow`, a failure when ranks' flows differ: `_dist.agree_on_errors`)."""
        result = _dist.run_collectively(
            what, lambda: fn(*args) if _dist.get_rank() == 0 else None, flow=flow, alike="step"
        )
        return cast(T, _dist.broadcast_object(result))
