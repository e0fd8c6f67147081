"""The package's coordination functions and the error-agreement rule.

"Collective" functions are called by all ranks of the group in the same order (without a
process group, each has its one-rank meaning); a dead or silent peer raises
`DistributedFailureError`. `agree_on_errors` turns a failure on any rank into an exception
on every rank, so no rank is left waiting in the next collective.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import datetime
import hashlib
import itertools
import logging
import os
from pathlib import Path
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    NoReturn,
    Optional,
    Tuple,
    TypeVar,
    Union,
)

import torch.distributed as dist

from . import _liveness, errors
from .errors import CheckpointingException, DistributedFailureError

__all__ = [
    "is_distributed",
    "get_rank",
    "get_world_size",
    "all_gather_object",
    "gather_object",
    "broadcast_object",
    "all_reduce_max",
    "barrier",
    "error_report",
    "format_rank_failures",
    "describe_rank_failures",
    "rank_ranges",
    "ranks_label",
    "raise_on_reported_errors",
    "agree_on_errors",
    "run_collectively",
    "log_rank0",
    "set_collective_timeout",
    "new_own_group",
    "at_teardown",
    "get_collective_timeout",
    "peer_lost",
    "lost_ranks",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")
Group = Optional[Any]

_MAX_MESSAGE = 2000  # one rank's cause
_MAX_TOTAL_MESSAGE = 4000  # every cause together (see format_rank_failures)

_timeout_s = float(os.environ.get("DIST_CKPT_TIMEOUT_S", "600"))
_coordination: Any = None
_coordination_key: Any = None
_idle: Any = None  # see _liveness: an idle group whose closed connections name dead ranks


def set_collective_timeout(seconds: float) -> None:
    """Sets how long checkpoint collectives wait for the other ranks before raising
    `DistributedFailureError` (same value on every rank; default `DIST_CKPT_TIMEOUT_S`, else
    600 s).

    Raises:
        CheckpointingException: for a non-positive value.
    """
    global _timeout_s
    if not isinstance(seconds, (int, float)) or seconds <= 0:
        raise CheckpointingException(
            f"timeout must be a positive number of seconds, got {seconds!r}"
        )
    _timeout_s = float(seconds)


def get_collective_timeout() -> float:
    """The current collective timeout in seconds (see `set_collective_timeout`)."""
    return _timeout_s


_own_groups: List[Any] = []  # groups this library created, destroyed at exit
_teardown_fns: List[Callable[[], None]] = []
_teardown_registered = False


def new_own_group(ranks: Optional[List[int]] = None, **kwargs: Any) -> Any:
    """Collective: `dist.new_group(ranks, **kwargs)`, destroyed by the library at exit."""
    group = dist.new_group(ranks, **kwargs)
    _own_groups.append(group)
    _register_teardown()
    return group


def at_teardown(fn: Callable[[], None]) -> None:
    """Runs `fn` at interpreter exit, before the library's own groups are destroyed."""
    if fn not in _teardown_fns:
        _teardown_fns.append(fn)
    _register_teardown()


def _register_teardown() -> None:
    global _teardown_registered
    if not _teardown_registered:
        atexit.register(_teardown)
        _teardown_registered = True


def _teardown() -> None:
    """At exit: stops the library's background work, then destroys its process groups (so
    gloo threads end before interpreter finalization, which would abort the process)."""
    global _coordination, _coordination_key, _idle
    for fn in list(_teardown_fns):
        try:
            fn()
        except Exception as e:  # exit goes on; say what could not be stopped
            logger.warning("dist_checkpointing teardown step %r failed: %s", fn, e)
    _teardown_fns.clear()
    groups, _own_groups[:] = list(_own_groups), []
    _coordination = _coordination_key = _idle = None
    if not (dist.is_available() and dist.is_initialized()):
        return
    live = dist.distributed_c10d._world.pg_map
    for group in reversed(groups):
        if group is None or group not in live:
            continue
        try:
            dist.destroy_process_group(group)
        except Exception as e:  # never turn a clean exit into a failing one
            logger.warning("could not destroy dist_checkpointing's process group: %s", e)


def _group(group: Group) -> Group:
    """`group`, or (for None) the coordination group: gloo, all ranks, our timeout (created
    on first use, collectively)."""
    global _coordination, _coordination_key, _idle
    if group is not None:
        return group
    key = (id(dist.distributed_c10d._get_default_group()), _timeout_s)
    if _coordination is None or _coordination_key != key:
        # creating it is a collective too: a peer lost meanwhile is waited for (our timeout)
        with _collective("creating the coordination group"):
            timeout = datetime.timedelta(seconds=_timeout_s)
            _coordination = new_own_group(backend="gloo", timeout=timeout)
            _idle = new_own_group(backend="gloo", timeout=timeout)
        _coordination_key = key
    return _coordination


@contextlib.contextmanager
def _collective(op: str) -> Iterator[None]:
    """Turns a collective's failure (a dead or silent peer) into `DistributedFailureError`,
    naming the ranks whose process is gone where they can be told (see `_liveness`)."""
    try:
        yield
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        gone = _liveness.lost_ranks(_idle) if _idle is not None else []
        if len(gone) == 1:
            who = f"rank {gone[0]}'s process is gone"
        elif gone:
            who = f"the processes of {ranks_label(gone)} are gone"
        else:
            who = f"another rank died or did not answer within {_timeout_s:.0f} s"
        lost = DistributedFailureError(
            f"Checkpoint collective {op} failed: {who} ({type(e).__name__}: {first})"
        )
        lost.peer_lost = True  # type: ignore[attr-defined]
        lost.lost_ranks = gone  # type: ignore[attr-defined]
        raise lost from e


def lost_ranks(error: BaseException) -> List[int]:
    """The ranks whose process was found gone when `error` (or what it was raised from),
    a collective's failure, happened; empty where none could be told."""
    return list(_from_causes(error, "lost_ranks") or [])


def peer_lost(error: BaseException) -> bool:
    """Whether `error` (or what it was raised from) is this rank's own collective failing
    (a peer died or went silent), rather than a failure every rank agreed on: then what the
    other ranks did is unknown."""
    return bool(_from_causes(error, "peer_lost"))


def _from_causes(error: BaseException, name: str) -> Any:
    """The first truthy attribute `name` that `_collective` set on `error` or its causes."""
    seen: Optional[BaseException] = error
    while seen is not None:
        if getattr(seen, name, None):
            return getattr(seen, name)
        seen = seen.__cause__
    return None


def is_distributed() -> bool:
    """Whether a default process group is initialized."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Group = None) -> int:
    """This process's rank in `group` (0 without a process group)."""
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group: Group = None) -> int:
    """Number of ranks in `group` (1 without a process group)."""
    return dist.get_world_size(group) if is_distributed() else 1


def all_gather_object(obj: T, group: Group = None) -> List[T]:
    """Collective: returns every rank's `obj`, indexed by group rank."""
    if not is_distributed():
        return [obj]
    g = _group(group)
    out: List[Any] = [None] * dist.get_world_size(g)
    with _collective("all_gather_object"):
        dist.all_gather_object(out, obj, group=g)
    return out


def gather_object(obj: T, dst: int = 0, group: Group = None) -> Optional[List[T]]:
    """Collective: group rank `dst` receives every rank's `obj` (indexed by rank); others None."""
    if not is_distributed():
        return [obj]
    g = _group(group)
    out: Optional[List[Any]] = [None] * dist.get_world_size(g) if dist.get_rank(g) == dst else None
    with _collective("gather_object"):
        dist.gather_object(obj, out, group_dst=dst, group=g)
    return out


def broadcast_object(obj: T, src: int = 0, group: Group = None) -> T:
    """Collective: returns group rank `src`'s `obj` on every rank."""
    if not is_distributed():
        return obj
    holder = [obj]
    with _collective("broadcast_object"):
        dist.broadcast_object_list(holder, group_src=src, group=_group(group))
    return holder[0]


def all_reduce_max(values: List[int], group: Group = None) -> List[int]:
    """Collective: the element-wise maximum of small int vectors over ranks (cheap flags)."""
    if not is_distributed():
        return list(values)
    import torch

    t = torch.tensor(values, dtype=torch.int64)
    with _collective("all_reduce"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_group(group))
    return [int(v) for v in t.tolist()]


def barrier(group: Group = None) -> None:
    """Collective: waits until every rank of `group` arrives."""
    if is_distributed():
        with _collective("barrier"):
            dist.barrier(group=_group(group))


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if len(text) <= _MAX_MESSAGE:
        return text
    return text[:_MAX_MESSAGE] + f" [... {len(text) - _MAX_MESSAGE} more characters cut]"


def rank_ranges(ranks: Iterable[int]) -> str:
    """'0-3, 5, 7-9' for ranks {0, 1, 2, 3, 5, 7, 8, 9} (consecutive runs compressed)."""
    parts: List[str] = []
    for _, run in itertools.groupby(enumerate(sorted(set(ranks))), lambda ir: ir[1] - ir[0]):
        first, *rest = [r for _, r in run]
        parts.append(f"{first}-{rest[-1]}" if rest else str(first))
    return ", ".join(parts)


def ranks_label(ranks: List[int]) -> str:
    """'rank 3' or 'ranks 0-3, 5'."""
    distinct = set(ranks)
    return f"rank {ranks[0]}" if len(distinct) == 1 else f"ranks {rank_ranges(distinct)}"


def format_rank_failures(what: str, failed: List[Tuple[int, str]]) -> str:
    """`<what> failed on <describe_rank_failures(failed)>`."""
    return f"{what} failed on {describe_rank_failures(failed)}"


def describe_rank_failures(failed: List[Tuple[int, str]]) -> str:
    """The ranks and causes of a failure: "ranks <ranges>: <cause>", ranks with the same
    cause grouped (in order of their lowest rank), "; "-separated, and cut to about
    `_MAX_TOTAL_MESSAGE` characters (the causes left out are counted, with their ranks)."""
    groups: Dict[str, List[int]] = {}
    for rank, cause in sorted(failed, key=lambda rc: rc[0]):
        groups.setdefault(cause, []).append(rank)
    head = f"{ranks_label([r for r, _ in failed])}: "
    if len(groups) == 1:
        return head + next(iter(groups))
    shown: List[str] = []
    size = len(head)
    items = list(groups.items())
    for n, (cause, ranks) in enumerate(items):
        part = f"{ranks_label(ranks)}: {cause}"
        if shown and size + len(part) > _MAX_TOTAL_MESSAGE:
            rest_ranks = [r for _, rs in items[n:] for r in rs]
            shown.append(
                f"[{len(items) - n} more distinct cause(s) on {ranks_label(rest_ranks)} cut "
                f"to keep this message under {_MAX_TOTAL_MESSAGE} characters; see those "
                "ranks' logs]"
            )
            break
        shown.append(part)
        size += len(part) + 2
    return head + "; ".join(shown)


def error_report(error: Optional[BaseException]) -> Optional[Tuple[str, str]]:
    """What a rank tells the others about its failure: (class name, message), or None."""
    return None if error is None else (type(error).__name__, _describe(error))


#: the checkpoint directory (with a trailing separator) whose files failure reports name
#: relative to it, within `naming_files_within`
_within: contextvars.ContextVar[str] = contextvars.ContextVar("dist_ckpt_within", default="")


@contextlib.contextmanager
def naming_files_within(ckpt: Union[str, os.PathLike[str]]) -> Iterator[None]:
    """Within the block (this thread), failures name files inside `ckpt` relative to it, as
    every damage message does (the message names `ckpt` once, in what failed)."""
    token = _within.set(os.path.join(os.fspath(Path(ckpt)), ""))
    try:
        yield
    finally:
        _within.reset(token)


def raise_on_reported_errors(
    reports: List[Optional[Tuple[str, str]]], error: Optional[BaseException], what: str
) -> None:
    """Raises (the failing rank's class if ours, else `DistributedFailureError`, naming each
    failing rank and cause) if any rank's report is a failure; no further collective."""
    failed: List[Tuple[int, Tuple[str, str]]] = [
        (rank, rep) for rank, rep in enumerate(reports) if rep is not None
    ]
    if error is not None and not failed:  # local failure not yet in the reports
        failed = [(get_rank(), (type(error).__name__, _describe(error)))]
    if not failed:
        return
    within = _within.get()
    causes = [(rank, rep[1].replace(within, "") if within else rep[1]) for rank, rep in failed]
    message = format_rank_failures(what, causes)
    cls: Any = getattr(errors, failed[0][1][0], None)  # the first failing rank's class
    if isinstance(error, CheckpointingException):
        cls = type(error)
    elif not (isinstance(cls, type) and issubclass(cls, CheckpointingException)):
        cls = DistributedFailureError
    try:
        exc = cls(message)
    except TypeError:  # a subclass with a richer constructor
        exc = DistributedFailureError(message)
    raise exc from error


#: the lane of a flow digest: the maxima over ranks of a digest and of its complement add up
#: to the lane exactly when every rank's digest is the same
_FLOW_LANE = (1 << 62) - 1


def failed_or_flows_differ(failed: bool, flow: str, group: Group = None) -> Tuple[bool, bool]:
    """Collective, one small reduction: `(whether any rank failed, whether ranks' `flow`s
    differ)`. A flow says how a rank goes on (its strategies and the arguments that decide
    which collectives follow): ranks going on differently would wait for each other in
    different collectives until the timeout."""
    digest = int.from_bytes(hashlib.blake2b(flow.encode(), digest_size=8).digest(), "little")
    digest &= _FLOW_LANE
    failed_any, top, bottom = all_reduce_max([int(failed), digest, _FLOW_LANE - digest], group)
    return bool(failed_any), top + bottom != _FLOW_LANE


def raise_flows_differ(what: str, flow: str, alike: str, group: Group = None) -> NoReturn:
    """Collective, once ranks' flows were found to differ: raises, on every rank, a
    `CheckpointingException` naming each rank's flow (`flows_differ`)."""
    raise CheckpointingException(flows_differ(what, all_gather_object(flow, group), alike))


def flows_differ(what: str, flows: List[str], alike: str) -> str:
    """The message when ranks would go on differently (`flows`, by rank); `alike`: what every
    rank must pass the same of."""
    ranks: Dict[str, List[int]] = {}
    for rank, flow in enumerate(flows):
        ranks.setdefault(flow, []).append(rank)
    each = "; ".join(f"{ranks_label(r)}: {flow}" for flow, r in ranks.items())
    return (
        f"{what}: the ranks were not called alike ({each}); every rank must pass the same {alike}"
    )


def agree_on_errors(
    error: Optional[BaseException],
    what: str,
    group: Group = None,
    flow: Optional[str] = None,
    alike: str = "arguments",
) -> None:
    """Collective: raises on every rank (see `raise_on_reported_errors`) if `error` (this
    rank's failure in step `what`, or None) is set on any rank; with `flow`, also (a
    `CheckpointingException` naming each rank's) when ranks' flows differ."""
    if not is_distributed():
        failed, differ = error is not None, False
    elif flow is None:
        failed, differ = bool(all_reduce_max([int(error is not None)], group)[0]), False
    else:
        failed, differ = failed_or_flows_differ(error is not None, flow, group)
    if failed:
        raise_on_reported_errors(all_gather_object(error_report(error), group), error, what)
    if differ:  # rare: who does what is gathered only then
        raise_flows_differ(what, flow or "", alike, group)


def run_collectively(
    what: str,
    fn: Callable[..., T],
    *args: Any,
    group: Group = None,
    flow: Optional[str] = None,
    alike: str = "arguments",
) -> T:
    """Collective: returns `fn(*args)`, or raises on every rank when it raised on any (or,
    with `flow`, when ranks' flows differ: see `agree_on_errors`)."""
    result: Any = None
    error: Optional[BaseException] = None
    try:
        result = fn(*args)
    except Exception as e:  # translated and re-raised on every rank below
        error = e
    agree_on_errors(error, what, group, flow, alike)
    return result


def log_rank0(log: logging.Logger, level: int, msg: str, *args: Any) -> None:
    """Logs on rank 0 only (every rank when there is no process group)."""
    if get_rank() == 0:
        log.log(level, msg, *args)
