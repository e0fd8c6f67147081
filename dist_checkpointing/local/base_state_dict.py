"""`TensorAwareStateDict`: the interface between a user's state and the local checkpoint manager.

The manager stores the tensors as raw bytes and the "hollow" rest with `torch.save`, read back
with `torch.load(weights_only=True)`: implementation classes (and the non-tensor objects they
hold) must be allowlisted (`allow_in_hollow_state` or `torch.serialization.add_safe_globals`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterable, List, Optional, Tuple, ValuesView

import torch

from ..errors import CheckpointingException

__all__ = ["TensorAwareStateDict", "allow_in_hollow_state", "hollow_state_classes"]

_HOLLOW_CLASSES: List[type] = []


def allow_in_hollow_state(*classes: type) -> None:
    """Allowlists `classes` for reading hollow states, independently of the process-wide
    `torch.serialization` allowlist (which user code may clear)."""
    for c in classes:
        if c not in _HOLLOW_CLASSES:
            _HOLLOW_CLASSES.append(c)
    torch.serialization.add_safe_globals(list(classes))


def hollow_state_classes() -> List[type]:
    """The classes registered with `allow_in_hollow_state`."""
    return list(_HOLLOW_CLASSES)


class TensorAwareStateDict(ABC):
    """A state whose tensors can be taken out, put back, and moved between devices."""

    @abstractmethod
    def pop_tensors(self) -> List[torch.Tensor]:
        """Takes the tensors out, leaving placeholders that remember shape, dtype and device.

        Returns:
            The tensors, in the order `insert_tensors` takes them back.

        Raises:
            CheckpointingException: the state is already hollow.
        """

    @property
    @abstractmethod
    def tensors(self) -> Iterable[torch.Tensor]:
        """The tensors, in `pop_tensors` order, without removing them."""

    @property
    @abstractmethod
    def is_hollow(self) -> bool:
        """True between `pop_tensors` (or loading the hollow part) and `insert_tensors`."""

    @abstractmethod
    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        """Puts tensors back in place of the placeholders (inverse of `pop_tensors`).

        Raises:
            CheckpointingException: if the state is not hollow, or the number, shapes or
                dtypes of `tensor_data` do not match the placeholders.
        """

    @abstractmethod
    def init_tensors(self) -> None:
        """Replaces the placeholders with uninitialized tensors of the recorded properties."""

    @abstractmethod
    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replaces each tensor with a host copy, remembering its device for `restore_tensor_device`.

        Args:
            non_blocking: asynchronous device-to-host copies (the caller synchronizes).
        """

    @abstractmethod
    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Moves every tensor back to the device it came from (no-op for host tensors)."""

    def tensor_names(self) -> Optional[List[str]]:
        """Names of the tensors in `pop_tensors` order (for messages); None when unnamed."""
        return None

    @staticmethod
    def _check_insert(data: List[torch.Tensor], slots: List[Tuple[str, Any, Any]], of: str) -> None:
        """Raises unless `data` fits `slots` (`(label, shape, dtype)` each; `of`: what they are)."""
        if len(data) != len(slots):
            raise CheckpointingException(
                f"insert_tensors got {len(data)} tensors for {len(slots)} {of}"
            )
        for t, (label, shape, dtype) in zip(data, slots):
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise CheckpointingException(
                    f"insert_tensors: {label} has shape {tuple(t.shape)} and dtype {t.dtype}, "
                    f"expected {tuple(shape)} and {dtype}"
                )

    def _require(self, hollow: bool, what: str) -> None:
        if self.is_hollow != hollow:
            state = "hollow" if self.is_hollow else "not hollow"
            raise CheckpointingException(f"Cannot {what}: the state dict is {state}")

    def values(self) -> ValuesView[Any]:
        """The object's attribute values (what a generic traversal sees)."""
        return vars(self).values()
