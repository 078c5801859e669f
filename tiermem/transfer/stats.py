"""What the report says about transfers: bytes moved, seconds the lanes were busy (for a GPU copy:
its own time on its stream, so bytes over busy seconds is the link's bandwidth), seconds callers
stalled. Every move is counted here and nowhere else: the engine's lanes and its store requests
call :meth:`TransferStats.count`, and every handle the engine returns reports its waits to a
:meth:`TransferStats.stall_sink`."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from tiermem.types import TensorClass, Tier


@dataclass
class TransferStats:
    """Counters the report reads: bytes per (src, dst) (and per tensor class), seconds the lanes
    were busy, and seconds callers stalled waiting, per destination tier. ``tracer``, if set,
    receives a span for every counted move."""

    bytes_moved: dict[tuple[Tier, Tier], int] = field(default_factory=lambda: defaultdict(int))
    class_bytes_moved: dict[tuple[TensorClass, Tier, Tier], int] = field(default_factory=lambda: defaultdict(int))
    busy_seconds: dict[tuple[Tier, Tier], float] = field(default_factory=lambda: defaultdict(float))
    stall_seconds: dict[Tier, float] = field(default_factory=lambda: defaultdict(float))
    tracer: Any = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _sinks: dict[Tier, Callable[[float], None]] = field(default_factory=dict, repr=False)

    def count(
        self,
        src: Tier,
        dst: Tier,
        *,
        t0: Optional[float] = None,
        nbytes: Optional[int] = None,
        kind: Optional[TensorClass] = None,
        seconds: Optional[float] = None,
    ) -> None:
        """Count one move from ``src`` to ``dst``: busy from ``t0`` until now (``None``: it took
        no lane time, e.g. a copy within one tier), or for ``seconds`` ending now (a GPU copy's
        own time on its stream), and ``nbytes`` moved as ``kind`` (``None``: the move failed and
        moved nothing)."""
        t1 = time.perf_counter()
        if seconds is not None:
            t0 = t1 - seconds
        with self._lock:
            if t0 is not None:
                self.busy_seconds[(src, dst)] += t1 - t0
            if nbytes is not None:
                self.bytes_moved[(src, dst)] += nbytes
                if kind is not None:
                    self.class_bytes_moved[(kind, src, dst)] += nbytes
        if t0 is not None and self.tracer is not None:
            self.tracer.add(f"{src.value}->{dst.value}", "transfer", t0, t1)

    def stall_sink(self, tier: Tier) -> Callable[[float], None]:
        """The callback a handle reports its waits to, one per tier (made once: every request asks)."""
        sink = self._sinks.get(tier)
        if sink is None:

            def sink(seconds: float) -> None:
                with self._lock:
                    self.stall_seconds[tier] += seconds

            sink = self._sinks.setdefault(tier, sink)
        return sink

    def snapshot(self) -> dict[str, dict[Any, Any]]:
        """Copies of the counters, taken under the lock (lane threads add keys as they run)."""
        with self._lock:
            return {
                "bytes_moved": dict(self.bytes_moved),
                "busy_seconds": dict(self.busy_seconds),
                "stall_seconds": dict(self.stall_seconds),
                "class_bytes_moved": dict(self.class_bytes_moved),
            }
