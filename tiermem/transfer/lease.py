"""Pooled staging: a host buffer borrowed from the pool for the length of one transfer.

# NOTE [Pooled staging]
Whatever borrows a host buffer for a transfer (staging between the device and NVMe, a bucket's
gradients on their way to NVMe, an offloaded activation's home or staging) takes a :class:`Lease`
from ``TransferEngine.lease`` and releases it on every path: as a ``with`` block, or as the
``cleanup`` of a chain (``TransferEngine.chain``), which runs before the chain's handle
completes, so whoever waits on the chain finds the buffer back in the pool.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence

import torch

from tiermem.memory.resident import HostStore
from tiermem.types import TensorClass


class Lease:
    """A pooled host buffer on loan under ``key``: ``view()`` it as the transfer needs,
    ``release()`` it when the transfer is over. Releasing again (from any thread) does nothing;
    as a context manager it is released on exit."""

    __slots__ = ("key", "nbytes", "_host", "_base", "_lock")

    def __init__(self, host: HostStore, nbytes: int, key: str, kind: Optional[TensorClass] = None):
        """Take a buffer of at least ``nbytes`` from ``host``'s pool, accounted to ``key`` as
        ``kind``; raises :class:`~tiermem.errors.OutOfTierMemory` when the budget has no room."""
        self.key, self.nbytes, self._host = key, nbytes, host
        self._base: Optional[torch.Tensor] = host.acquire(nbytes, key, kind)
        self._lock = threading.Lock()

    def view(self, dtype: torch.dtype = torch.uint8, shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The first ``nbytes`` of the buffer as ``dtype``: flat, or in ``shape``."""
        base = self._base
        assert base is not None, f"{self.key!r}: lease viewed after its release"
        t = base[: self.nbytes]
        t = t if dtype is torch.uint8 else t.view(dtype)
        return t if shape is None else t.view(tuple(shape))

    def release(self) -> None:
        with self._lock:
            base, self._base = self._base, None
        if base is not None:
            self._host.release(self.key, base)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
