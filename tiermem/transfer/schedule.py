"""Trace-driven residency: which managed tensors sit on a fast tier, fetched ahead of use and
evicted by furthest next use.

The first iteration records the order in which managed tensors are acquired. Later iterations
follow that trace: each acquire prefetches the tensors used next, as many as fit in the
lookahead, and when room is needed the released tensor whose next use lies furthest ahead is
evicted (Belady). Without a trace (the first iteration, or one that left the recorded order),
victims are the least recently used and nothing is fetched ahead.

The decisions (``AccessTrace``, ``choose_victim``, ``lookahead_window``) are pure and know
nothing of tensors: they live in :mod:`tiermem.transfer.decisions` (and are importable from here
too). :class:`ResidencyScheduler` carries them out with the moves of a
:class:`~tiermem.transfer.residency.KeyedResidency` only.

# NOTE [Room before allocation]
A move allocates its destination on the caller's thread and the tier's ledger refuses what
would cross the budget. The scheduler therefore evicts until the ledger has room *before* it
asks for anything to move, and waits for each eviction it makes: a tensor whose only
valid copy is on the tier is written back home first, and its bytes count until that write
lands. Acquired tensors are never victims. If everything evictable is gone and the tensor still
does not fit, the tier's other reclaimers are asked once (gradients still being copied home hold
device bytes until their copy lands: a slow copy lane, e.g. on a busy CPU, must not turn a budget
that fits into a refusal); if it still does not fit, the working set itself is too large and the
error says by how much.

# NOTE [Fetch-ahead in O(window)]
An acquire costs O(window), not O(managed tensors). The ledger keeps their bytes on the tier as a
running total (``HeldTotal``; a key leaves it when its copy there is released, by anyone). The
trace's keys that may be missing there are an ``AbsentAhead``, rebuilt from the registry after
each iteration, joined by every key the ledger releases (eviction, a value written home, a failed
move, deletion), left by a key fetched or seen resident while tracked (over-reporting costs a
look, never a decision). If none is used from the position on, the window would fetch nothing and
is not computed. Victims come from a ``VictimQueue`` (NOTE [Victims in order]).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch

from tiermem.config.budgets import ByteSize, parse_bytes
from tiermem.errors import ConfigError, OutOfTierMemory, TierMemError, fmt_bytes
from tiermem.handles import Handle
from tiermem.memory.ledger import HeldTotal, Reclaimer
from tiermem.memory.registry import Residency
from tiermem.memory.resident import MemoryStore, nbytes_of
from tiermem.transfer.decisions import (
    AbsentAhead,
    AccessTrace,
    TraceFollower,
    VictimQueue,
    choose_victim as choose_victim,  # importable from here too
    lookahead_window,
)
from tiermem.transfer.residency import KeyedResidency
from tiermem.types import Tier

log = logging.getLogger(__name__)

EVICTION_POLICIES = ("belady", "lru")


# -- counters ---------------------------------------------------------------------------------
@dataclass
class ScheduleStats:
    """Counters of one iteration (or, summed, of several). Every acquire is exactly one of
    ``hits`` (already resident), ``late`` (prefetched, still in flight) or ``misses`` (fetched
    on demand)."""

    acquires: int = 0
    hits: int = 0
    late: int = 0
    misses: int = 0
    prefetches: int = 0  # moves issued ahead of use
    evictions: int = 0
    writebacks: int = 0  # evictions that first wrote a modified copy back home
    bytes_prefetched: int = 0
    bytes_fetched: int = 0  # on demand, by misses
    bytes_evicted: int = 0
    bytes_written_back: int = 0
    stall_seconds: float = 0.0  # time acquire spent waiting on transfers and write-backs

    def __add__(self, other: "ScheduleStats") -> "ScheduleStats":
        return ScheduleStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


# -- carrying them out --------------------------------------------------------------------------
class ResidencyScheduler(Reclaimer):
    """Keeps managed tensors resident on ``tier`` when they are used, within its budget.

    ``acquire(key)`` returns the tensor on ``tier`` (waiting for it if needed) and keeps it there
    until ``release(key)``; acquires nest, like a counted lock. ``mark_dirty(key)`` says the
    acquired copy was modified, so evicting it writes it back home. ``end_iteration()`` freezes
    the first iteration's access order as the trace (later: checks it and re-records on change)
    and starts fetching the next iteration's first tensors; call it after anything that rewrites
    the managed tensors at home (e.g. the optimizer step), so that prefetch reads new values.

    ``lookahead_bytes`` caps the bytes fetched ahead (default: the budget minus what is acquired
    and what other tensors hold there). ``prefetch=False`` fetches only on demand;
    ``eviction="lru"`` ignores the trace when choosing victims (both are for comparison).
    Managed tensors must be registered with a home other than ``tier``. Call from the training
    thread(s); the engine's worker threads never call back into the scheduler.

    It is the tier's cache, so the tier's store is given it as a reclaimer when built (NOTE
    [Reclaimers at construction] in :mod:`tiermem.memory.ledger`): build the scheduler first,
    then the stores, the engine and the residency over them, then :meth:`connect` it to that
    residency (once), before the first acquire.
    """

    def __init__(
        self,
        tier: Tier = Tier.DEVICE,
        *,
        lookahead_bytes: Optional[ByteSize] = None,
        prefetch: bool = True,
        eviction: str = "belady",
    ):
        if tier not in (Tier.DEVICE, Tier.HOST):
            raise ConfigError(
                f"tiermem: ResidencyScheduler.tier={tier!r} must be a memory tier; pass Tier.DEVICE or Tier.HOST"
            )
        if eviction not in EVICTION_POLICIES:
            raise ConfigError(
                f"tiermem: ResidencyScheduler.eviction={eviction!r} is not one of "
                f"{EVICTION_POLICIES}; pass 'belady' (the default) or 'lru'"
            )
        self.tier = tier
        self._connected: Optional[tuple[KeyedResidency, MemoryStore]] = None
        self.lookahead_bytes = (
            None if lookahead_bytes is None else parse_bytes(lookahead_bytes, what="ResidencyScheduler.lookahead_bytes")
        )
        self.prefetch, self.eviction = bool(prefetch), eviction
        self._follow = TraceFollower()  # this iteration's accesses against the trace
        self.history: list[ScheduleStats] = []  # one entry per finished iteration
        self.current = ScheduleStats()
        self._lock = threading.RLock()
        self._pins: dict[str, int] = {}  # acquired key -> open acquires
        self._held = HeldTotal()  # keys this scheduler placed on the tier, and their bytes there (kept by the ledger)
        self._absent: Optional[AbsentAhead] = None  # NOTE [Fetch-ahead in O(window)]
        self._sizes: dict[str, int] = {}
        self._last_used: dict[str, int] = {}
        self._clock = 0
        self._victims = VictimQueue(self._last_used, self._tracked, belady=eviction == "belady")
        self._reclaiming = False

    def connect(self, residency: KeyedResidency) -> "ResidencyScheduler":
        """Carry out the schedule with ``residency``'s moves, over its store of the tier (once)."""
        if self._connected is not None:
            raise TierMemError(
                "tiermem: ResidencyScheduler.connect() was called twice; a scheduler "
                "serves one residency: build another scheduler for another one"
            )
        store = residency.engine.stores.get(self.tier)
        if not isinstance(store, MemoryStore):
            raise ConfigError(
                f"tiermem: ResidencyScheduler.tier={self.tier!r} must be a memory tier the "
                f"engine has a store for ({', '.join(map(str, residency.engine.stores))}); "
                f"build the engine with a store for {self.tier}"
            )
        self._connected = (residency, store)
        self._held = store.ledger.held_total_of()
        return self

    @property
    def residency(self) -> KeyedResidency:
        return self._parts()[0]

    @property
    def _store(self) -> MemoryStore:
        return self._parts()[1]

    def _parts(self) -> tuple[KeyedResidency, MemoryStore]:
        if self._connected is None:
            raise TierMemError(
                "tiermem: this ResidencyScheduler is not connected to a residency yet; "
                "call connect(residency) once the engine exists, before acquiring"
            )
        return self._connected

    @property
    def trace(self) -> Optional[AccessTrace]:
        """The recorded iteration's accesses (None before the first iteration ends)."""
        return self._follow.trace

    @property
    def stats(self) -> ScheduleStats:
        """Totals over every iteration, the current one included."""
        return sum([*self.history, self.current], ScheduleStats())

    # -- public calls -------------------------------------------------------------------------
    def acquire(self, key: str, *, on_demand: Optional[Counter[str]] = None) -> torch.Tensor:
        """The tensor of ``key`` resident on the tier, held there until :meth:`release`.
        ``on_demand``: counts ``key`` there when, once a trace exists, it had to be fetched on
        demand (nothing had brought it or started to)."""
        with self._lock:
            r = self._residency(key)
            self._record(key)
            self._pins[key] = self._pins.get(key, 0) + 1
            self._touch(key)
            try:
                misses = self.current.misses
                handle = self._make_resident(r)
                if on_demand is not None and self.trace is not None and self.current.misses > misses:
                    on_demand[key] += 1
                self._fetch_ahead()
            except BaseException:  # e.g. no room even for this tensor, or a write-back failed
                self._unpin(key)
                raise
        t0, ready = time.perf_counter(), handle.done()
        try:
            if self.tier == Tier.DEVICE:
                self.residency.engine.join(
                    handle
                )  # ordering: the caller's stream reads the tensor after its bytes land
            else:
                handle.wait()  # ordering: the host reads the tensor only once its bytes have landed
        except BaseException:
            with self._lock:
                self._unpin(key)
            raise
        finally:
            if not ready:
                with self._lock:
                    self.current.stall_seconds += time.perf_counter() - t0
        return self._store.get(key)

    def release(self, key: str) -> None:
        """The caller is done with ``key`` for now: it may be evicted (nothing moves yet)."""
        with self._lock:
            if not self._pins.get(key):
                raise TierMemError(
                    f"tiermem: release({key!r}) without a matching acquire; pair every "
                    f"release with an earlier acquire of the same key"
                )
            self._unpin(key)
            self._touch(key)

    def mark_dirty(self, key: str) -> None:
        """The acquired copy of ``key`` on the tier was modified: it is now the only valid one,
        and evicting it writes it back home."""
        with self._lock:
            if not self._pins.get(key):
                raise TierMemError(
                    f"tiermem: mark_dirty({key!r}) on a tensor that is not acquired; "
                    f"acquire it, modify it, mark it dirty, then release it"
                )
            self.residency.registry.write_at(key, self.tier)

    def end_iteration(self) -> None:
        """Close the iteration: freeze (or check and renew) the trace, then fetch ahead of the
        next iteration's first accesses."""
        with self._lock:
            recorded = tuple(self._follow.recording)
            if not recorded:
                log.debug("tiermem: an iteration acquired no managed tensor; the trace stays as it was")
            elif self.trace is None:
                log.debug(
                    "tiermem: recorded a trace of %d accesses to %d tensors on %s",
                    len(recorded),
                    len(set(recorded)),
                    self.tier,
                )
            elif recorded != self.trace.keys:
                old = self.trace.keys
                at = next((i for i, (a, b) in enumerate(zip(old, recorded)) if a != b), min(len(old), len(recorded)))
                log.debug(
                    "tiermem: the access order changed at position %d (%d accesses, were %d); re-recorded the trace",
                    at,
                    len(recorded),
                    len(old),
                )
            ended_at = self._follow.pos
            self._follow.close_iteration()
            self._victims.next_iteration(self._follow.following(), ended_at)
            self._absent = None  # rebuilt from the registry by the next fetch-ahead
            self.history.append(self.current)
            self.current = ScheduleStats()
            self._fetch_ahead()

    def make_room(self, nbytes: int) -> None:
        """Evict released tensors (furthest next use first) until ``nbytes`` more fit on the tier.
        Installed as the tier ledger's ``reclaim`` so other users of the tier (activations,
        gradients in flight) can take room that prefetched tensors hold."""
        with self._lock:
            if self._connected is None:  # not serving yet: it holds nothing to give back
                return
            if self._reclaiming:  # a reservation made while evicting: do not recurse
                return
            self._reclaiming = True
            try:
                ledger = self._store.ledger
                free_wanted = ledger.allowed - ledger.used + nbytes  # what is free now, plus what is missing
                self._make_room("<reclaim>", free_wanted, excluded=self._pins.__contains__, required=False)
            finally:
                self._reclaiming = False

    def evict_all(self) -> None:
        """Evict every released managed tensor from the tier, writing modified ones back home."""
        with self._lock:
            for key in [k for k in self._tracked() if k not in self._pins and self._evictable_key(k)]:
                self._evict(key)

    # -- bookkeeping --------------------------------------------------------------------------
    def _residency(self, key: str) -> Residency:
        r = self.residency.registry.get(key)
        if r.home == self.tier:
            raise TierMemError(
                f"tiermem: {key!r} is homed on the {self.tier} tier, so it is always "
                f"resident there; acquire only tensors whose home is another tier"
            )
        if key not in self._sizes:
            self._sizes[key] = nbytes_of(r.info.shape, r.info.dtype)
        return r

    def _record(self, key: str) -> None:
        trace, at = self._follow.following(), self._follow.pos
        self._follow.record(key)
        if trace is not None and self._follow.following() is None:
            self._victims.follow(None)  # least recently used first until the iteration ends
            log.debug(
                "tiermem: access %d is %r, the trace expected %r; falling back to LRU without "
                "prefetch until the iteration ends",
                at,
                key,
                trace.keys[at] if at < len(trace) else "the end",
            )

    def _touch(self, key: str) -> None:
        self._clock += 1
        self._last_used[key] = self._clock
        self._victims.touched(key, self._follow.pos)

    def _unpin(self, key: str) -> None:
        n = self._pins.pop(key)
        if n > 1:
            self._pins[key] = n - 1

    def acquired(self) -> list[str]:
        """The keys acquired and not yet released (a module running, or autograd unpacking)."""
        return sorted(k for k, n in self._pins.items() if n)

    def _tracked(self) -> list[str]:
        return [] if self._connected is None else self._store.ledger.tracked(self._held)

    def _evictable_key(self, key: str) -> bool:  # managed and still here (the caller excludes the acquired)
        return key in self._held.keys and key in self.residency.registry and key in self._store

    def _manage(self, key: str) -> None:
        """``key``'s copy on the tier is resident or on its way, and evictable once released."""
        self._store.ledger.track(self._held, key)
        if self._absent is not None:
            self._absent.discard(key)

    def _absent_ahead(self, trace: AccessTrace) -> AbsentAhead:
        """The trace's keys that may be missing from the tier, up to date (NOTE [Fetch-ahead in O(window)])."""
        ledger, absent = self._store.ledger, self._absent
        released = ledger.drain_released(self._held)
        if absent is None or absent.trace is not trace:
            registry, tracked, tier = self.residency.registry, set(ledger.tracked(self._held)), self.tier
            here = {k for k in tracked if k in registry and _here(registry.get(k), tier)}
            absent = self._absent = AbsentAhead(trace, (k for k in dict.fromkeys(trace.keys) if k not in here))
        for key in released:
            absent.add(key)
        return absent

    # -- moves --------------------------------------------------------------------------------
    def _make_resident(self, r: Residency) -> Handle:
        key, stats = r.key, self.current
        stats.acquires += 1
        flight = r.in_flight  # read before `valid`: a move that lands in between has added to it
        if flight is None and self.tier in r.valid:
            stats.hits += 1
            handle = Handle.completed(None)
        elif flight is not None and flight[1] == self.tier:
            stats.late += 1
            handle = self.residency.prefetch(key, self.tier)  # joins the move in flight
        else:
            stats.misses += 1
            self._make_room(key, self._new_bytes(key), excluded=self._pins.__contains__, required=True)
            handle = self.residency.prefetch(key, self.tier)
            stats.bytes_fetched += self._sizes[key]
        self._manage(key)  # evictable once released, whoever brought it here
        return handle

    def _fetch_ahead(self) -> None:
        trace = self._follow.following()
        if not self.prefetch or trace is None:
            return
        absent = self._absent_ahead(trace)
        if not absent.any_from(self._follow.pos):
            return  # everything ahead is resident or on its way: the window would need nothing
        registry, tracked, pins = self.residency.registry, self._held.keys, self._pins  # `in`: atomic
        window = lookahead_window(trace, self._follow.pos, self._sizes, self._window_limit(), skip=self._pins)
        upcoming = set(window)
        outside: Callable[[str], bool] = lambda k: k in pins or k in upcoming  # noqa: E731
        for key in window:
            if key not in registry:
                continue  # deleted since the trace was recorded
            if _here(registry.get(key), self.tier):
                if key in tracked:
                    absent.discard(key)
                continue
            if not self._make_room(key, self._new_bytes(key), excluded=outside, required=False):
                return
            try:
                self.residency.prefetch(key, self.tier)
            except OutOfTierMemory:  # another user of the tier took the room meanwhile
                log.debug("tiermem: no room to prefetch %r ahead; it will be fetched on demand", key)
                return
            self._manage(key)
            self._touch(key)
            self.current.prefetches += 1
            self.current.bytes_prefetched += self._sizes[key]

    def _new_bytes(self, key: str) -> int:
        """Bytes that bringing ``key`` to the tier adds: a stale copy there is freed first."""
        return self._sizes[key] - self._store.ledger.held(key)

    def _window_limit(self) -> int:
        """Bytes the tensors fetched ahead may take: the budget less what is acquired and what
        tensors outside this scheduler hold on the tier, capped by ``lookahead_bytes``."""
        ledger = self._store.ledger
        managed = self._held.total  # a running total: NOTE [Fetch-ahead in O(window)]
        pinned = ledger.held_total(self._pins)
        room = ledger.allowed - (ledger.used - managed) - pinned
        return room if self.lookahead_bytes is None else min(room, self.lookahead_bytes)

    def _make_room(self, key: str, nbytes: int, *, excluded: Callable[[str], bool], required: bool) -> bool:
        """Evict released managed keys, but not ``excluded`` ones, until ``nbytes`` fit on the
        tier. NOTE [Room before allocation]"""
        ledger, asked_others = self._store.ledger, False
        while ledger.allowed - ledger.used < nbytes:
            victim = self._victims.victim(self._evictable_key, excluded)
            if victim is None and required and not asked_others and any(r is not self for r in ledger.reclaimers):
                asked_others = True  # bytes in flight elsewhere (grads still copying home) go once they land
                self._ask_others(nbytes - (ledger.allowed - ledger.used))
                continue
            if victim is None:
                if required:
                    raise self._too_small(key, nbytes)
                return False
            self._evict(victim)
        return True

    def _ask_others(self, missing: int) -> None:
        """The tier's other reclaimers give back what they can (this scheduler's own
        :meth:`make_room` is skipped: nothing of ours is left to evict)."""
        reclaiming, self._reclaiming = self._reclaiming, True  # a reservation they make: no recursion
        try:
            self._store.ledger.reclaim(missing, besides=self)
        finally:
            self._reclaiming = reclaiming

    def _evict(self, key: str) -> None:
        r = self.residency.registry.get(key)
        writeback = r.valid == {self.tier}
        nbytes = self._store.ledger.held(key)
        handle = self.residency.evict(key, self.tier)
        t0 = time.perf_counter()
        handle.wait()  # ordering: the bytes count against the budget until the write-back lands
        self.current.stall_seconds += time.perf_counter() - t0
        self._store.ledger.untrack(self._held, key)
        self.current.evictions += 1
        self.current.bytes_evicted += nbytes
        if writeback:
            self.current.writebacks += 1
            self.current.bytes_written_back += nbytes

    def _too_small(self, key: str, nbytes: int) -> OutOfTierMemory:
        ledger, tier = self._store.ledger, self.tier
        others = [k for k in self._pins if k != key]
        working = nbytes + sum(ledger.held(k) for k in others)
        foreign = ledger.used - sum(ledger.held(k) for k in others)
        needed = ledger.used + nbytes
        names = ", ".join(repr(k) for k in [key, *others][:4]) + (", ..." if len(others) > 3 else "")
        count = f"{len(others) + 1} tensors acquired at once" if others else "1 tensor"
        besides = f" besides {fmt_bytes(foreign)} held there by other tensors" if foreign > 0 else ""
        return OutOfTierMemory(
            tier=tier,
            key=key,
            asked=nbytes,
            used=ledger.used,
            allowed=ledger.allowed,
            hint=f"a module's working set ({count}: {names}) needs "
            f"{fmt_bytes(working)} on {tier}{besides}, budget {fmt_bytes(ledger.allowed)}; "
            f"raise Budgets({tier}=...) to at least {fmt_bytes(needed)}",
        )


def _here(r: Residency, tier: Tier) -> bool:
    """``r`` has a valid copy on ``tier``, or one on its way there."""
    return tier in r.valid or (r.in_flight is not None and r.in_flight[1] == tier)
