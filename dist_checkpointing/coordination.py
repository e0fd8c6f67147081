"""Coordination written once, run on a process group or simulated for thousands of ranks.

A protocol is a generator: it yields collective operations (`AllReduceSum`, `AllToAll`,
`Gather`, `Broadcast`), receives each one's result, and returns its own result. `run`
executes one on `torch.distributed` (collective: call on all ranks, in the same order);
`simulate` runs one generator per simulated rank in this process, in lockstep, measuring
each rank's traffic and CPU time: the same code runs in real jobs and in
`benchmarks/bench_scale.py`.

No operation makes a rank receive data proportional to world x tensors: sums are reduced,
and `AllToAll` delivers to each rank only what is addressed to it (plus one 8-byte size per
peer, as any all-to-all must).
"""

from __future__ import annotations

import gc
import hashlib
import io
import pickle
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Generator, List, Mapping, Sequence, Tuple, Type, TypeVar

import torch
import torch.distributed as dist

from . import _dist

__all__ = [
    "AllReduceSum",
    "AllToAll",
    "Broadcast",
    "Exchange",
    "Gather",
    "Protocol",
    "SimStats",
    "digest",
    "dumps",
    "fail_together",
    "loads",
    "owner",
    "run",
    "simulate",
]

T = TypeVar("T")


@dataclass(frozen=True)
class AllReduceSum:
    """Every rank gets the element-wise sum of every rank's `values` (ints, |v| < 2**62 / world)."""

    values: Tuple[int, ...]


@dataclass(frozen=True)
class AllToAll:
    """Every rank gets `{source rank: payload}` of the payloads addressed to it."""

    messages: Mapping[int, bytes]


@dataclass(frozen=True)
class Gather:
    """`root` gets every rank's `data` (a list indexed by rank); the others get None."""

    data: bytes
    root: int = 0


@dataclass(frozen=True)
class Broadcast:
    """Every rank gets `root`'s `data` (the others' is ignored)."""

    data: bytes
    root: int = 0


Op = Any  # one of the four operations above
Protocol = Generator[Op, Any, T]


def run(protocol: Protocol[T], group: Any = None) -> T:
    """Collective: call on all ranks. Runs `protocol` on the default (or given) group; without
    a process group, as the only rank."""
    try:
        op = next(protocol)
        while True:
            op = protocol.send(_execute(op, group))
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


def _execute(op: Op, group: Any) -> Any:
    if not _dist.is_distributed():  # the only rank: as simulated
        return _deliver([op], SimStats([0.0]))[0]
    if isinstance(op, Gather):
        return _dist.gather_object(op.data, op.root, group)
    if isinstance(op, Broadcast):
        return _dist.broadcast_object(op.data, op.root, group)
    g = _dist._group(group)  # gloo: our own group, whatever the default backend
    with _dist._collective(type(op).__name__):
        if isinstance(op, AllReduceSum):
            t = torch.tensor(op.values, dtype=torch.int64)
            dist.all_reduce(t, group=g)
            return tuple(int(v) for v in t.tolist())
        if isinstance(op, AllToAll):
            return _all_to_all(op.messages, g)
    raise TypeError(f"not a coordination operation: {op!r}")


def _all_to_all(messages: Mapping[int, bytes], group: Any) -> Dict[int, bytes]:
    world = dist.get_world_size(group)
    sizes = torch.zeros(world, dtype=torch.int64)
    for dest, payload in messages.items():
        sizes[dest] = len(payload)
    recv_sizes = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(recv_sizes, sizes, group=group)
    send = b"".join(messages.get(r, b"") for r in range(world))
    out = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8)
    inp = torch.frombuffer(bytearray(send), dtype=torch.uint8) if send else out[:0]
    dist.all_to_all_single(out, inp, recv_sizes.tolist(), sizes.tolist(), group=group)
    data = out.numpy().tobytes()
    got: Dict[int, bytes] = {}
    pos = 0
    for src, n in enumerate(recv_sizes.tolist()):
        if n:
            got[src] = data[pos : pos + n]
            pos += n
    return got


@dataclass
class Exchange:
    """One simulated exchange: what the rank that received most got, and the total."""

    op: str
    max_recv_bytes: int
    max_recv_messages: int
    total_bytes: int


@dataclass
class SimStats:
    """What `simulate` measured: each rank's CPU seconds, and every exchange."""

    cpu_s: List[float]
    exchanges: List[Exchange] = field(default_factory=list)

    @property
    def max_recv_bytes(self) -> int:
        """The most any rank received in any one exchange."""
        return max((e.max_recv_bytes for e in self.exchanges), default=0)


def simulate(
    protocols: Sequence[Protocol[Any]], *, return_exceptions: bool = False
) -> Tuple[List[Any], SimStats]:
    """Runs one protocol per simulated rank (rank = position) in lockstep, in this process.

    Args:
        protocols: one started-or-not generator per rank.
        return_exceptions: put what a rank's protocol raised in its result instead of raising.

    Returns:
        Every rank's result, and the statistics (`SimStats`).

    Raises:
        RuntimeError: ranks yielded different operations, or some finished before others
            (a real job would hang there).
        Exception: what the first rank (by rank) raised, unless `return_exceptions`.
    """
    # one process holds every simulated rank's objects: a collection of all of them would be
    # charged to whichever rank happened to allocate (a real rank holds only its own)
    collecting = gc.isenabled()
    gc.disable()
    n = len(protocols)
    stats = SimStats([0.0] * n)
    results: List[Any] = [None] * n
    inbox: List[Any] = [None] * n
    first = True
    try:
        while True:
            ops: List[Any] = []
            for r, proto in enumerate(protocols):
                start = time.process_time()
                try:
                    ops.append(next(proto) if first else proto.send(inbox[r]))
                except StopIteration as stop:
                    results[r] = stop.value
                    ops.append(None)
                except Exception as e:
                    if not return_exceptions:
                        raise
                    results[r] = e
                    ops.append(None)
                finally:
                    stats.cpu_s[r] += time.process_time() - start
            first = False
            finished = sum(op is None for op in ops)
            if finished == n:
                return results, stats
            if finished or len({type(op) for op in ops}) != 1:
                kinds = sorted({type(o).__name__ for o in ops})
                raise RuntimeError(f"simulated ranks diverged (a real job would hang): {kinds}")
            inbox = _deliver(ops, stats)
    finally:
        if collecting:
            gc.enable()


def _deliver(ops: List[Any], stats: SimStats) -> List[Any]:
    n = len(ops)
    kind = type(ops[0])
    recv = [0] * n
    msgs = [0] * n
    if kind is AllReduceSum:
        width = len(ops[0].values)
        total = tuple(sum(op.values[i] for op in ops) for i in range(width))
        out: List[Any] = [total] * n
        recv = [8 * width] * n
        msgs = [1] * n
    elif kind is AllToAll:
        out = [{} for _ in range(n)]
        for src, op in enumerate(ops):
            for dest, payload in op.messages.items():
                out[dest][src] = payload
                recv[dest] += len(payload)
                msgs[dest] += 1
        recv = [b + 8 * n for b in recv]  # every rank receives every peer's size
    elif kind is Gather:
        root = ops[0].root
        out = [None] * n
        out[root] = [op.data for op in ops]
        recv[root] = sum(len(op.data) for op in ops)
        msgs[root] = n
    elif kind is Broadcast:
        data = ops[ops[0].root].data
        out = [data] * n
        recv = [len(data)] * n
        msgs = [1] * n
    else:
        raise TypeError(f"not a coordination operation: {ops[0]!r}")
    stats.exchanges.append(Exchange(kind.__name__, max(recv), max(msgs), sum(recv)))
    return out


def dumps(obj: Any) -> bytes:
    """Serialises plain data (tuples, lists, dicts, str, int, None) for a message."""
    return pickle.dumps(obj, protocol=5)


def loads(data: bytes) -> Any:
    """The inverse of `dumps` for messages this module's protocols sent (plain data only)."""
    return _PlainUnpickler(io.BytesIO(data)).load()


def digest(obj: Any) -> bytes:
    """A 16-byte digest of plain data (as `dumps` serialises it)."""
    return hashlib.blake2b(dumps(obj), digest_size=16).digest()


class _PlainUnpickler(pickle.Unpickler):
    """Refuses every global: messages carry plain data, never code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"coordination messages carry no globals ({module}.{name})")


def owner(name: str, ranks: Sequence[int]) -> int:
    """The rank of `ranks` that handles `name` (a hash: the same in every process)."""
    return ranks[zlib.crc32(name.encode()) % len(ranks)]


def fail_together(
    problems: Sequence[str],
    message: Callable[[List[str], int], str],
    error: Type[Exception],
    *,
    lanes: Tuple[int, ...] = (),
    sent: int = 20,
) -> Protocol[Tuple[int, ...]]:
    """Raises `error(message(problems, count))` on every rank if any rank has problems (each
    sends rank 0 at most `sent`, which rank 0 formats for all); else returns the sums of
    `lanes` over ranks, carried by the same reduction."""
    count, *sums = yield AllReduceSum((len(problems), *lanes))
    if count:
        gathered = yield Gather(dumps(list(problems[:sent])))
        text = "" if gathered is None else message([p for g in gathered for p in loads(g)], count)
        text = yield Broadcast(dumps(text))
        raise error(loads(text))
    return tuple(sums)
