"""Functions run on every rank of a test world (module-level so they can be sent)."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing.mapping import ShardedTensor
from tests._sharding import Box, Case, bitwise_equal, make_global


def rank() -> int:
    return dist.get_rank()


def shard_of(case: Case, box: Box, global_tensor: Optional[torch.Tensor]) -> ShardedTensor:
    offset, size, replica = box[:3]
    flat = box[3] if len(box) > 3 else None
    local_shape = size[case.prepend_axis_num :]
    if global_tensor is None:
        data = (
            torch.full(local_shape, 0, dtype=case.dtype)
            if case.dtype != torch.bool
            else torch.zeros(local_shape, dtype=torch.bool)
        )
    else:
        index = tuple(slice(o, o + s) for o, s in zip(offset, size))
        data = global_tensor[index].clone().reshape(local_shape)
    if flat is not None:  # a flat shard: that range of the flattened box
        data = data.flatten()[flat[0] : flat[1]].clone()
    return ShardedTensor(
        case.key,
        data,
        case.dtype,
        local_shape,
        case.global_shape,
        offset,
        None,
        replica,
        case.prepend_axis_num,
        False,
        slice(*flat) if flat is not None else None,
    )


def state_for(cases: List[Case], which: str, with_data: bool) -> Dict[str, Any]:
    r = rank()
    sd: Dict[str, Any] = {}
    for i, case in enumerate(cases):
        g = make_global(case) if with_data else None
        boxes = getattr(case, which)[r]
        sd[f"case{i}"] = [shard_of(case, b, g) for b in boxes]
    return sd


def save_cases(cases: List[Case], root: str) -> None:
    """Saves every case with its `save` sharding into one checkpoint under `root`."""
    dc.save(
        {**state_for(cases, "save", True), "common": {"n": len(cases)}}, os.path.join(root, "ckpt")
    )


def check_load_cases(cases: List[Case], root: str) -> List[str]:
    """Loads every case with its `load` sharding and compares bitwise with the global tensor.

    Returns a list of problems (empty on success).
    """
    ckpt = os.path.join(root, "ckpt")
    loaded = dc.load(state_for(cases, "load", False), ckpt)
    problems = []
    if loaded.get("common") != {"n": len(cases)}:
        problems.append(f"common state {loaded.get('common')!r}")
    r = rank()
    for i, case in enumerate(cases):
        g = make_global(case)
        for box, got in zip(case.load[r], loaded.get(f"case{i}", []), strict=True):
            offset, size = box[:2]
            want = g[tuple(slice(o, o + s) for o, s in zip(offset, size))].reshape(
                size[case.prepend_axis_num :]
            )
            if len(box) > 3:
                want = want.flatten()[box[3][0] : box[3][1]]
            if not bitwise_equal(got, want):
                problems.append(f"rank {r} case {i} box {box}: loaded data differs")
    meta = dc.load_sharded_metadata(ckpt)
    tmeta = dc.load_tensors_metadata(ckpt)
    for case in cases:
        for md in (meta, tmeta):
            sh = md.get(case.key)
            if sh is None or sh.global_shape != case.global_shape or sh.dtype != case.dtype:
                problems.append(f"metadata of {case.key}: {sh}")
    return problems


def roundtrip_cases(cases: List[Case], root: str) -> List[str]:
    """`save_cases` then `check_load_cases` in the same world."""
    save_cases(cases, root)
    return check_load_cases(cases, root)


def call_save(
    builder: Callable[[], Dict[str, Any]], ckpt: str, kwargs: Optional[Dict[str, Any]] = None
) -> None:
    """dc.save(builder(), ckpt, **kwargs) on this rank."""
    dc.save(builder(), ckpt, **(kwargs or {}))


def call_load(
    builder: Callable[[], Dict[str, Any]], ckpt: str, kwargs: Optional[Dict[str, Any]] = None
) -> Any:
    """dc.load(builder(), ckpt, **kwargs) on this rank."""
    return dc.load(builder(), ckpt, **(kwargs or {}))


def load_with_fixed_probe(
    builder: Callable[[], Dict[str, Any]], ckpt: str, direct_wins_on: List[int]
) -> Optional[bool]:
    """Loads with this rank's read-path probe stubbed (O_DIRECT faster in every pair on the
    ranks in `direct_wins_on`, slower elsewhere); returns the path kept for the data files:
    True for O_DIRECT."""
    from dist_checkpointing.storage import probe

    fast, slow = (0.1, 1.0), (1.0, 0.1)
    pair = fast if rank() in direct_wins_on else slow
    real = probe._measure
    probe._measure = lambda path, pairs=2, direct_first=True: probe.ReadProbe(
        pair[0] * pairs, pair[1] * pairs, 1, (pair,) * pairs
    )
    probe.forget_probes()
    try:
        dc.load(builder(), ckpt)
        dc.load(builder(), ckpt)  # a second load measures nothing new and keeps the same
        data = sorted(f for f in os.listdir(ckpt) if f.endswith(".distcp"))
        kept = probe.probe_result(os.path.join(ckpt, data[0]))
        # one pair per rank: with several ranks each probes one, all decide together
        assert kept is None or len(kept.pairs) == dist.get_world_size(), kept
        return None if kept is None else kept.prefer_direct
    finally:
        probe._measure = real
        probe.forget_probes()


def load_after_restart(
    builder: Callable[[], Dict[str, Any]], ckpt: str, record_dirs: List[str]
) -> Tuple[List[str], bool, bool, bool]:
    """Loads as a job does, then twice more as if restarted (this process's kept
    measurements forgotten), with the node's records in this rank's `record_dirs[rank]`
    (the second time emptied on rank 1 only: it measures anew). The probe is stubbed: the
    page cache wins every pair (a choice that O_DIRECT's default is not).

    Returns:
        `(the paths measured, the kept choice is O_DIRECT after each restart, whether the
        choice after the first restart came from a record)`.
    """
    from dist_checkpointing.storage import probe

    measured: List[str] = []

    def measure(path: str, pairs: int = 2, direct_first: bool = True) -> Any:
        measured.append("first" if not restarted else f"restart {len(restarted)}")
        return probe.ReadProbe(1.0 * pairs, 0.1 * pairs, 1, ((1.0, 0.1),) * pairs)

    restarted: List[int] = []
    real = probe._measure
    probe._measure = measure
    data = sorted(f for f in os.listdir(ckpt) if f.endswith(".distcp"))
    try:
        with _node_records(record_dirs):
            probe.forget_probes()
            dc.load(builder(), ckpt)
            restarted.append(1)
            probe.forget_probes()
            dc.load(builder(), ckpt)
            first = probe.probe_result(os.path.join(ckpt, data[0]))
            restarted.append(2)
            probe.forget_probes()
            _rank1_loses_its_records(record_dirs)
            dc.load(builder(), ckpt)
            second = probe.probe_result(os.path.join(ckpt, data[0]))
        assert first is not None and second is not None
        return measured, first.prefer_direct, second.prefer_direct, first.recorded
    finally:
        probe._measure = real
        probe.forget_probes()


@contextlib.contextmanager
def _node_records(record_dirs: List[str]) -> Iterator[None]:
    """The node's records kept in this rank's `record_dirs[rank]` meanwhile."""
    from dist_checkpointing.storage import records

    before = os.environ.get(records.ENV)
    os.environ[records.ENV] = record_dirs[rank()]
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(records.ENV, None)
        else:
            os.environ[records.ENV] = before


def _rank1_loses_its_records(record_dirs: List[str]) -> None:
    """Collective: rank 1's records are deleted (it measures anew), the others' kept."""
    dist.barrier()
    if rank() == 1:
        for name in os.listdir(record_dirs[1]):
            os.remove(os.path.join(record_dirs[1], name))
    dist.barrier()


def save_with_fixed_write_probe(
    builder: Callable[[], Dict[str, Any]], ckpt: str, buffered_wins_on: List[int]
) -> List[bool]:
    """Saves twice with this rank's write probe stubbed (buffered writes faster in every
    pair on the ranks in `buffered_wins_on`, slower elsewhere) and every save measured;
    returns how this rank opened its data files (True: O_DIRECT), both saves."""
    from dist_checkpointing.storage import direct as storage_direct
    from dist_checkpointing.storage import write_probe

    pair = (1.0, 0.1) if rank() in buffered_wins_on else (0.1, 1.0)
    saved = (write_probe._measure, write_probe.MIN_PROBED_SAVE, storage_direct.FileWriter.__init__)
    real_init = saved[2]
    opened: List[bool] = []

    def init(self: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, path, *args, **kwargs)
        if str(path).endswith(".distcp"):
            opened.append(self.direct)

    write_probe._measure = lambda d: write_probe.WriteProbe((pair, pair), 1 << 20)
    write_probe.MIN_PROBED_SAVE = 0
    storage_direct.FileWriter.__init__ = init  # type: ignore[method-assign]
    write_probe.forget_write_probes()
    try:
        for i in range(2):  # a second save measures nothing new and keeps the same
            dc.save(builder(), os.path.join(ckpt, str(i)))
        kept = write_probe.write_probe_result(ckpt)
        assert kept is not None and len(kept.pairs) == 2 * dist.get_world_size(), kept
        return opened
    finally:
        write_probe._measure, write_probe.MIN_PROBED_SAVE = saved[0], saved[1]
        storage_direct.FileWriter.__init__ = real_init  # type: ignore[method-assign]
        write_probe.forget_write_probes()


def save_after_restart(
    builder: Callable[[], Dict[str, Any]], ckpt: str, record_dirs: List[str]
) -> Tuple[List[str], List[bool], bool]:
    """Saves as a job does, then twice more as if restarted (this process's kept write
    measurements forgotten), with the node's records in this rank's `record_dirs[rank]`
    (the second time emptied on rank 1 only: it measures anew). The write probe is stubbed:
    the page cache wins every pair (a choice that O_DIRECT's default is not).

    Returns:
        `(the saves that measured, how each save opened its data files (True: O_DIRECT),
        whether the choice after the first restart came from a record)`.
    """
    from dist_checkpointing.storage import direct as storage_direct
    from dist_checkpointing.storage import write_probe

    measured: List[str] = []
    opened: List[bool] = []
    saves: List[int] = []

    def measure(directory: str) -> Any:
        measured.append(f"save {len(saves)}")
        return write_probe.WriteProbe(((1.0, 0.1),), 1 << 20)

    real_init = storage_direct.FileWriter.__init__

    def init(self: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, path, *args, **kwargs)
        if str(path).endswith(".distcp") and len(opened) == len(saves):
            opened.append(self.direct)  # the first data file of each save

    saved = (write_probe._measure, write_probe.MIN_PROBED_SAVE)
    write_probe._measure = measure
    write_probe.MIN_PROBED_SAVE = 0
    storage_direct.FileWriter.__init__ = init  # type: ignore[method-assign]
    try:
        with _node_records(record_dirs):
            write_probe.forget_write_probes()
            dc.save(builder(), os.path.join(ckpt, "0"))
            saves.append(0)
            write_probe.forget_write_probes()
            dc.save(builder(), os.path.join(ckpt, "1"))
            first = write_probe.write_probe_result(ckpt)
            saves.append(1)
            write_probe.forget_write_probes()
            _rank1_loses_its_records(record_dirs)
            dc.save(builder(), os.path.join(ckpt, "2"))
            saves.append(2)
        assert first is not None
        return measured, opened, first.recorded
    finally:
        write_probe._measure, write_probe.MIN_PROBED_SAVE = saved
        storage_direct.FileWriter.__init__ = real_init  # type: ignore[method-assign]
        write_probe.forget_write_probes()


def gather_objects_counting_exchanges(sizes_by_rank: List[int]) -> List[Any]:
    """`_dist.all_gather_object` of a payload of `sizes_by_rank[rank]` bytes (plus nested
    values), next to torch's own function on the same object; returns what each gave and
    how many `dist.all_gather` calls ours made."""
    from dist_checkpointing import _dist

    me = dist.get_rank()
    obj = {"rank": me, "blob": bytes([me % 251]) * sizes_by_rank[me], "nested": [me, None, 1.5]}
    calls = []
    real = dist.all_gather

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_gather = counting  # type: ignore[assignment]
    try:
        ours = _dist.all_gather_object(obj)
    finally:
        dist.all_gather = real  # type: ignore[assignment]
    theirs: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(theirs, obj)
    return [ours, theirs, len(calls)]
