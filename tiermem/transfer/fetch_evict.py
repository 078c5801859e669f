"""The moves of a residency scheduler on its tier: fetch on demand, fetch ahead along the trace
(before one exists, along a guess: NOTE [Fetch ahead before a trace]), make room by evicting
released tensors, and count what they did.

:class:`~tiermem.transfer.schedule.ResidencyScheduler` keeps the bookkeeping of its callers (what
is acquired, the trace being followed) and hands each decision to carry out to :class:`FetchEvict`,
which keeps what the moves need (the keys it placed on the tier and their bytes, their sizes and
last uses, the trace's keys that may be missing there) and asks the pure decisions of
:mod:`tiermem.transfer.decisions` which keys to fetch and which to evict.

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
import time
from dataclasses import dataclass, fields
from typing import Callable, Mapping, Optional, Sequence

from tiermem.errors import OutOfTierMemory, TierMemError, fmt_bytes
from tiermem.handles import Handle
from tiermem.memory.ledger import HeldTotal, Reclaimer
from tiermem.memory.registry import Residency
from tiermem.memory.resident import MemoryStore, nbytes_of
from tiermem.transfer.decisions import AbsentAhead, AccessTrace, RepeatGuess, VictimQueue, lookahead_window
from tiermem.transfer.residency import KeyedResidency
from tiermem.types import Tier

log = logging.getLogger(__name__)


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


class FetchEvict:
    """Carries out a residency scheduler's fetch-ahead/evict policy on ``tier``: brings a key
    there on demand (:meth:`fetch_now`) or ahead of its use along the trace, as much as the window
    allows (:meth:`fetch_ahead`), and makes room by evicting released keys, furthest next use first
    (``belady``) or least recently used, asking the tier's other reclaimers once when that is not
    enough (NOTE [Room before allocation]). ``pins`` are the keys the scheduler has acquired (read
    here, never evicted); ``owner`` is the scheduler, the tier's reclaimer. ``stats`` counts this
    iteration's moves. Called under the scheduler's lock only."""

    def __init__(
        self,
        tier: Tier,
        *,
        pins: Mapping[str, int],
        owner: Reclaimer,
        prefetch: bool,
        lookahead_bytes: Optional[int],
        belady: bool,
    ):
        self.tier, self.prefetch, self.lookahead_bytes = tier, prefetch, lookahead_bytes
        self.stats = ScheduleStats()  # this iteration's
        self._pins, self._owner = pins, owner
        self._connected: Optional[tuple[KeyedResidency, MemoryStore]] = None
        self._held = HeldTotal()  # keys placed on the tier, and their bytes there (kept by the ledger)
        self._absent: Optional[AbsentAhead] = None  # NOTE [Fetch-ahead in O(window)]
        self._sizes: dict[str, int] = _Sizes(self)
        self._last_used: dict[str, int] = {}
        self._clock = 0
        self._victims = VictimQueue(self._last_used, self._tracked, belady=belady)
        self._reclaiming = False

    # -- connection ---------------------------------------------------------------------------
    def connect(self, residency: KeyedResidency, store: MemoryStore) -> None:
        """Move with ``residency``, over ``store``, its store of the tier."""
        self._connected = (residency, store)
        self._held = store.ledger.held_total_of()

    @property
    def connected(self) -> bool:
        return self._connected is not None

    @property
    def residency(self) -> KeyedResidency:
        return self._parts()[0]

    @property
    def store(self) -> MemoryStore:
        return self._parts()[1]

    def _parts(self) -> tuple[KeyedResidency, MemoryStore]:
        if self._connected is None:
            raise TierMemError(
                "tiermem: this ResidencyScheduler is not connected to a residency yet; "
                "call connect(residency) once the engine exists, before acquiring"
            )
        return self._connected

    # -- what the scheduler tells it ----------------------------------------------------------
    def touch(self, key: str, pos: int) -> None:
        """``key`` was used now, at trace position ``pos``."""
        self._clock += 1
        self._last_used[key] = self._clock
        self._victims.touched(key, pos)

    def leave_trace(self) -> None:
        """The iteration left its trace: least recently used first until it ends."""
        self._victims.follow(None)

    def next_iteration(self, trace: Optional[AccessTrace], ended_at: int) -> ScheduleStats:
        """An iteration ended at position ``ended_at``; the next one follows ``trace``. Returns
        the ended iteration's counters (``stats`` starts anew)."""
        self._victims.next_iteration(trace, ended_at)
        self._absent = None  # rebuilt from the registry by the next fetch-ahead
        ended, self.stats = self.stats, ScheduleStats()
        return ended

    # -- moves --------------------------------------------------------------------------------
    def fetch_now(self, r: Residency) -> Handle:
        """Bring ``r``'s tensor to the tier for an acquire (unless it is there or on its way),
        making room first; counts the acquire as a hit, late or a miss."""
        key, stats = r.key, self.stats
        if key not in self._sizes:
            self._sizes[key] = nbytes_of(r.info.shape, r.info.dtype)
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

    def fetch_ahead(self, trace: Optional[AccessTrace], pos: int) -> None:
        """Start bringing the keys ``trace`` uses from ``pos`` on, as many as the window holds
        (nothing without a trace, or with ``prefetch`` off)."""
        if not self.prefetch or trace is None:
            return
        absent = self._absent_ahead(trace)
        if not absent.any_from(pos):
            return  # everything ahead is resident or on its way: the window would need nothing
        self._bring(lookahead_window(trace, pos, self._sizes, self._window_limit(), skip=self._pins), pos, absent)

    def fetch_guessed(self, guess: RepeatGuess, recording: Sequence[str], pos: int) -> None:
        """Before any trace: start bringing the keys ``guess`` says the accesses so far repeat
        next (NOTE [Fetch ahead before a trace])."""
        if self.prefetch and guess.guessing:
            self._bring(guess.ahead(recording, self._sizes, self._window_limit(), skip=self._pins), pos, None)

    def _bring(self, window: list[str], pos: int, absent: Optional[AbsentAhead]) -> None:
        """Start bringing ``window``'s keys (in order, until the room runs out), keeping the keys
        of the window and the acquired ones."""
        registry, tracked, pins = self.residency.registry, self._held.keys, self._pins  # `in`: atomic
        upcoming = set(window)
        outside: Callable[[str], bool] = lambda k: k in pins or k in upcoming  # noqa: E731
        for key in window:
            if key not in registry:
                continue  # deleted since the trace was recorded
            if _here(registry.get(key), self.tier):
                if key in tracked and absent is not None:
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
            self.touch(key, pos)
            self.stats.prefetches += 1
            self.stats.bytes_prefetched += self._sizes[key]

    def reclaim(self, nbytes: int) -> None:
        """Evict released keys until ``nbytes`` more fit on the tier (the scheduler's
        ``make_room``; nothing while not connected, or while a reclaim of its own runs)."""
        if self._connected is None or self._reclaiming:  # a reservation made while evicting: no recursion
            return
        self._reclaiming = True
        try:
            ledger = self.store.ledger
            free_wanted = ledger.allowed - ledger.used + nbytes  # what is free now, plus what is missing
            self._make_room("<reclaim>", free_wanted, excluded=self._pins.__contains__, required=False)
        finally:
            self._reclaiming = False

    def evict_all(self) -> None:
        """Evict every released key it placed on the tier, writing modified ones back home."""
        for key in [k for k in self._tracked() if k not in self._pins and self._evictable_key(k)]:
            self._evict(key)

    # -- what the moves keep ------------------------------------------------------------------
    def _tracked(self) -> list[str]:
        return [] if self._connected is None else self.store.ledger.tracked(self._held)

    def _evictable_key(self, key: str) -> bool:  # managed and still here (the caller excludes the acquired)
        return key in self._held.keys and key in self.residency.registry and key in self.store

    def _manage(self, key: str) -> None:
        """``key``'s copy on the tier is resident or on its way, and evictable once released."""
        self.store.ledger.track(self._held, key)
        if self._absent is not None:
            self._absent.discard(key)

    def _absent_ahead(self, trace: AccessTrace) -> AbsentAhead:
        """The trace's keys that may be missing from the tier, up to date (NOTE [Fetch-ahead in O(window)])."""
        ledger, absent = self.store.ledger, self._absent
        released = ledger.drain_released(self._held)
        if absent is None or absent.trace is not trace:
            registry, tracked, tier = self.residency.registry, set(ledger.tracked(self._held)), self.tier
            here = {k for k in tracked if k in registry and _here(registry.get(k), tier)}
            absent = self._absent = AbsentAhead(trace, (k for k in dict.fromkeys(trace.keys) if k not in here))
        for key in released:
            absent.add(key)
        return absent

    def _new_bytes(self, key: str) -> int:
        """Bytes that bringing ``key`` to the tier adds: a stale copy there is freed first."""
        return self._sizes[key] - self.store.ledger.held(key)

    def _window_limit(self) -> int:
        """Bytes the tensors fetched ahead may take: the budget less what is acquired and what
        tensors outside this scheduler hold on the tier, capped by ``lookahead_bytes``."""
        ledger = self.store.ledger
        managed = self._held.total  # a running total: NOTE [Fetch-ahead in O(window)]
        pinned = ledger.held_total(self._pins)
        room = ledger.allowed - (ledger.used - managed) - pinned
        return room if self.lookahead_bytes is None else min(room, self.lookahead_bytes)

    # -- making room --------------------------------------------------------------------------
    def _make_room(self, key: str, nbytes: int, *, excluded: Callable[[str], bool], required: bool) -> bool:
        """Evict released managed keys, but not ``excluded`` ones, until ``nbytes`` fit on the
        tier. NOTE [Room before allocation]"""
        ledger, owner, asked_others = self.store.ledger, self._owner, False
        while ledger.allowed - ledger.used < nbytes:
            victim = self._victims.victim(self._evictable_key, excluded)
            if victim is None and required and not asked_others and any(r is not owner for r in ledger.reclaimers):
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
        """The tier's other reclaimers give back what they can (the scheduler's own
        ``make_room`` is skipped: nothing of ours is left to evict)."""
        reclaiming, self._reclaiming = self._reclaiming, True  # a reservation they make: no recursion
        try:
            self.store.ledger.reclaim(missing, besides=self._owner)
        finally:
            self._reclaiming = reclaiming

    def _evict(self, key: str) -> None:
        r = self.residency.registry.get(key)
        writeback = r.valid == {self.tier}
        nbytes = self.store.ledger.held(key)
        handle = self.residency.evict(key, self.tier)
        t0 = time.perf_counter()
        handle.wait()  # ordering: the bytes count against the budget until the write-back lands
        self.stats.stall_seconds += time.perf_counter() - t0
        self.store.ledger.untrack(self._held, key)
        self.stats.evictions += 1
        self.stats.bytes_evicted += nbytes
        if writeback:
            self.stats.writebacks += 1
            self.stats.bytes_written_back += nbytes

    def _too_small(self, key: str, nbytes: int) -> OutOfTierMemory:
        ledger, tier = self.store.ledger, self.tier
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


class _Sizes(dict[str, int]):
    """Each key's bytes on the tier, read from the registry the first time a key is asked for
    (a key guessed ahead of its first use: NOTE [Fetch ahead before a trace]); 0 for a key not
    registered (there is nothing to bring)."""

    def __init__(self, moves: FetchEvict):
        super().__init__()
        self._moves = moves

    def __missing__(self, key: str) -> int:
        registry = self._moves.residency.registry
        if key not in registry:
            return 0
        r = registry.get(key)
        size = self[key] = nbytes_of(r.info.shape, r.info.dtype)
        return size


def _here(r: Residency, tier: Tier) -> bool:
    """``r`` has a valid copy on ``tier``, or one on its way there."""
    return tier in r.valid or (r.in_flight is not None and r.in_flight[1] == tier)
