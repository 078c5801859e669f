"""The decisions of trace-driven residency, pure and knowing nothing of tensors: what a recorded
iteration says about the next use of a key (:class:`AccessTrace`), which released key to evict
(:func:`choose_victim`: the one used furthest ahead, Belady, else the least recently used) and
which keys to fetch ahead (:func:`lookahead_window`: the next ones in trace order, as many as fit),
and whether the iteration running follows the recorded one (:class:`TraceFollower`); before any
iteration was recorded, what the accesses so far say comes next (:class:`RepeatGuess`).

:class:`~tiermem.transfer.schedule.ResidencyScheduler` carries them out for weights off the
device (its :class:`~tiermem.transfer.fetch_evict.FetchEvict` makes the moves), :class:`~tiermem.transfer.gather_schedule.GatherSchedule` for gathers of sharded ones.
"""

from __future__ import annotations

import bisect
import heapq
import math
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

__all__ = [
    "AccessTrace",
    "AbsentAhead",
    "RepeatGuess",
    "TraceFollower",
    "VictimQueue",
    "choose_victim",
    "lookahead_window",
]


class AccessTrace:
    """One iteration's sequence of acquired keys, frozen, answering "when is ``key`` used next?".

    The trace repeats: a key not used again in this iteration is next used at its first
    position plus the trace's length (the next iteration); a key absent from it, never.
    """

    def __init__(self, keys: Sequence[str]):
        self.keys = tuple(keys)
        self._positions: dict[str, list[int]] = {}
        for i, key in enumerate(self.keys):
            self._positions.setdefault(key, []).append(i)

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self._positions

    def next_use(self, key: str, pos: int) -> float:
        """Position of ``key``'s first access at or after ``pos`` (``math.inf``: never)."""
        at = self._positions.get(key)
        if not at:
            return math.inf
        i = bisect.bisect_left(at, pos)
        return at[i] if i < len(at) else at[0] + len(self.keys)

    def last_position(self, key: str) -> int:
        """Position of ``key``'s last access in the trace (-1: never accessed)."""
        at = self._positions.get(key)
        return at[-1] if at else -1


class AbsentAhead:
    """The keys of a trace that may be missing from the fast tier, answering "is any of them used
    at or after ``pos``?" in O(log n) (NOTE [Fetch-ahead in O(window)] in
    :mod:`tiermem.transfer.fetch_evict`). Over-reporting is allowed (a key here may be resident: the
    caller then looks and finds nothing to do); under-reporting is not. A max-heap of last
    positions, its entries for keys since discarded dropped when they reach the top."""

    def __init__(self, trace: AccessTrace, keys: Iterable[str] = ()):
        self.trace = trace
        self._keys: set[str] = set()
        self._heap: list[tuple[int, str]] = []
        for key in keys:
            self.add(key)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def add(self, key: str) -> None:
        """``key`` may be missing now (a key the trace never uses is left out: never needed)."""
        if key not in self._keys and key in self.trace:
            self._keys.add(key)
            heapq.heappush(self._heap, (-self.trace.last_position(key), key))

    def discard(self, key: str) -> None:
        """``key`` is resident, or on its way (until :meth:`add` says otherwise)."""
        self._keys.discard(key)

    def any_from(self, pos: int) -> bool:
        """Whether a key that may be missing is accessed at trace position ``pos`` or later."""
        heap = self._heap
        while heap and heap[0][1] not in self._keys:
            heapq.heappop(heap)
        return bool(heap) and -heap[0][0] >= pos


class TraceFollower:
    """The accesses of the iteration running, checked against the trace of an earlier one.

    :meth:`record` each access; :meth:`following` gives the trace while every access so far was
    the one it expected (once one is not, ``None`` until the iteration ends); :meth:`close_iteration`
    makes the recorded accesses the next trace. ``pos`` counts the accesses so far, so while
    following it is also the index in the trace of the next expected access.
    """

    def __init__(self) -> None:
        self.trace: Optional[AccessTrace] = None
        self.recording: list[str] = []
        self.pos = 0  # accesses so far in this iteration
        self.on_trace = True  # this iteration has followed the trace so far

    def following(self) -> Optional[AccessTrace]:
        """The trace, while this iteration follows it."""
        return self.trace if self.on_trace else None

    def record(self, key: str) -> None:
        """``key`` is this iteration's next access (it leaves the trace unless expected there)."""
        trace = self.following()
        if trace is not None and not (self.pos < len(trace) and trace.keys[self.pos] == key):
            self.on_trace = False
        self.recording.append(key)
        self.pos += 1

    def close_iteration(self, *, agreed: bool = True) -> None:
        """The iteration's accesses become the trace (an iteration with none keeps the old one;
        ``agreed=False`` drops the trace), and the next iteration starts on it."""
        if not agreed:
            self.trace = None
        elif self.recording and (self.trace is None or tuple(self.recording) != self.trace.keys):
            self.trace = AccessTrace(self.recording)
        self.recording, self.pos, self.on_trace = [], 0, True


def choose_victim(
    candidates: Iterable[str], last_used: Mapping[str, int], *, trace: Optional[AccessTrace] = None, pos: int = 0
) -> Optional[str]:
    """The candidate to evict: with a trace, the one used furthest after ``pos`` (Belady), ties
    going to the least recently used; without one, the least recently used. None if no candidate.
    ``last_used`` maps keys to a growing counter; a key missing from it counts as oldest."""
    best, best_rank = None, None
    for key in candidates:
        recency = last_used.get(key, -1)
        rank = (trace.next_use(key, pos), -recency) if trace is not None else (0.0, -recency)
        if best_rank is None or rank > best_rank:
            best, best_rank = key, rank
    return best


class VictimQueue:
    """:func:`choose_victim`'s answer without scanning the candidates: heaps of keys by rank, an
    entry pushed each time a key is touched (its recency changes) and checked when it reaches the
    top (a newer touch, or a key no longer managed, makes it stale).

    # NOTE [Victims in order]
    While an iteration follows its trace, a released key's next use does not move: the position
    only passes it by acquiring it. Counted from the first followed iteration (``base`` adds each
    finished iteration's length), it does not move across iterations either, so Belady's rank
    (next use, then least recent) is fixed from one touch to the next and a heap keeps the order.
    A new trace re-ranks every key (rebuilt from ``keys()``); off the trace (and with
    ``belady=False``) the least recently used goes first, from a heap of recencies.
    """

    def __init__(self, last_used: Mapping[str, int], keys: Callable[[], Iterable[str]], *, belady: bool = True):
        self._last_used, self._keys, self._belady = last_used, keys, belady
        self._trace: Optional[AccessTrace] = None  # the trace followed now; None: least recently used
        self._base = 0  # absolute position of the trace's start in this iteration
        self._lru: list[tuple[int, str]] = []  # (recency, key)
        self._ahead: list[tuple[float, int, str]] = []  # (-absolute next use, recency, key)
        self._rebuilt = 0  # entries after the last rebuild (a rebuild drops the stale ones)

    def follow(self, trace: Optional[AccessTrace], pos: int = 0) -> None:
        """From now on the accesses follow ``trace`` (None: no trace); every key re-ranked."""
        self._trace, self._base = (trace if self._belady else None), 0
        self._rebuild(pos)

    def next_iteration(self, trace: Optional[AccessTrace], ended_at: int) -> None:
        """An iteration ended at trace position ``ended_at``; the next one follows ``trace``."""
        if trace is not None and trace is self._trace:
            self._base += ended_at  # the same trace again: ranks carry over (NOTE [Victims in order])
        else:
            self.follow(trace)

    def touched(self, key: str, pos: int) -> None:
        """``key``'s recency changed (read from ``last_used``) at trace position ``pos``."""
        recency = self._last_used[key]
        heapq.heappush(self._lru, (recency, key))
        if self._trace is not None:
            heapq.heappush(self._ahead, (-(self._base + self._trace.next_use(key, pos)), recency, key))
        if len(self._lru) > 2 * self._rebuilt + 256:
            self._rebuild(pos)

    def victim(self, managed: Callable[[str], bool], excluded: Callable[[str], bool]) -> Optional[str]:
        """The managed key not in ``excluded`` that :func:`choose_victim` would pick (None: none)."""
        heap: list[Any] = self._ahead if self._trace is not None else self._lru
        aside, found = [], None
        while heap:
            entry = heapq.heappop(heap)
            key, recency = entry[-1], entry[-2]
            if self._last_used.get(key) != recency or not managed(key):
                continue  # stale: touched since, or gone
            if excluded(key):
                aside.append(entry)
                continue
            found = key
            heapq.heappush(heap, entry)  # still managed until it is evicted
            break
        for entry in aside:
            heapq.heappush(heap, entry)
        return found

    def _rebuild(self, pos: int) -> None:
        keys = [k for k in self._keys() if k in self._last_used]
        self._lru = [(self._last_used[k], k) for k in keys]
        heapq.heapify(self._lru)
        trace, base = self._trace, self._base
        self._ahead = [] if trace is None else [(-(base + trace.next_use(k, pos)), self._last_used[k], k) for k in keys]
        heapq.heapify(self._ahead)
        self._rebuilt = len(keys)


def lookahead_window(
    trace: AccessTrace, pos: int, sizes: Mapping[str, int], limit: int, *, skip: Iterable[str] = ()
) -> list[str]:
    """The distinct keys of ``trace`` from ``pos`` to its end, in order of next use, as many as
    fit in ``limit`` bytes together. Stops at the first key that does not fit (fetching past it
    would bring in later tensors before an earlier one). Keys in ``skip`` (acquired already,
    counted elsewhere) are passed over without counting."""
    keys = trace.keys
    return _fill((keys[i] for i in range(pos, len(keys))), sizes, limit, skip)  # lazy: O(window), not O(trace)


def _fill(keys: Iterable[str], sizes: Mapping[str, int], limit: int, skip: Iterable[str]) -> list[str]:
    """``keys``' distinct ones, in order, as many as fit in ``limit`` bytes together (stopping at
    the first that does not), those in ``skip`` passed over uncounted."""
    seen, window, total = set(skip), [], 0
    for key in keys:
        if key in seen:
            continue
        if total + sizes[key] > limit:
            break
        seen.add(key)
        window.append(key)
        total += sizes[key]
    return window


#: the most keys :meth:`RepeatGuess.ahead` looks at (keys used again are passed over uncounted)
WALK = 512


class RepeatGuess:
    """What comes next in the first iteration, before any trace exists.

    # NOTE [Fetch ahead before a trace]
    Without a trace nothing is fetched ahead (NOTE in :mod:`tiermem.transfer.schedule`), and a first
    iteration whose weights stream from NVMe waits for each of them: 13B's first step took 1.44x
    its serial floor, the next ones 1.01-1.21x. Yet most of a first iteration repeats what it did
    already. Backward uses the weights forward used, in reverse (autograd runs the graph backwards);
    ``update_in_backward``'s second pass repeats the first; a second micro-batch's forward repeats
    the first's. So each access is looked up in the iteration's own accesses so far: when two
    consecutive accesses are, in the same order, two neighbouring earlier ones (a key at position
    ``j`` right after one whose previous use was ``j - 1``, or ``j + 1``), the run is taken to go on
    from ``j`` in that direction (``step`` +1 or -1), over the accesses recorded before the run
    began, and the window fetches its next keys as a trace's would. Each access that is the
    expected one moves the run on; any other ends it (until two accesses start another). Where no
    run goes on and the key just used is used for the first time (the first forward), the keys
    follow ``order``, the order the caller registered them in (a module's parameters, in the order
    its submodules are defined), from that key: right block by block where it is wrong within one
    (Llama's norms are defined after its projections but run before them). A guess that is wrong
    costs what a prefetch costs (room and bytes read, evicted least recently used first; with
    activation checkpointing, a run after a block's recompute walks into blocks already done);
    the walk looks at no more than :data:`WALK` keys. Once an iteration has ended, its trace
    replaces all this.
    """

    def __init__(self, order: Sequence[str] = ()) -> None:
        self.order = tuple(order)
        self._order_at = {k: i for i, k in enumerate(self.order)}
        self._last: Optional[str] = None  # the newest access, when it was that key's first
        self.latest: dict[str, int] = {}  # key -> its latest position among the accesses
        self._prev_at: Optional[int] = None  # the previous access's earlier position, if it had one
        self.anchor: Optional[int] = None  # the position the run matched last (None: no run)
        self.step = 0
        self.start = 0  # the run's own first access: it repeats the accesses before it

    def record(self, recording: Sequence[str], pos: int) -> None:
        """``recording[pos]`` is the newest access (``recording`` holds every access so far)."""
        key = recording[pos]
        j = self.latest.get(key)
        anchor = self.anchor
        if anchor is not None and 0 <= anchor + self.step < self.start and recording[anchor + self.step] == key:
            self.anchor = anchor + self.step  # the run goes on
        elif j is not None and self._prev_at is not None and abs(j - self._prev_at) == 1:
            self.anchor, self.step, self.start = j, j - self._prev_at, pos - 1
        else:
            self.anchor = None
        self._prev_at, self._last = j, key if j is None else None
        self.latest[key] = pos

    @property
    def guessing(self) -> bool:
        """Whether :meth:`ahead` would name any key."""
        return self.anchor is not None or self._last in self._order_at

    def ahead(
        self, recording: Sequence[str], sizes: Mapping[str, int], limit: int, *, skip: Iterable[str] = ()
    ) -> list[str]:
        """The run's next distinct keys (before any repeat, ``order``'s after the newest access), as
        many as fit in ``limit`` bytes together (as :func:`lookahead_window`: it stops at the first
        that does not fit); none without either."""
        if self.anchor is not None:
            keys, i, end, step = recording, self.anchor + self.step, self.start, self.step
        elif self.guessing:
            assert self._last is not None
            keys, i, end, step = self.order, self._order_at[self._last] + 1, len(self.order), 1
        else:
            return []
        bound = min(end, i + WALK) if step > 0 else max(-1, i - WALK)
        return _fill((keys[j] for j in range(i, bound, step)), sizes, limit, skip)
