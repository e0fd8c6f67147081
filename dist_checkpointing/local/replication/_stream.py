"""The streamed replication exchange: images sent from their own memory, written as they arrive.

Receivers write each message through a small window of pooled page-aligned buffers; one that
cannot write keeps draining until the peer's last message, then raises (no sender hangs).
"""

from __future__ import annotations

import concurrent.futures
import mmap
import threading
from collections import deque
from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ...storage import ALIGN

__all__ = ["ImageSink", "pack_messages", "stream_exchange", "wait_all"]

CHUNK = 64 << 20
#: pieces smaller than this are packed with their neighbours into one message
SMALL = 1 << 20
#: chunk buffers per peer being received (posted receives in flight)
WINDOW = 4

_free: List[np.ndarray] = []
_lock = threading.Lock()


def _buffers(n: int) -> List[np.ndarray]:
    """`n` page-aligned receive buffers of `CHUNK + ALIGN` bytes, reused across saves."""
    with _lock:
        got = [_free.pop() for _ in range(min(n, len(_free)))]
    return got + [
        np.frombuffer(mmap.mmap(-1, CHUNK + ALIGN), dtype=np.uint8) for _ in range(n - len(got))
    ]


def _give_back(bufs: List[np.ndarray]) -> None:
    with _lock:
        _free.extend(bufs[: max(0, 2 * WINDOW - len(_free))])


def wait_all(works: List[Any]) -> None:
    """Waits for every posted send or receive (None entries: nothing was posted)."""
    for w in works:
        if w is not None:
            w.wait()


CkptID = Tuple[Any, ...]


class ImageSink(Protocol):
    """Where a received image goes (e.g. its dirty file)."""

    def write(self, data: np.ndarray, offset: int) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


#: opens the sink of a received image: (its id, its size in bytes) -> sink
OpenSink = Callable[[CkptID, int], ImageSink]


def pack_messages(segments: Sequence[np.ndarray], chunk: int = CHUNK) -> List[np.ndarray]:
    """Cuts the concatenation of `segments` into messages of at most `chunk` bytes: pieces
    of `SMALL` bytes or more as views (no copy), runs of smaller ones packed into one."""
    out: List[np.ndarray] = []
    pack: List[np.ndarray] = []
    packed = 0

    def flush() -> None:
        nonlocal packed
        if pack:
            out.append(np.concatenate(pack) if len(pack) > 1 else pack[0])
            pack.clear()
            packed = 0

    for seg in segments:
        for lo in range(0, int(seg.size), chunk):
            piece = seg[lo : lo + chunk]
            if piece.size >= SMALL:
                flush()
                out.append(piece)
            else:
                if packed + piece.size > chunk:
                    flush()
                pack.append(piece)
                packed += int(piece.size)
    flush()
    return out


def _receive(
    group: Any, peer: int, id_: CkptID, lengths: List[int], open_sink: OpenSink
) -> Tuple[CkptID, int]:
    """Receives one peer's messages through a window of chunk buffers, writing each on arrival."""
    total = sum(lengths)
    offsets = np.cumsum([0, *lengths[:-1]]).tolist() if lengths else []
    error: Optional[BaseException] = None
    sink: Optional[ImageSink] = None
    try:
        sink = open_sink(id_, total)
    except Exception as e:  # drained below, raised at the end
        error = e
    bufs = _buffers(min(WINDOW, len(lengths)))
    window: deque = deque()

    def chunk(k: int) -> np.ndarray:
        lead = offsets[k] % ALIGN
        return bufs[k % len(bufs)][lead : lead + lengths[k]]

    def post(k: int) -> None:
        window.append(dist.irecv(torch.from_numpy(chunk(k)), src=peer, group=group, tag=k))

    try:
        for k in range(len(bufs)):
            post(k)
        for k in range(len(lengths)):
            window.popleft().wait()
            if error is None:
                assert sink is not None
                try:
                    sink.write(chunk(k), offsets[k])
                except Exception as e:  # keep draining: the peer's sends must complete
                    error = e
            if k + len(bufs) < len(lengths):  # its buffer is free again
                post(k + len(bufs))
        if sink is not None and error is None:
            sink.close()
            sink = None
    finally:
        if sink is not None:
            sink.abort()
        _give_back(bufs)
    if error is not None:
        raise error
    return id_, total


def stream_exchange(
    group: Any,
    ranks: Sequence[int],
    id_: CkptID,
    segments: Sequence[np.ndarray],
    open_sink: OpenSink,
) -> List[Tuple[CkptID, int]]:
    """Collective over `group` (gloo over `ranks`): every member's image to every other member.

    Returns `(id, nbytes)` of each image received and written (by `open_sink`), in `ranks`
    order; raises what opening or writing one raised, after every message arrived."""
    messages = pack_messages(segments)
    infos: List[Any] = [None] * len(ranks)
    dist.all_gather_object(infos, (tuple(id_), [int(m.size) for m in messages]), group=group)
    peers = [(p, info) for p, info in zip(ranks, infos) if p != dist.get_rank()]
    sends = [
        dist.isend(torch.from_numpy(m), dst=peer, group=group, tag=k)
        for peer, _ in peers
        for k, m in enumerate(messages)
    ]
    try:
        with concurrent.futures.ThreadPoolExecutor(len(peers), "dc-local-recv") as pool:
            futures = [
                pool.submit(_receive, group, peer, tuple(other), lengths, open_sink)
                for peer, (other, lengths) in peers
            ]
        return [f.result() for f in futures]  # after every receive finished (the pool waited)
    finally:
        wait_all(sends)
