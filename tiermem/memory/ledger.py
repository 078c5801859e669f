"""Thread-safe byte accounting per tier: the ledger that makes a budget hold at every instant.

# NOTE [Activations that do not fit]
Activations depend on the batch, which TieredModel's constructor never sees, so its fit check
(NOTE [Footprint] in tiermem/plan/footprint.py) counts none: a layout that fits can still leave
too little of the device for the activations of a given batch. The device ledger is where that
shows, when forward saves (or backward brings back) an activation it cannot hold. Its refusal
then says that the activations of this batch did not fit, how many bytes were asked, what the
device holds by class (weights, grads, optimizer state, the activations saved so far), and what
to change: a smaller batch, ActivationOffload, less optimizer state on the device, gradient
checkpointing, or a larger device budget. Nothing stored is touched by it: the refused forward's
activations are released as autograd drops them, the step's phase goes back to idle, and a
smaller batch trains as if the refused one had never been tried. Up front, a policy's
``device_reserve`` (NOTE [Device reserve] in tiermem/plan/policy.py) keeps a share of the device
out of the layout for activations.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable, Optional, Protocol, Sequence

from tiermem.errors import OutOfTierMemory, fmt_bytes
from tiermem.handles import Handle, wait_all_quietly
from tiermem.types import TensorClass, Tier

#: How a refusal names the bytes each class holds.
_CLASS_WORDS = {
    TensorClass.PARAM: "weights",
    TensorClass.GRAD: "grads",
    TensorClass.OPTIM_STATE: "optimizer state",
    TensorClass.ACTIVATION: "activations saved so far",
}


# NOTE [Reclaimers at construction]
# When a reservation does not fit, a tier's ledger asks its reclaimers for the bytes missing
# before it refuses: requests in flight whose landing frees room (:class:`InFlight`: gradients
# copying home), and a cache on the tier (the residency scheduler's prefetched weights, in
# tiermem.transfer.schedule). Each is an object with ``make_room(missing)`` (:class:`Reclaimer`),
# given to the store, and so to its ledger, when the store is built: a tuple fixed for the store's
# life, never a list filled later. The objects that implement the protocol live in higher layers
# and import it from here, so tests/test_layering.py sees the dependency (upward calls go through
# this protocol, never through an import). A cache whose moves need the stores it frees room in
# (the scheduler moves weights through the engine, which is built on the stores) is built first
# and connected to its mover once that exists; until then it holds nothing, so it frees nothing.


class Reclaimer(Protocol):
    """Gives bytes back on a tier when a reservation there does not fit (NOTE [Reclaimers at construction])."""

    def make_room(self, missing: int) -> None:
        """Try to free ``missing`` bytes on the tier (less, or none, if it cannot); never raises
        for lack of room: the ledger refuses after asking every reclaimer."""
        ...


class InFlight(Reclaimer):
    """Requests in flight whose landing gives room back on a tier (a gradient's copy home holds
    its device bytes until the copy has read them), each with what gives that room back. Built
    before the tier's store and given to it as a reclaimer; the requests' owner
    (tiermem.train.step.grads.GradCollector) adds them as it makes them and takes them back when it
    waits for them itself. Thread-safe: backward adds while a reservation on another thread may be
    waiting for room."""

    def __init__(self) -> None:
        self._items: list[tuple[Handle, Callable[[], None]]] = []
        self._lock = threading.Lock()

    def add(self, handle: Handle, release: Callable[[], None]) -> None:
        """``handle``'s request holds room until it ends; ``release()`` gives it back (may run twice)."""
        with self._lock:
            self._items.append((handle, release))

    def take(self) -> list[tuple[Handle, Callable[[], None]]]:
        """Every request in flight, now off the list (their owner waits for them)."""
        with self._lock:
            items, self._items = self._items, []
        return items

    def make_room(self, missing: int) -> None:
        """Wait for the requests in flight, then give their room back (a failed one is its
        owner's to report). Never on one of tiermem's own threads, where the requests may be
        queued behind the caller. A wait returns before the handle's own callbacks ran, so the
        room is given back here too."""
        if threading.current_thread().name.startswith("tiermem-"):
            return
        with self._lock:
            items = list(self._items)
        wait_all_quietly([h for h, _ in items])
        for _, release in items:
            release()


class HeldTotal:
    """A running total of the bytes a ledger holds for a set of keys (a cache on the tier: the
    residency scheduler's weights), kept by the ledger as it reserves and releases, so the owner
    reads it without summing its keys. A key leaves the set when the ledger releases it (its copy
    on the tier is gone); :meth:`Ledger.drain_released` gives those keys to the owner. Built by
    :meth:`Ledger.held_total_of`; read and changed under the ledger's lock."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.total = 0
        self.released: list[str] = []


class Ledger:
    """Thread-safe byte accounting for one tier: who holds how much, the peak, and the cap.

    ``reserve`` refuses with :class:`OutOfTierMemory` when the cap would be crossed, so the
    budget holds at every instant, not just on average. A reservation may name a ``kind`` (a
    :class:`~tiermem.types.TensorClass`); bytes and peaks are then also kept per kind.
    """

    def __init__(self, tier: Tier, allowed: int, *, reclaimers: Sequence[Reclaimer] = ()):
        self.tier = tier
        self.allowed = int(allowed)
        self._held: dict[str, int] = {}
        self._kind: dict[str, TensorClass] = {}
        self._used = 0
        self.peak = 0
        self.kind_used: dict[TensorClass, int] = {}
        self.kind_peak: dict[TensorClass, int] = {}
        # Asked for the bytes missing when a reservation does not fit, before giving up: a cache
        # on this tier (e.g. prefetched weights) can evict to make room. Called outside the lock.
        self.reclaimers: tuple[Reclaimer, ...] = tuple(reclaimers)  # NOTE [Reclaimers at construction]
        self._totals: list[HeldTotal] = []  # running totals kept for caches on this tier
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    def held(self, key: str) -> int:
        return self._held.get(key, 0)

    def held_total(self, keys: Iterable[str]) -> int:
        """``sum(held(k) for k in keys)``, without a method call per key (a scheduler sums its
        keys on every acquire)."""
        held = self._held
        return sum(held.get(k, 0) for k in keys)

    def held_total_of(self) -> HeldTotal:
        """A new, empty running total of the bytes held for the keys :meth:`track` adds to it."""
        total = HeldTotal()
        with self._lock:
            self._totals.append(total)
        return total

    def track(self, total: HeldTotal, key: str) -> None:
        """Count ``key``'s bytes on this tier in ``total`` from now on, until it is released."""
        with self._lock:
            if key not in total.keys:
                total.keys.add(key)
                total.total += self._held.get(key, 0)

    def untrack(self, total: HeldTotal, key: str) -> None:
        """Stop counting ``key`` in ``total`` (nothing if it is not counted)."""
        with self._lock:
            if key in total.keys:
                total.keys.discard(key)
                total.total -= self._held.get(key, 0)

    def tracked(self, total: HeldTotal) -> list[str]:
        """The keys ``total`` counts now (a copy: the ledger changes the set as it releases)."""
        with self._lock:
            return list(total.keys)

    def drain_released(self, total: HeldTotal) -> list[str]:
        """The keys of ``total`` this ledger released since the last call (they left it then)."""
        with self._lock:
            keys, total.released = total.released, []
        return keys

    def reserve(
        self, key: str, nbytes: int, kind: Optional[TensorClass] = None, *, label: Optional[str] = None
    ) -> None:
        """Account ``nbytes`` to ``key`` (replacing what it held before); ``label``: what a
        refusal calls the bytes (default: ``key``)."""
        try:
            self._reserve(key, nbytes, kind, label)
        except OutOfTierMemory as e:
            if not self.reclaimers:
                raise
            self.reclaim(e.used + e.asked - e.allowed)
            self._reserve(key, nbytes, kind, label)

    def reclaim(self, missing: int, *, besides: Optional[Reclaimer] = None) -> None:
        """Ask every reclaimer of this tier, in order, to free ``missing`` bytes (``besides``: one
        that asks the others, skipped)."""
        for r in self.reclaimers:
            if r is not besides:
                r.make_room(missing)

    def _reserve(self, key: str, nbytes: int, kind: Optional[TensorClass], label: Optional[str] = None) -> None:
        with self._lock:
            before = self._held.get(key, 0)
            after_used = self._used - before + nbytes
            if after_used > self.allowed:
                raise self._refusal(label or key, nbytes, kind, self._used - before)
            self._drop_kind(key, before)
            self._held[key] = nbytes
            for total in self._totals:
                if key in total.keys:
                    total.total += nbytes - before
            self._used = after_used
            self.peak = max(self.peak, after_used)
            if kind is not None:
                self._kind[key] = kind
                self.kind_used[kind] = used = self.kind_used.get(kind, 0) + nbytes
                self.kind_peak[kind] = max(self.kind_peak.get(kind, 0), used)

    def _refusal(self, label: str, nbytes: int, kind: Optional[TensorClass], used: int) -> OutOfTierMemory:
        """NOTE [Activations that do not fit]: a refused activation says what the tier holds, by
        class, and what to change; other refusals keep OutOfTierMemory's own advice."""
        if kind is not TensorClass.ACTIVATION or self.tier != Tier.DEVICE:
            return OutOfTierMemory(tier=self.tier, key=label, asked=nbytes, used=used, allowed=self.allowed)
        return OutOfTierMemory(
            tier=self.tier,
            key=label,
            asked=nbytes,
            used=used,
            allowed=self.allowed,
            hint=(
                f"the activations of this batch did not fit beside what the device holds ({self._held_by_class()}); "
                f"use a smaller batch (or shorter sequences), offload activations (ActivationOffload(policy)), keep "
                f"less optimizer state on the device (a lower ZeroOffload(device_fraction=...); ZeroOffload, "
                f"KeepOnDevice and Auto take a device_reserve that keeps room for activations), recompute them in "
                f"backward (gradient checkpointing, torch.utils.checkpoint), or raise Budgets(device=...)"
            ),
        )

    def _held_by_class(self) -> str:
        parts = [f"{_CLASS_WORDS[k]} {fmt_bytes(n)}" for k, n in self.kind_used.items() if k in _CLASS_WORDS and n]
        other = self._used - sum(n for k, n in self.kind_used.items() if k in _CLASS_WORDS)
        if other:
            parts.append(f"other {fmt_bytes(other)}")
        return ", ".join(parts) or "nothing"

    def release(self, key: str) -> int:
        with self._lock:
            n = self._held.pop(key, 0)
            self._drop_kind(key, n)
            self._used -= n
            for total in self._totals:
                if key in total.keys:
                    total.keys.discard(key)
                    total.total -= n
                    total.released.append(key)
            return n

    def _drop_kind(self, key: str, nbytes: int) -> None:
        kind = self._kind.pop(key, None)
        if kind is not None:
            self.kind_used[kind] -= nbytes

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self._used
            self.kind_peak = dict(self.kind_used)
