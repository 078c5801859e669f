"""Handles: what every asynchronous request returns. Only ``.wait()`` and ``.done()`` are public.

A handle wraps a ``concurrent.futures.Future``. The time a caller spends blocked in ``wait()``
on an unfinished request is reported to an optional ``on_stall`` callback, which is how the
engine and the stores measure stall seconds.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Optional

StallSink = Callable[[float], None]


class Handle:
    """A pending (or finished) request. ``wait()`` returns its result or raises its error."""

    __slots__ = ("_future", "_on_stall")

    def __init__(self, future: Future, *, on_stall: Optional[StallSink] = None):
        self._future = future
        self._on_stall = on_stall

    @classmethod
    def completed(cls, value: Any = None) -> "Handle":
        f: Future = Future()
        f.set_result(value)
        return cls(f)

    def done(self) -> bool:
        return self._future.done()

    def succeeded(self) -> bool:
        """Finished without an error (never blocks)."""
        return self._future.done() and not self._future.cancelled() and self._future.exception() is None

    def wait(self, timeout: Optional[float] = None) -> Any:
        if not self._future.done() and self._on_stall is not None:
            t0 = time.perf_counter()
            try:
                self._future.exception(timeout)  # block without raising yet
            finally:
                self._on_stall(time.perf_counter() - t0)
        return self._future.result(timeout)

    def add_done_callback(self, fn: Callable[[Future], None]) -> None:
        self._future.add_done_callback(fn)

    def observed(self, on_stall: StallSink) -> "Handle":
        """The same request, reporting the caller's stalls to ``on_stall``."""
        return Handle(self._future, on_stall=on_stall)


def wait_all(handles: Iterable[Handle]) -> list[Any]:
    """Wait for every handle, even after one fails, then raise the first error (if any)."""
    results, first_error = [], None
    for h in handles:
        try:
            results.append(h.wait())
        except BaseException as e:  # noqa: BLE001 - re-raised below after all are drained
            results.append(None)
            first_error = first_error or e
    if first_error is not None:
        raise first_error
    return results


def wait_all_quietly(handles: Iterable[Handle]) -> None:
    """Wait for every handle, ignoring their errors (draining after a first error was raised)."""
    for h in handles:
        try:
            h.wait()
        except Exception:  # noqa: BLE001 - the caller is already propagating the error that matters
            pass
