"""Hook bookkeeping: every handle kept so ``detach()`` removes them all, and the meter that
accounts activations (tensors autograd saves for backward) to the device tier."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from tiermem.errors import OutOfTierMemory
from tiermem.types import TensorClass


class HookSet:
    """Removable handles from PyTorch's own registration functions."""

    def __init__(self) -> None:
        self._handles: list = []

    def add(self, handle) -> None:
        self._handles.append(handle)

    def remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def __len__(self) -> int:
        return len(self._handles)


class ActivationMeter:
    """Counts the bytes of distinct storages saved for backward during a forward, and reserves
    them on the device ledger as ACTIVATION, so activations show in the report and count
    against the device budget. Parameters (saved by matmul's backward) are not activations."""

    KEY = "<activations>"

    def __init__(self, device_store, module: torch.nn.Module) -> None:
        self.ledger = device_store.ledger
        self._param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._seen: set[int] = set()
        self._bytes = 0

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._seen or ptr in self._param_storages:
            return t
        self._seen.add(ptr)
        self._bytes += storage.nbytes()
        try:
            self.ledger.reserve(self.KEY, self._bytes, TensorClass.ACTIVATION)
        except OutOfTierMemory as e:
            raise OutOfTierMemory(
                tier=e.tier, key="activations saved for backward", asked=storage.nbytes(), used=e.used,
                allowed=e.allowed, hint="reduce the batch size or sequence length, or raise "
                                        "Budgets(device=...)") from None
        return t

    def release(self) -> None:
        """Backward has run: the saved tensors are gone."""
        self.ledger.release(self.KEY)
        self._seen.clear()
        self._bytes = 0


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
