"""`BasicTensorAwareStateDict`: a `TensorAwareStateDict` over nested dicts and lists (its
non-tensor leaves stay in the hollow state: see `base_state_dict` for what they may be)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Tuple

import torch

from ..dict_utils import dict_list_map_inplace, nested_values
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

    def _replace(self, kind: type, values: Iterable[Any]) -> None:
        """Replaces the leaves of type `kind`, in `pop_tensors` order, with `values`."""
        it = iter(values)
        dict_list_map_inplace(lambda x: next(it) if isinstance(x, kind) else x, self.state_dict)

    def pop_tensors(self) -> List[torch.Tensor]:
        self._require(False, "pop tensors")
        popped = self.tensors
        devices = self._devices or [str(t.device) for t in popped]
        self._replace(torch.Tensor, map(TensorPlaceholder.of, popped, devices))
        self._hollow = True
        return popped

    @property
    def tensors(self) -> List[torch.Tensor]:
        self._require(False, "list tensors")
        return [x for x in nested_values(self.state_dict) if isinstance(x, torch.Tensor)]

    def placeholders(self) -> List[TensorPlaceholder]:
        """The placeholders of a hollow state, in `pop_tensors` order."""
        self._require(True, "list placeholders")
        return [x for x in nested_values(self.state_dict) if isinstance(x, TensorPlaceholder)]

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        self._require(True, "insert tensors")
        data = list(tensor_data)
        holders = self.placeholders()
        slots = [(f"tensor {i}", h.shape, h.dtype) for i, h in enumerate(holders)]
        self._check_insert(data, slots, "placeholders")
        self._replace(TensorPlaceholder, data)
        self._devices = [h.device for h in holders]
        self._hollow = False

    def init_tensors(self) -> None:
        self.insert_tensors([h.empty() for h in self.placeholders()])

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        self._require(False, "copy tensors to CPU")
        tensors = self.tensors
        if self._devices is None:
            self._devices = [str(t.device) for t in tensors]
        # host tensors are copied too: the caller keeps changing the originals
        self._replace(
            torch.Tensor, [t.to("cpu", non_blocking=non_blocking, copy=True) for t in tensors]
        )

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        self._require(False, "restore tensor devices")
        if self._devices is None:
            return
        moved = []
        for t, d in zip(self.tensors, map(_usable_device, self._devices)):
            moved.append(t if t.device == d else t.to(d, non_blocking=non_blocking))
        self._replace(torch.Tensor, moved)

    def tensor_names(self) -> List[str]:
        """'/'-joined paths of the tensor leaves, in `pop_tensors` order (for messages)."""
        kinds = (torch.Tensor, TensorPlaceholder)
        return [p for p, x in _leaves(self.state_dict) if isinstance(x, kinds)]

    def __getitem__(self, key: Any) -> Any:
        return self.state_dict[key]

    def __repr__(self) -> str:
        return f"BasicTensorAwareStateDict(hollow={self._hollow})"


allow_in_hollow_state(BasicTensorAwareStateDict, TensorPlaceholder)
