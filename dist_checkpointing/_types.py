"""Type aliases shared across the package, declared once."""

from __future__ import annotations

from typing import Any, Dict, Tuple, Union

__all__ = ["ReplicaId", "StateDict", "ShardedStateDict", "CommonStateDict"]

#: Which copy of a shard this is: 0 (or all zeros) marks the main replica that is saved.
ReplicaId = Union[int, Tuple[int, ...]]
#: A nested dict/list of plain values and tensors.
StateDict = Dict[str, Any]
#: A nested dict/list whose leaves may be ShardedTensor / ShardedObject / factories.
ShardedStateDict = Dict[str, Any]
#: The non-sharded part of a state dict, written once by rank 0.
CommonStateDict = Dict[str, Any]
