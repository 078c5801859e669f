"""Hook bookkeeping: every handle kept so ``detach()`` removes them all. (The saved-tensor
hooks that account and offload activations live in :mod:`tiermem.train.activations`.)"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager(fn: F) -> F:
    """``fn`` runs as plain Python even inside a ``torch.compile``d forward: dynamo stops its graph
    at the call instead of tracing it (NOTE [Module hooks and torch.compile] in
    :mod:`tiermem.train.activations`). For hooks that move weights, take locks or look at data
    pointers: traced, such code would run at compile time, on fake tensors, not at every call."""
    return torch.compiler.disable(fn, recursive=True)


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
