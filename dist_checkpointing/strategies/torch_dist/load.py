"""Loading with the torch_dist backend, in any requested sharding: each rank reads the
metadata of the keys it asks for (the load index), plans reads for exactly its regions
(`plan`) and reads each needed chunk once (`reader`)."""

from __future__ import annotations

import io
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from ..._dist import agree_on_errors, gather_object, get_rank
from ..._progress import byte_progress
from ..._safe_load import torch_load
from ..._types import ShardedStateDict, StateDict
from ...dict_utils import dict_list_map_inplace, nested_values
from ...dtypes import check_dtype_conversion, copy_exact
from ...errors import (
    CheckpointCorruptedError,
    CheckpointingException,
    LossyDtypeConversionError,
    close_matches,
)
from ...integrity import Checksums, read_checksums
from ...mapping import ShardedBase, ShardedObject, ShardedTensor
from ...quantized import block_hint, stored_form_hint
from ..base import CheckpointDir, LoadShardedStrategy, require_backend, require_version
from .finalize import gbps
from .legacy_flat import FlatCopy, apply_copies, plan_reformulated_reads, reformulated_shapes
from .metadata_file import open_for_load, plain_value_keys, read_metadata, remove_sharded_tensors
from .plan import BACKEND, SUPPORTED_VERSIONS, ChunkIndex, TensorRequest, plan_tensor_reads
from .reader import read_byte_items, read_tensor_items

__all__ = ["TorchDistLoadShardedStrategy"]

logger = logging.getLogger(__name__)


@dataclass
class _Plan:
    """One rank's planned load (`_plan`), read by `_read`."""

    start: float
    metadata: Metadata
    checksums: Optional[Checksums]
    dests: List[torch.Tensor]
    reads: List[ReadItem]
    objects: List[ShardedObject]
    copies: List[FlatCopy]
    #: (key, destination, stored-dtype staging, global offset) of conversions checked by value
    exact: List[Tuple[str, torch.Tensor, torch.Tensor, Tuple[int, ...]]]


#: what one rank read: bytes (tensor data and objects), seconds, and how many files (a
#: count, not names: the exchange that carries it stays small whatever the world)
_LoadStats = Tuple[int, float, int]


def _check_plain_items(ckpt: Path, checksums: Checksums) -> None:
    """Reads and verifies the plain values our saves record for stock DCP readers (rank 0
    wrote them; a load takes the common state from `common.pt`): a data file holding only
    them, swapped for another checkpoint's, is caught at load as any other file is.

    Raises:
        CheckpointCorruptedError: an item (or its file's sidecar) is not this checkpoint's.
    """
    full = read_metadata(ckpt, checksums)
    plain = plain_value_keys(ckpt, full)
    if plain:
        read_byte_items(ckpt, full, [i for i in full.storage_data if i.fqn in plain], checksums)


def _log_load(ckpt: Path, stats: List[_LoadStats]) -> None:
    """Rank 0: one INFO line for the whole load (bytes summed, time the slowest rank's)."""
    if not stats:
        return
    total, slowest = sum(s[0] for s in stats), max(s[1] for s in stats)
    msg = "torch_dist load %s: %.3f GB (%d bytes) read by %d rank(s) from %d file(s) per rank "
    msg += "at most in %.2f s (slowest rank), %.2f GB/s; most by one rank %.3f GB"
    files, most = max(s[2] for s in stats), max(s[0] for s in stats) / 1e9
    rate = gbps(total, slowest)
    logger.info(msg, ckpt, total / 1e9, total, len(stats), files, slowest, rate, most)


class TorchDistLoadShardedStrategy(LoadShardedStrategy):
    """Loads checkpoints in PyTorch DCP's format, resharding to the requested layout.

    Args:
        weights_only: keep True (the default) to refuse arbitrary pickled ShardedObjects;
            set False only for trusted checkpoints.
        thread_count: data files read in parallel (each front to back by one thread; to
            read each byte once per job when resharding, wrap the strategy in
            `FullyParallelLoadStrategyWrapper`).
        verify_checksums: verify everything read against the checkpoint's checksums when
            it has them (a mismatch raises `CheckpointCorruptedError`).
        allow_lossy_dtype_conversion: load into a dtype that does not hold some stored
            value (float -> int, float32 -> bfloat16, ...) with a warning, instead of
            raising `LossyDtypeConversionError` (see `dist_checkpointing.dtypes`).

    Raises:
        CheckpointingException: `thread_count` < 1.
    """

    can_handle_sharded_objects = True

    def __init__(
        self,
        weights_only: bool = True,
        thread_count: int = 2,
        verify_checksums: bool = True,
        allow_lossy_dtype_conversion: bool = False,
    ) -> None:
        if thread_count < 1:
            raise CheckpointingException(f"thread_count must be >= 1, got {thread_count}")
        self.weights_only = weights_only
        self.thread_count = thread_count
        self.verify_checksums = verify_checksums
        self.allow_lossy_dtype_conversion = allow_lossy_dtype_conversion

    def _checksums(self, ckpt: Path) -> Optional[Checksums]:
        return read_checksums(ckpt) if self.verify_checksums else None

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        require_backend(self, BACKEND, loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        require_version(self, BACKEND, SUPPORTED_VERSIONS, loaded_version)

    def load(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir
    ) -> StateDict:
        """Collective: fills every requested shard from the checkpoint (ShardedTensors without
        data are allocated on the CPU; a global shape other than the stored one must be
        allowed by the tensor).

        Returns:
            `sharded_state_dict` with every ShardedTensor/ShardedObject replaced by its data.

        Raises:
            CheckpointingException: on every rank, if any rank's load failed.
        """
        ckpt = Path(checkpoint_dir)
        result: Optional[StateDict] = None
        stats: Optional[_LoadStats] = None
        error: Optional[BaseException] = None
        try:
            plan = self._plan(sharded_state_dict, ckpt)
            result, stats = self._read(sharded_state_dict, ckpt, plan)
        except Exception as e:  # agreed on below, with the other ranks' statistics
            error = e
        agree_on_errors(error, f"torch_dist load from {ckpt}")
        gathered = gather_object(stats)  # for rank 0's log line: no rank gets everyone's
        if gathered is not None:
            _log_load(ckpt, [s for s in gathered if s is not None])
        assert result is not None
        return result

    def _plan(self, sharded_state_dict: ShardedStateDict, ckpt: Path) -> _Plan:
        """This rank's reads, destinations and objects (no data read yet)."""
        start = time.perf_counter()
        checksums = self._checksums(ckpt)
        shards = [sh for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedBase)]
        keys = {sh.unique_key if isinstance(sh, ShardedObject) else sh.key for sh in shards}
        boxes: Dict[str, List[Tuple[Tuple[int, ...], Tuple[int, ...]]]] = {}
        for sh in shards:
            if isinstance(sh, ShardedTensor):
                box = (tuple(sh.global_offset), tuple(sh.prepended_local_shape))
                boxes.setdefault(sh.key, []).append(box)
        for sh in shards:  # a request past the stored shape needs the key's every chunk
            if isinstance(sh, ShardedTensor) and sh.allow_shape_mismatch:
                boxes.pop(sh.key, None)
        metadata = open_for_load(ckpt, keys, checksums, boxes)
        if checksums is not None and get_rank() == 0:
            _check_plain_items(ckpt, checksums)
        sdm: Dict[str, Any] = metadata.state_dict_metadata
        flat_layout = reformulated_shapes(metadata)  # megatron <= 0.13 flat tensors
        dests: List[torch.Tensor] = []
        indices: Dict[str, ChunkIndex] = {}
        reads: List[ReadItem] = []
        objects: List[ShardedObject] = []
        copies: List[FlatCopy] = []
        exact: List[Tuple[str, torch.Tensor, torch.Tensor, Tuple[int, ...]]] = []
        for sh in shards:
            if isinstance(sh, ShardedTensor):
                flat_shape = flat_layout.get(sh.key)
                stored = self._check_tensor(sh, sdm, ckpt, flat_shape)
                md, offset = sdm[sh.key], sh.global_offset
                request = TensorRequest(sh.key, len(dests), offset, sh.prepended_local_shape)
                if flat_shape is not None:
                    if stored is not None:
                        raise LossyDtypeConversionError(
                            f"{sh.key!r} is stored flat (megatron-core <= 0.13) as {stored}: "
                            f"request that dtype, not {sh.dtype}, or allow_lossy_dtype_conversion"
                        )
                    dests.append(self._destination(sh))
                    flat_reads, flat_copies = plan_reformulated_reads(
                        request, md, flat_shape, sh.dtype, sh.allow_shape_mismatch
                    )
                    reads += flat_reads
                    dests += [c.temp.view(r.lengths) for c, r in zip(flat_copies, flat_reads)]
                    copies += flat_copies
                    continue
                if sh.key not in indices:
                    indices[sh.key] = ChunkIndex(md)
                reads += plan_tensor_reads(request, md, sh.allow_shape_mismatch, indices[sh.key])
                dests.append(self._destination(sh))
                if stored is not None:  # read as stored, converted value by value in `_read`
                    stage = torch.zeros(dests[-1].shape, dtype=stored)
                    exact.append((sh.key, dests[-1], stage, tuple(offset)))
                    dests[-1] = stage
            elif isinstance(sh, ShardedObject):
                if not isinstance(sdm.get(sh.unique_key), BytesStorageMetadata):
                    raise CheckpointingException(
                        f"ShardedObject {sh.unique_key!r} is not in checkpoint {ckpt}"
                    )
                objects.append(sh)
            else:
                raise CheckpointingException(
                    f"{self} cannot load {type(sh).__name__} {sh.key!r}; apply factories first"
                )
        return _Plan(start, metadata, checksums, dests, reads, objects, copies, exact)

    def _read(
        self, sharded_state_dict: ShardedStateDict, ckpt: Path, plan: _Plan
    ) -> Tuple[StateDict, _LoadStats]:
        metadata, checksums, dests, reads = plan.metadata, plan.checksums, plan.dests, plan.reads

        def resolve(r: ReadItem) -> torch.Tensor:
            view = dests[r.dest_index.index]  # type: ignore[index]
            for dim, (o, n) in enumerate(zip(r.dest_offsets, r.lengths)):
                view = view.narrow(dim, o, n)
            return view

        sizes = [dests[r.dest_index.index].element_size() for r in reads]  # type: ignore[index]
        planned = sum(int(math.prod(r.lengths)) * size for r, size in zip(reads, sizes))
        with byte_progress(f"load {ckpt.name}", planned) as progress:
            nbytes = read_tensor_items(
                ckpt, metadata, reads, resolve, self.thread_count, checksums, progress
            )
        apply_copies(plan.copies, dests)
        for key, dest, stage, offset in plan.exact:
            copy_exact(key, dest, stage, offset)
        indices = [MetadataIndex(o.unique_key) for o in plan.objects]
        raw = read_byte_items(ckpt, metadata, indices, checksums)
        where = [*(r.storage_index for r in reads), *indices]  # every one was read from
        files = {str(metadata.storage_data[i].relative_path) for i in where}
        loaded_objects: Dict[int, Any] = {}
        for o, data in zip(plan.objects, raw):
            value = torch_load(
                io.BytesIO(data), f"ShardedObject {o.unique_key!r} in {ckpt}", self.weights_only
            )
            if not isinstance(value, list) or len(value) != 1:
                raise CheckpointCorruptedError(
                    f"ShardedObject {o.unique_key!r} in {ckpt}: expected a one-element list"
                )
            loaded_objects[id(o)] = value[0]
            nbytes += len(data)
        seconds = time.perf_counter() - plan.start
        msg = "rank %d loaded %.3f GB from %s in %.2f s (%.2f GB/s)"
        rate = gbps(nbytes, seconds)
        logger.debug(msg, get_rank(), nbytes / 1e9, ckpt, seconds, rate)

        def unwrap(x: Any) -> Any:
            if isinstance(x, ShardedTensor):
                assert x.data is not None
                return x.data
            if isinstance(x, ShardedObject):
                return loaded_objects[id(x)]
            return x

        return dict_list_map_inplace(unwrap, sharded_state_dict), (nbytes, seconds, len(files))

    @staticmethod
    def _destination(sh: ShardedTensor) -> torch.Tensor:
        if sh.data is None or sh.data.device.type == "meta":
            sh.data = torch.empty(sh.local_shape, dtype=sh.dtype, device="cpu")
        if sh.allow_shape_mismatch:
            # as megatron-core: what the checkpoint does not cover (past the stored end of a
            # larger requested shape) is zeros, never the destination's previous values
            sh.data.zero_()
        view = sh.data
        for _ in range(sh.prepend_axis_num):
            view = view.unsqueeze(0)
        return view

    def _check_tensor(
        self, sh: ShardedTensor, sdm: Dict[str, Any], ckpt: Path, shape: Optional[Tuple[int, ...]]
    ) -> Optional[torch.dtype]:
        """Raises unless `sh.key` is a stored tensor of `shape` (None: its stored size);
        its stored dtype when that converts to `sh.dtype` only value by value (`copy_exact`)."""
        stored = sdm.get(sh.key)
        if not isinstance(stored, TensorStorageMetadata):
            names = [k for k, v in sdm.items() if isinstance(v, TensorStorageMetadata)]
            raise CheckpointingException(
                f"Tensor {sh.key!r} is not in the checkpoint"
                + (stored_form_hint(sh.key, names) or close_matches(sh.key, names))
                if stored is None  # else a plain value or object of that name
                else f"{sh.key!r} is stored as a plain value or object, not as a tensor: "
                "request it as a plain value (or a ShardedObject)"
            )
        shape = tuple(stored.size) if shape is None else shape
        if shape != sh.global_shape and not sh.allow_shape_mismatch:
            raise CheckpointingException(
                f"Global shape mismatch for {sh.key!r}: checkpoint has {shape}, "
                f"requested {sh.global_shape}"
                + block_hint(sh.key, shape, sh.global_shape, lambda: read_metadata(ckpt))
            )
        dtype, lossy_ok = stored.properties.dtype, self.allow_lossy_dtype_conversion
        return dtype if check_dtype_conversion(sh.key, dtype, sh.dtype, lossy_ok) else None

    def load_tensors_metadata(
        self, checkpoint_dir: CheckpointDir, metadata: Optional[Metadata] = None
    ) -> ShardedStateDict:
        """Returns `{key: ShardedTensor}` of the stored tensors: whole, metadata only."""
        ckpt = Path(checkpoint_dir)
        if metadata is None:
            metadata = read_metadata(ckpt, self._checksums(ckpt))
        out: ShardedStateDict = {}
        flat_layout = reformulated_shapes(metadata)
        plain = plain_value_keys(ckpt, metadata)
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata) and key not in plain:
                # megatron <= 0.13 flat tensors: their original (unflattened) shape
                shape = flat_layout.get(key, tuple(md.size))
                zeros, ones = (0,) * len(shape), (1,) * len(shape)
                out[key] = ShardedTensor(key, None, md.properties.dtype, shape, shape, zeros, ones)
        return out

    def load_sharded_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        """Returns stored tensors (by key) and ShardedObjects (by unique key), metadata only."""
        ckpt = Path(checkpoint_dir)
        metadata = read_metadata(ckpt, self._checksums(ckpt))
        out: ShardedStateDict = {}
        plain = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata) and key not in plain:  # else a plain value
                try:
                    sh_obj = ShardedObject.empty_from_unique_key(key)
                except CheckpointingException:
                    msg = "Bytes entry %r of %s is not a ShardedObject; not listed"
                    logger.warning(msg, key, checkpoint_dir)
                    continue
                out[sh_obj.unique_key] = sh_obj
        out.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return out

    def remove_sharded_tensors(self, checkpoint_dir: CheckpointDir, key_prefix: str) -> None:
        """Drops the keys starting with `key_prefix` and their data files; not collective (see
        `metadata_file.remove_sharded_tensors`, which says what it raises)."""
        remove_sharded_tensors(Path(checkpoint_dir), key_prefix)
