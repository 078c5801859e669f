"""Hook bookkeeping: every handle kept so ``detach()`` removes them all. (The saved-tensor
hooks that account and offload activations live in :mod:`tiermem.train.activations`.)"""
from __future__ import annotations


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
