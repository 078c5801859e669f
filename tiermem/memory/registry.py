"""The registry: stable keys -> residency. Which tiers hold a valid copy, which tier is home, and
whether a transfer is in flight. Nothing is hung on torch tensors; the key is the identity.

Transitions are checked, so a bug that would lose the only copy of a tensor fails loudly:

    register ──put──▶ valid={home}
    begin(src→dst) needs src valid and nothing in flight; finish(ok) adds dst; fail adds nothing
    drop(tier) refuses to drop the last valid copy; write_at(tier) makes that tier the only valid one
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional

from tiermem.errors import TierMemError
from tiermem.types import TensorInfo, Tier

#: fastest first; a read is served from the first valid tier in this order
TIER_ORDER = (Tier.DEVICE, Tier.HOST, Tier.NVME)


@dataclass
class Residency:
    info: TensorInfo
    home: Tier
    valid: set[Tier] = field(default_factory=set)
    in_flight: Optional[tuple[Tier, Tier]] = None  # (src, dst) of the transfer now running

    @property
    def key(self) -> str:
        return self.info.name

    def fastest_valid(self) -> Optional[Tier]:
        return next((t for t in TIER_ORDER if t in self.valid), None)


class Registry:
    """Thread-safe map of key -> :class:`Residency` with checked transitions."""

    def __init__(self) -> None:
        self._entries: dict[str, Residency] = {}
        self._lock = threading.RLock()

    def register(self, info: TensorInfo, home: Tier) -> Residency:
        if not isinstance(home, Tier):
            raise TierMemError(
                f"tiermem: home tier for {info.name!r} is {home!r}, not a Tier; "
                f"return Tier.DEVICE, Tier.HOST or Tier.NVME"
            )
        with self._lock:
            if info.name in self._entries:
                raise TierMemError(f"tiermem: {info.name!r} is registered twice; keys must be unique")
            r = self._entries[info.name] = Residency(info, home)
            return r

    def get(self, key: str) -> Residency:
        try:
            return self._entries[key]
        except KeyError:
            raise TierMemError(f"tiermem: {key!r} is not registered; register it before moving it") from None

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[Residency]:
        return iter(list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    # -- transitions --------------------------------------------------------------------------
    def write_at(self, key: str, tier: Tier) -> None:
        """``tier`` now holds the newest value; every other copy is stale."""
        with self._lock:
            r = self.get(key)
            assert r.in_flight is None, f"{key}: written while a transfer {r.in_flight} is in flight"
            r.valid = {tier}

    def begin(self, key: str, src: Tier, dst: Tier) -> None:
        with self._lock:
            r = self.get(key)
            assert r.in_flight is None, f"{key}: transfer {src}->{dst} while {r.in_flight} in flight"
            assert src in r.valid, f"{key}: transfer from {src}, which holds no valid copy ({r.valid})"
            assert src != dst, f"{key}: transfer from {src} to itself"
            r.in_flight = (src, dst)

    def finish(self, key: str, ok: bool) -> None:
        with self._lock:
            r = self.get(key)
            assert r.in_flight is not None, f"{key}: finish without a transfer in flight"
            if ok:
                r.valid.add(r.in_flight[1])
            r.in_flight = None

    def drop(self, key: str, tier: Tier) -> None:
        with self._lock:
            r = self.get(key)
            assert r.in_flight is None or tier not in r.in_flight, f"{key}: drop {tier} during {r.in_flight}"
            assert r.valid != {tier}, f"{key}: dropping {tier} would lose the only valid copy"
            r.valid.discard(tier)

    def unregister(self, key: str) -> Residency:
        with self._lock:
            r = self.get(key)
            assert r.in_flight is None, f"{key}: unregistered while {r.in_flight} is in flight"
            return self._entries.pop(key)
