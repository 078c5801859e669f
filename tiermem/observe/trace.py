"""A Chrome trace (open it in Perfetto or chrome://tracing) of compute, transfers and Adam. Each
span is one of a user's ``torch.profiler`` trace too (NOTE [tiermem in the torch profiler] in
:mod:`tiermem.spans`)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Iterator, Optional

from tiermem.spans import span as profiler_span


class Tracer:
    """Collects complete ("X") events; thread-safe; keeps at most ``max_events``."""

    def __init__(self, path: Optional[str], *, max_events: int = 200_000):
        self.path = path
        self.max_events = max_events
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._last_write, self._write_seconds = 0.0, 0.0

    @property
    def enabled(self) -> bool:
        return self.path is not None

    @contextlib.contextmanager
    def span(self, name: str, cat: str, **args) -> Iterator[None]:
        """An event of the trace file (when it is written) and a span of a running torch profiler."""
        with profiler_span(name):
            if not self.enabled:
                yield
                return
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.add(name, cat, t0, time.perf_counter(), **args)

    def add(self, name: str, cat: str, t_start: float, t_end: float, **args) -> None:
        if not self.enabled:
            return
        ev = {
            "name": name,
            "cat": cat,
            "ph": "X",
            "pid": os.getpid(),
            "tid": threading.current_thread().name,
            "ts": (t_start - self._t0) * 1e6,
            "dur": (t_end - t_start) * 1e6,
        }
        if args:
            ev["args"] = args
        with self._lock:
            if len(self._events) < self.max_events:
                self._events.append(ev)

    def maybe_write(self) -> None:
        """Write the file unless it was written so recently that rewriting it would cost more
        than a tenth of the time since (a long run's trace grows; each write is a full rewrite)."""
        if self.enabled and time.perf_counter() - self._last_write >= 10 * self._write_seconds:
            self.write()

    def write(self) -> None:
        """Write the trace file atomically (a reader never sees half a file)."""
        if not self.enabled:
            return
        t0 = time.perf_counter()
        with self._lock:
            doc = {"traceEvents": list(self._events), "displayTimeUnit": "ms"}
        assert self.path is not None  # (a tracer without a path writes nothing)
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self.path)
        self._last_write = time.perf_counter()
        self._write_seconds = self._last_write - t0
