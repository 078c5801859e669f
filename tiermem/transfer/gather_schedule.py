"""When a sharded bucket is gathered, kept or freed: decisions that every rank takes alike.

# NOTE [A gather schedule every rank takes alike]
Gathering a bucket's weights is a collective: every rank must issue the same gathers in the same
order, or the ranks pair one bucket's gather with another's. So, unlike the one-process
:class:`~tiermem.transfer.schedule.ResidencyScheduler`, nothing here looks at memory (activations,
and so the room left on a device, differ between ranks): each decision is a pure function of the
sequence of accesses (acquire and release of bucket keys), of the bucket sizes and of a lookahead
in bytes, all identical on every rank that runs the same forward and backward.

- An *acquire* of a bucket not gathered gathers it (on demand); every acquire is recorded.
- With a trace (the previous iteration's accesses, the same on every rank: checked at the end of
  each iteration) and while this iteration follows it, each acquire also gathers ahead the next
  buckets of the trace, as many as fit in ``ahead`` bytes (the *window*, as
  :func:`~tiermem.transfer.decisions.lookahead_window` reads it), and frees the gathered buckets no
  one holds that are not in the window. A *release* that leaves a bucket unheld keeps it only if it
  is in the window.
- Without a trace (the first iteration), or once an iteration leaves the trace: no gather ahead,
  and the released buckets stay gathered as a cache of at most ``ahead`` bytes, the least
  recently released freed first.

So at any time the gathered buckets are the held ones plus at most ``ahead`` bytes of others.
:meth:`GatherSchedule.free_all` (new weights are about to be written) frees every unheld bucket;
:meth:`GatherSchedule.end_iteration` turns the iteration's accesses into the next trace.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Mapping

from tiermem.transfer.decisions import TraceFollower, lookahead_window


class GatherSchedule(TraceFollower):
    """The decisions of NOTE [A gather schedule every rank takes alike], for buckets by key.
    ``sizes``: the bytes each bucket takes gathered; ``ahead``: the bytes gathered ahead of use
    (or kept after it) besides the held buckets; ``prefetch=False`` never gathers ahead. The
    accesses are followed against the trace as :class:`~tiermem.transfer.decisions.TraceFollower`
    does (``trace``, ``recording``, ``pos``, ``on_trace``)."""

    def __init__(self, sizes: Mapping[str, int], ahead: int, *, prefetch: bool = True):
        super().__init__()
        self.sizes, self.ahead, self.prefetch = dict(sizes), int(ahead), prefetch
        self.held: Counter[str] = Counter()
        self.gathered: OrderedDict[str, None] = OrderedDict()  # oldest release first

    def window(self) -> list[str]:
        """The buckets the trace uses next, within ``ahead`` bytes (empty off the trace). Held
        buckets count too, so the window at an acquire and at the release that follows is one."""
        trace = self.following()
        if trace is None:
            return []
        return lookahead_window(trace, self.pos, self.sizes, self.ahead)

    def _outside(self, window: list[str]) -> list[str]:
        """On the trace: the gathered buckets no one holds outside ``window``, to free."""
        free = [k for k in self.gathered if not self.held[k] and k not in window]
        for k in free:
            del self.gathered[k]
        return free

    def acquire(self, key: str) -> tuple[list[str], list[str]]:
        """``key`` is about to be used: (the buckets to gather now, in this order: ``key`` first
        when it is not gathered, then those ahead; the buckets to free first)."""
        self.record(key)
        self.held[key] += 1
        gather = [] if key in self.gathered else [key]
        self.gathered[key] = None
        self.gathered.move_to_end(key)
        if self.following() is None:
            free = self._trim()
        else:
            window = self.window()
            free = self._outside(window)
            ahead = [k for k in window if k not in self.gathered] if self.prefetch else []
            gather += ahead
            self.gathered.update((k, None) for k in ahead)
        return gather, free

    def release(self, key: str) -> list[str]:
        """``key``'s use ended: the buckets to free now (``key`` among them, unless it is kept)."""
        self.held[key] -= 1
        if self.held[key]:
            return []
        del self.held[key]
        self.gathered.move_to_end(key)
        return self._outside(self.window()) if self.following() is not None else self._trim()

    def _trim(self) -> list[str]:
        """Off the trace: the least recently released unheld buckets past ``ahead`` bytes, to free."""
        kept = [k for k in self.gathered if not self.held[k]]
        total = sum(self.sizes[k] for k in kept)
        free = []
        for k in kept:
            if total <= self.ahead:
                break
            free.append(k)
            total -= self.sizes[k]
        for k in free:
            del self.gathered[k]
        return free

    def free_all(self) -> list[str]:
        """Every unheld gathered bucket, to free (their weights are about to change)."""
        free = [k for k in self.gathered if not self.held[k]]
        for k in free:
            del self.gathered[k]
        return free

    def end_iteration(self, *, agreed: bool = True) -> tuple[list[str], list[str]]:
        """The iteration's accesses become the trace (an iteration with none keeps the old one;
        ``agreed=False``, the ranks' accesses differed: no trace until an iteration they agree
        on); returns what to gather, and to free first, ahead of the next iteration's accesses."""
        self.close_iteration(agreed=agreed)
        if not self.prefetch or self.trace is None:
            return [], self._trim()
        window = self.window()
        free = self._outside(window)
        gather = [k for k in window if k not in self.gathered]
        self.gathered.update((k, None) for k in gather)
        return gather, free
