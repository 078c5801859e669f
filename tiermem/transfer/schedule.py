"""Trace-driven residency: which managed tensors sit on a fast tier, fetched ahead of use and
evicted by furthest next use.

The first iteration records the order in which managed tensors are acquired. Later iterations
follow that trace: each acquire prefetches the tensors used next, as many as fit in the
lookahead, and when room is needed the released tensor whose next use lies furthest ahead is
evicted (Belady). Without a trace (the first iteration, or one that left the recorded order),
victims are the least recently used; in the first iteration, what repeats its own earlier accesses
(backward, after forward) is fetched ahead (NOTE [Fetch ahead before a trace] in
:mod:`tiermem.transfer.decisions`), else nothing is.

The decisions (``AccessTrace``, ``choose_victim``, ``lookahead_window``) are pure and know
nothing of tensors: they live in :mod:`tiermem.transfer.decisions` (and are importable from here
too). :class:`ResidencyScheduler` keeps its callers' bookkeeping (what is acquired, modified, the
trace being recorded) and hands the moves to a :class:`~tiermem.transfer.fetch_evict.FetchEvict`,
which carries the decisions out with the moves of a
:class:`~tiermem.transfer.residency.KeyedResidency` only (NOTE [Room before allocation], NOTE
[Fetch-ahead in O(window)] in :mod:`tiermem.transfer.fetch_evict`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Optional

import torch

from tiermem.config.budgets import ByteSize, parse_bytes
from tiermem.errors import ConfigError, TierMemError
from tiermem.memory.ledger import Reclaimer
from tiermem.memory.registry import Residency
from tiermem.memory.resident import MemoryStore
from tiermem.transfer.decisions import (
    AccessTrace,
    RepeatGuess,
    TraceFollower,
    choose_victim as choose_victim,  # importable from here too
    lookahead_window as lookahead_window,
)
from tiermem.transfer.fetch_evict import FetchEvict, ScheduleStats as ScheduleStats
from tiermem.transfer.residency import KeyedResidency
from tiermem.types import Tier

log = logging.getLogger(__name__)

EVICTION_POLICIES = ("belady", "lru")


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

    Its job is the callers' bookkeeping: what is acquired (and how often), what was modified, the
    trace being recorded and followed, the counters of each iteration. Every move (fetch on demand,
    fetch ahead, make room, evict) it hands to its :class:`~tiermem.transfer.fetch_evict.FetchEvict`.

    It is the tier's cache, so the tier's store is given it as a reclaimer when built (NOTE
    [Reclaimers at construction] in :mod:`tiermem.memory.ledger`): build the scheduler first,
    then the stores, the engine and the residency over them, then :meth:`connect` it to that
    residency (once), before the first acquire.
    """

    _moves_type: type[FetchEvict] = FetchEvict  # what carries out the moves (a test swaps in a reference)

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
        lookahead = (
            None if lookahead_bytes is None else parse_bytes(lookahead_bytes, what="ResidencyScheduler.lookahead_bytes")
        )
        self.tier, self.eviction = tier, eviction
        self._follow = TraceFollower()  # this iteration's accesses against the trace
        self._guess = RepeatGuess()  # before any trace: NOTE [Fetch ahead before a trace]
        self.history: list[ScheduleStats] = []  # one entry per finished iteration
        self._lock = threading.RLock()
        self._pins: dict[str, int] = {}  # acquired key -> open acquires
        self._moves = self._moves_type(
            tier,
            pins=self._pins,
            owner=self,
            prefetch=bool(prefetch),
            lookahead_bytes=lookahead,
            belady=eviction == "belady",
        )

    def connect(self, residency: KeyedResidency) -> "ResidencyScheduler":
        """Carry out the schedule with ``residency``'s moves, over its store of the tier (once)."""
        if self._moves.connected:
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
        self._moves.connect(residency, store)
        return self

    @property
    def residency(self) -> KeyedResidency:
        return self._moves.residency

    @property
    def prefetch(self) -> bool:
        """Whether tensors are fetched ahead of use (else only on demand)."""
        return self._moves.prefetch

    @property
    def lookahead_bytes(self) -> Optional[int]:
        """The cap on the bytes fetched ahead (None: the room the budget leaves)."""
        return self._moves.lookahead_bytes

    @property
    def trace(self) -> Optional[AccessTrace]:
        """The recorded iteration's accesses (None before the first iteration ends)."""
        return self._follow.trace

    @property
    def current(self) -> ScheduleStats:
        """The counters of the iteration running."""
        return self._moves.stats

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
                handle = self._moves.fetch_now(r)
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
        return self._moves.store.get(key)

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

    def expect(self, order: list[str]) -> None:
        """The keys in the order their owner registered them: the first iteration's guess of its
        first accesses (NOTE [Fetch ahead before a trace])."""
        with self._lock:
            if self._follow.trace is None and not self._follow.recording:
                self._guess = RepeatGuess(order)

    def end_iteration(self) -> None:
        """Close the iteration: freeze (or check and renew) the trace, then fetch ahead of the
        next iteration's first accesses."""
        with self._lock:
            self._log_trace(tuple(self._follow.recording))
            ended_at = self._follow.pos
            self._follow.close_iteration()
            if self._follow.trace is None:  # an iteration with no access: still the first
                self._guess = RepeatGuess(self._guess.order)
            self.history.append(self._moves.next_iteration(self._follow.following(), ended_at))
            self._fetch_ahead()

    def make_room(self, nbytes: int) -> None:
        """Evict released tensors (furthest next use first) until ``nbytes`` more fit on the tier.
        Installed as the tier ledger's ``reclaim`` so other users of the tier (activations,
        gradients in flight) can take room that prefetched tensors hold."""
        with self._lock:
            self._moves.reclaim(nbytes)  # nothing while not connected: it holds nothing to give back

    def evict_all(self) -> None:
        """Evict every released managed tensor from the tier, writing modified ones back home."""
        with self._lock:
            self._moves.evict_all()

    def acquired(self) -> list[str]:
        """The keys acquired and not yet released (a module running, or autograd unpacking)."""
        return sorted(k for k, n in self._pins.items() if n)

    # -- bookkeeping --------------------------------------------------------------------------
    def _residency(self, key: str) -> Residency:
        r = self.residency.registry.get(key)
        if r.home == self.tier:
            raise TierMemError(
                f"tiermem: {key!r} is homed on the {self.tier} tier, so it is always "
                f"resident there; acquire only tensors whose home is another tier"
            )
        return r

    def _record(self, key: str) -> None:
        trace, at = self._follow.following(), self._follow.pos
        self._follow.record(key)
        if self._follow.trace is None:  # the first iteration
            self._guess.record(self._follow.recording, at)
        if trace is not None and self._follow.following() is None:
            self._moves.leave_trace()  # least recently used first until the iteration ends
            log.debug(
                "tiermem: access %d is %r, the trace expected %r; falling back to LRU without "
                "prefetch until the iteration ends",
                at,
                key,
                trace.keys[at] if at < len(trace) else "the end",
            )

    def _log_trace(self, recorded: tuple[str, ...]) -> None:
        """Say at the end of an iteration what its accesses do to the trace."""
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

    def _touch(self, key: str) -> None:
        self._moves.touch(key, self._follow.pos)

    def _fetch_ahead(self) -> None:
        if self._follow.trace is None:
            self._moves.fetch_guessed(self._guess, self._follow.recording, self._follow.pos)
        else:
            self._moves.fetch_ahead(self._follow.following(), self._follow.pos)

    def _unpin(self, key: str) -> None:
        n = self._pins.pop(key)
        if n > 1:
            self._pins[key] = n - 1
