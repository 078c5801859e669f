"""Byte budgets per tier: parsing (``"8GiB"``, ``"500MB"``, ints) and the accounting that enforces them."""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass, fields
from typing import Callable, Optional, Union

from tiermem.errors import ConfigError, OutOfTierMemory
from tiermem.types import Tier

ByteSize = Union[int, str]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: ByteSize, *, what: str = "size") -> int:
    """``"8GiB"`` -> 8589934592, ``"500MB"`` -> 500000000, ``1024`` -> 1024.

    Decimal units (KB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) of 1024.
    """
    if isinstance(value, bool):
        raise ConfigError(f"tiermem: {what}={value!r} is not a size; give bytes as an int or a string such as '8GiB'")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(
                f"tiermem: {what}={value!r} does not parse as a size; write a number with an optional "
                f"unit from B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '8GiB' or '500MB')")
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ConfigError(f"tiermem: {what}={value!r} is not a size; give bytes as an int or a string such as '8GiB'")
    if n < 0:
        raise ConfigError(f"tiermem: {what}={value!r} is negative; give a size of 0 bytes or more")
    return n


@dataclass(frozen=True)
class Budgets:
    """Caps on the bytes tiermem manages per tier. ``None`` means this machine's default
    (device memory, or available RAM without an accelerator; available RAM for host; free
    disk space for NVMe)."""

    device: Optional[ByteSize] = None
    host: Optional[ByteSize] = None
    nvme: Optional[ByteSize] = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None:
                object.__setattr__(self, f.name, parse_bytes(v, what=f"Budgets.{f.name}"))

    def for_tier(self, tier: Tier) -> Optional[int]:
        return getattr(self, tier.value)


class Ledger:
    """Thread-safe byte accounting for one tier: who holds how much, the peak, and the cap.

    ``reserve`` refuses with :class:`OutOfTierMemory` when the cap would be crossed, so the
    budget holds at every instant, not just on average. A reservation may name a ``kind`` (a
    :class:`~tiermem.types.TensorClass`); bytes and peaks are then also kept per kind.
    """

    def __init__(self, tier: Tier, allowed: int):
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
        self.reclaim: Optional[Callable[[int], None]] = None
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
