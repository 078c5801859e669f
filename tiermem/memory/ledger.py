"""Thread-safe byte accounting per tier: the ledger that makes a budget hold at every instant."""
from __future__ import annotations

import threading
from typing import Callable, Optional

from tiermem.errors import OutOfTierMemory
from tiermem.types import Tier


class Reclaimers:
    """Who can give bytes back on a tier when a reservation does not fit (a cache of prefetched
    weights evicts). Handed to the tier's ledger when the store is built; a cache built later on
    the same tier registers with it, the way hooks register with a module."""

    def __init__(self) -> None:
        self._fns: list[Callable[[int], None]] = []

    def add(self, fn: Callable[[int], None]) -> None:
        self._fns.append(fn)

    def __call__(self, missing: int) -> None:
        for fn in self._fns:
            fn(missing)


class Ledger:
    """Thread-safe byte accounting for one tier: who holds how much, the peak, and the cap.

    ``reserve`` refuses with :class:`OutOfTierMemory` when the cap would be crossed, so the
    budget holds at every instant, not just on average. A reservation may name a ``kind`` (a
    :class:`~tiermem.types.TensorClass`); bytes and peaks are then also kept per kind.
    """

    def __init__(self, tier: Tier, allowed: int, *, reclaim: Optional[Callable[[int], None]] = None):
        self.tier = tier
        self.allowed = int(allowed)
        self._held: dict[str, int] = {}
        self._kind: dict[str, object] = {}
        self._used = 0
        self.peak = 0
        self.kind_used: dict[object, int] = {}
        self.kind_peak: dict[object, int] = {}
        # Called with the bytes missing when a reservation does not fit, before giving up: a cache
        # on this tier (e.g. prefetched weights) can evict to make room. Called outside the lock.
        self.reclaim = reclaim
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    def held(self, key: str) -> int:
        return self._held.get(key, 0)

    def reserve(self, key: str, nbytes: int, kind: object = None) -> None:
        """Account ``nbytes`` to ``key`` (replacing what it held before)."""
        try:
            self._reserve(key, nbytes, kind)
        except OutOfTierMemory as e:
            if self.reclaim is None:
                raise
            self.reclaim(e.used + e.asked - e.allowed)
            self._reserve(key, nbytes, kind)

    def _reserve(self, key: str, nbytes: int, kind: object) -> None:
        with self._lock:
            before = self._held.get(key, 0)
            after_used = self._used - before + nbytes
            if after_used > self.allowed:
                raise OutOfTierMemory(tier=self.tier, key=key, asked=nbytes,
                                      used=self._used - before, allowed=self.allowed)
            self._drop_kind(key, before)
            self._held[key] = nbytes
            self._used = after_used
            self.peak = max(self.peak, after_used)
            if kind is not None:
                self._kind[key] = kind
                self.kind_used[kind] = used = self.kind_used.get(kind, 0) + nbytes
                self.kind_peak[kind] = max(self.kind_peak.get(kind, 0), used)

    def release(self, key: str) -> int:
        with self._lock:
            n = self._held.pop(key, 0)
            self._drop_kind(key, n)
            self._used -= n
            return n

    def _drop_kind(self, key: str, nbytes: int) -> None:
        kind = self._kind.pop(key, None)
        if kind is not None:
            self.kind_used[kind] -= nbytes

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self._used
            self.kind_peak = dict(self.kind_used)
