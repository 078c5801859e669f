"""Progress of long work (building a model from a checkpoint, saving one): bytes done of the total,
the rate and the time left, logged at most every few seconds and once at the end, so a user
building a 13B model sees it move. The library logs; the CLI and the user's logging config show it."""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from tiermem.errors import fmt_bytes

log = logging.getLogger(__name__)

__all__ = ["Progress"]


class Progress:
    """``what`` (a few words), ``total`` bytes; :meth:`advance` as bytes are done, :meth:`close` at the
    end. ``every``: the least seconds between two lines; ``clock``: for tests."""

    def __init__(
        self, what: str, total: int, *, every: float = 5.0, clock: Optional[Callable[[], float]] = None
    ) -> None:
        self.what, self.total, self.every = what, total, every
        self.clock = time.perf_counter if clock is None else clock
        self.done = 0
        self.started = self.last = self.clock()

    def line(self) -> str:
        elapsed = max(self.clock() - self.started, 1e-9)
        rate = self.done / elapsed
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = f"{left:.0f} s left" if left != float("inf") else "time left unknown"
        return f"tiermem: {self.what}: {fmt_bytes(self.done)} of {fmt_bytes(self.total)} ({fmt_bytes(rate)}/s, {eta})"

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = self.clock()
        if now - self.last >= self.every:
            self.last = now
            log.info("%s", self.line())

    def close(self) -> None:
        elapsed = self.clock() - self.started
        log.info(
            "tiermem: %s: %s in %.1f s (%s/s)",
            self.what,
            fmt_bytes(self.done),
            elapsed,
            fmt_bytes(self.done / max(elapsed, 1e-9)),
        )
