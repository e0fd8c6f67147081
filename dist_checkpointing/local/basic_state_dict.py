"""`BasicTensorAwareStateDict`: a `TensorAwareStateDict` over nested dicts and lists.

Each tensor is restored to the device it came from. Non-tensor leaves stay in the hollow
state, so they must be types `torch.load(weights_only=True)` accepts (or be allowlisted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Tuple

import torch

from ..errors import CheckpointingException
from .base_state_dict import TensorAwareStateDict, allow_in_hollow_state

__all__ = ["BasicTensorAwareStateDict", "TensorPlaceholder"]


@dataclass
class TensorPlaceholder:
    """Stands in for a popped tensor: what is needed to rebuild it."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    device: str

    @classmethod
    def of(cls, tensor: torch.Tensor, device: Optional[str] = None) -> TensorPlaceholder:
        return cls(tuple(tensor.shape), tensor.dtype, device or str(tensor.device))

    def matches(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` has this placeholder's shape and dtype."""
        return tuple(tensor.shape) == self.shape and tensor.dtype == self.dtype

    def empty(self) -> torch.Tensor:
        """An uninitialized tensor with the recorded properties."""
        return torch.empty(self.shape, dtype=self.dtype, device=_usable_device(self.device))


def _usable_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointingException(
            f"A tensor of this checkpoint was saved from {device}, but CUDA is not available here"
        )
    return dev


def _map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    """Applies `fn` to every non-container leaf, in place, in a fixed (insertion) order."""
    if isinstance(tree, (dict, list)):
        for k in tree.keys() if isinstance(tree, dict) else range(len(tree)):
            tree[k] = _map_leaves(fn, tree[k])
        return tree
    return fn(tree)


def _leaves(tree: Any, path: str = "") -> Iterable[Tuple[str, Any]]:
    """`(path, leaf)` of every non-container leaf, '/'-joined paths, in insertion order."""
    if isinstance(tree, (dict, list)):
        for k, v in tree.items() if isinstance(tree, dict) else enumerate(tree):
            yield from _leaves(v, f"{path}/{k}" if path else str(k))
    else:
        yield path, tree


class BasicTensorAwareStateDict(TensorAwareStateDict):
    """Wraps a state dict (nested dicts and lists) whose tensor leaves are moved separately.

    Args:
        state_dict: the state; it is wrapped, not copied (popping tensors changes it).

    Raises:
        CheckpointingException: if `state_dict` is not a dict or list.
    """

    def __init__(self, state_dict: Any) -> None:
        if not isinstance(state_dict, (dict, list)):
            raise CheckpointingException(
                f"BasicTensorAwareStateDict wraps a dict or list, got {type(state_dict).__name__}"
            )
        self.state_dict = state_dict
        self._hollow = False
        # device each tensor came from, in pop order; None until tensors were moved or popped
        self._devices: Optional[List[str]] = None

    @property
    def is_hollow(self) -> bool:
        return self._hollow

    def pop_tensors(self) -> List[torch.Tensor]:
        self._require(False, "pop tensors")
        popped: List[torch.Tensor] = []
        devices = self._devices

        def pop(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                device = devices[len(popped)] if devices is not None else None
                popped.append(x)
                return TensorPlaceholder.of(x, device)
            return x

        _map_leaves(pop, self.state_dict)
        self._hollow = True
        return popped

    @property
    def tensors(self) -> List[torch.Tensor]:
        self._require(False, "list tensors")
        return [x for _, x in _leaves(self.state_dict) if isinstance(x, torch.Tensor)]

    def placeholders(self) -> List[TensorPlaceholder]:
        """The placeholders of a hollow state, in `pop_tensors` order."""
        self._require(True, "list placeholders")
        return [x for _, x in _leaves(self.state_dict) if isinstance(x, TensorPlaceholder)]

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        self._require(True, "insert tensors")
        data = list(tensor_data)
        holders = self.placeholders()
        if len(data) != len(holders):
            raise CheckpointingException(
                f"insert_tensors got {len(data)} tensors for {len(holders)} placeholders"
            )
        for i, (holder, tensor) in enumerate(zip(holders, data)):
            if not holder.matches(tensor):
                raise CheckpointingException(
                    f"insert_tensors: tensor {i} has shape {tuple(tensor.shape)} and dtype "
                    f"{tensor.dtype}, expected {holder.shape} and {holder.dtype}"
                )
        it = iter(data)
        _map_leaves(lambda x: next(it) if isinstance(x, TensorPlaceholder) else x, self.state_dict)
        self._devices = [h.device for h in holders]
        self._hollow = False

    def init_tensors(self) -> None:
        holders = self.placeholders()
        self.insert_tensors([h.empty() for h in holders])

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        self._require(False, "copy tensors to CPU")
        tensors = self.tensors
        if self._devices is None:
            self._devices = [str(t.device) for t in tensors]
        it = iter(t.to("cpu", non_blocking=non_blocking) for t in tensors)
        _map_leaves(lambda x: next(it) if isinstance(x, torch.Tensor) else x, self.state_dict)

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        self._require(False, "restore tensor devices")
        if self._devices is None:
            return
        devices = iter(self._devices)

        def restore(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            target = _usable_device(next(devices))
            return x if x.device == target else x.to(target, non_blocking=non_blocking)

        _map_leaves(restore, self.state_dict)

    def tensor_names(self) -> List[str]:
        """'/'-joined paths of the tensor leaves, in `pop_tensors` order (for messages)."""
        return [
            p
            for p, x in _leaves(self.state_dict)
            if isinstance(x, (torch.Tensor, TensorPlaceholder))
        ]

    def __getitem__(self, key: Any) -> Any:
        return self.state_dict[key]

    def __repr__(self) -> str:
        return f"BasicTensorAwareStateDict(hollow={self._hollow})"


allow_in_hollow_state(BasicTensorAwareStateDict, TensorPlaceholder)
