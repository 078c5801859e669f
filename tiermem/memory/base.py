"""One interface, three tiers. A store holds bytes under stable keys and accounts them to a budget.

``write(key, src)`` copies ``src`` in; ``read(key, out)`` copies the stored bytes into ``out``;
both return a :class:`~tiermem.handles.Handle`. ``delete(key)`` frees the key. Memory stores
(device, host) additionally hand out the resident tensor itself with ``get(key)``.
"""

from __future__ import annotations

import abc
from typing import Iterator, Optional

import torch

from tiermem.errors import StoreError
from tiermem.handles import Handle
from tiermem.memory.ledger import Ledger
from tiermem.types import TensorClass, Tier


class Store(abc.ABC):
    tier: Tier
    ledger: Ledger

    @abc.abstractmethod
    def write(self, key: str, src: torch.Tensor, kind: Optional[TensorClass] = None) -> Handle:
        """Store a bit-exact copy of ``src`` under ``key``, replacing any previous value;
        ``kind`` (a TensorClass) is what the ledger counts the bytes as."""

    @abc.abstractmethod
    def read(self, key: str, out: torch.Tensor) -> Handle:
        """Copy the value stored under ``key`` into ``out`` (same dtype and number of elements)."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Forget ``key`` and release its bytes. Unknown keys are ignored."""

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abc.abstractmethod
    def keys(self) -> Iterator[str]: ...

    def close(self) -> None:
        """Give back what the store holds beyond its keys (pooled buffers, open files)."""

    def release_all(self) -> None:
        """Delete every key, then :meth:`close`: the store's bytes all go back to the system."""
        for key in list(self.keys()):
            self.delete(key)
        self.close()

    @property
    def used(self) -> int:
        return self.ledger.used

    @property
    def allowed(self) -> int:
        return self.ledger.allowed


def check_same_layout(key: str, stored_dtype: torch.dtype, stored_numel: int, out: torch.Tensor, tier: Tier) -> None:
    """Refuse a read into a tensor that cannot hold the stored value."""
    if out.dtype != stored_dtype or out.numel() != stored_numel:
        raise StoreError(
            f"tiermem: cannot read {key!r} from the {tier} tier into a tensor of {out.numel()} x "
            f"{out.dtype}: it holds {stored_numel} x {stored_dtype}; pass `out` with that dtype and size"
        )
    if not out.is_contiguous():
        raise StoreError(f"tiermem: cannot read {key!r} into a non-contiguous tensor; pass a contiguous `out`")


def unknown_key(key: str, tier: Tier) -> StoreError:
    return StoreError(
        f"tiermem: no tensor {key!r} on the {tier} tier; write it before reading it (or check the key's spelling)"
    )
