"""Hook bookkeeping: every handle kept so ``detach()`` removes them all. (The saved-tensor
hooks that account and offload activations live in :mod:`tiermem.train.activations`.)"""

from __future__ import annotations

import sys
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager(fn: F) -> F:
    """``fn`` runs as plain Python even inside a ``torch.compile``d forward: dynamo stops its graph
    at the call instead of tracing it (NOTE [Module hooks and torch.compile] in
    :mod:`tiermem.train.activations`). For hooks that move weights, take locks or look at data
    pointers: traced, such code would run at compile time, on fake tensors, not at every call."""
    return torch.compiler.disable(fn, recursive=True)


# NOTE [Callbacks dynamo must not trace]
# Dynamo's frame callback is set on the thread for as long as a compiled function runs, and where
# that function falls back to eager pieces (a graph break: an ``eager`` hook, or an op on a weight
# off the device under overlap_step, whose forward dynamo is left to run: NOTE [Parameters off the
# device]) every Python frame that torch enters from C++ meanwhile is offered to dynamo too:
# ``OffDeviceWeight.__torch_dispatch__`` for each op on a weight, the saved-tensor pack hook for
# each activation. Traced, such a frame recompiles on every new argument count, type or dtype
# until dynamo's recompile limit (8 a frame, with resume functions after each graph break): ~40
# frames and ~20 CPU s for TinyGPT's first three steps (tests/test_compile.py's overlap_step case),
# computing nothing a plain call does not. So these callbacks run untraced: the dispatch through
# ``torch._disable_dynamo`` (torch's lazy ``torch.compiler.disable``: dynamo is imported at the
# first op, where ParamOffload's ``eager`` hooks have imported it already), the pack hooks through
# :func:`untraced`, which wraps only when dynamo is loaded (without it no frame is traced, and
# importing it would cost a model that is never compiled ~2.5 CPU s).
def untraced(*fns: F) -> tuple[F, ...]:
    """``fns``, each run as plain Python when dynamo would otherwise trace it (NOTE [Callbacks dynamo
    must not trace]); as they are while dynamo is not loaded."""
    if "torch._dynamo" not in sys.modules:
        return fns
    return tuple(torch.compiler.disable(fn, recursive=True) for fn in fns)


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
