"""Coordination written once, run on a process group or simulated for thousands of ranks.

A protocol is a generator: it yields collective operations (`AllReduceSum`, `AllToAll`,
`Gather`, `Broadcast`), receives each one's result, and returns its own result. `run`
executes one on `torch.distributed` (collective: call on all ranks, in the same order);
`deliver` gives every rank's result of one operation from all ranks' requests, so a test or
`benchmarks/bench_scale.py` can run one generator per simulated rank in lockstep
(`tests/_simulate.py`): the same code as in real jobs.

No operation makes a rank receive data proportional to world x tensors: sums are reduced,
and `AllToAll` delivers to each rank only what is addressed to it (plus one 8-byte size per
peer, as any all-to-all must).
"""

from __future__ import annotations

import hashlib
import io
import pickle
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Generator, List, Mapping, Sequence, Tuple, Type, TypeVar

import torch
import torch.distributed as dist

from . import _dist

__all__ = [
    "AllReduceSum",
    "AllToAll",
    "Broadcast",
    "Gather",
    "Protocol",
    "deliver",
    "digest",
    "dumps",
    "fail_together",
    "loads",
    "owner",
    "run",
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
    if not _dist.is_distributed():  # the only rank
        return deliver([op])[0]
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


def deliver(ops: Sequence[Op]) -> List[Any]:
    """What each rank receives when rank i issues `ops[i]` (all of one kind): the semantics
    `run` gives a lone rank and a simulation of many ranks (tests, `bench_scale`) gives all."""
    n, kind = len(ops), type(ops[0])
    if kind is AllReduceSum:
        return [tuple(map(sum, zip(*(op.values for op in ops))))] * n
    if kind is AllToAll:
        out: List[Dict[int, bytes]] = [{} for _ in range(n)]
        for src, op in enumerate(ops):
            for dest, payload in op.messages.items():
                out[dest][src] = payload
        return out
    if kind is Gather:
        return [[op.data for op in ops] if r == ops[0].root else None for r in range(n)]
    if kind is Broadcast:
        return [ops[ops[0].root].data] * n
    raise TypeError(f"not a coordination operation: {ops[0]!r}")


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
