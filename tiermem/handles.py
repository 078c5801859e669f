"""Handles: what every asynchronous request returns. Only ``.wait()`` and ``.done()`` are public
(``wait_issued()`` is for ``TransferEngine.join``).

A handle wraps a ``concurrent.futures.Future``. The time a caller spends blocked in ``wait()``
on an unfinished request is reported to an optional ``on_stall`` callback, which is how the
engine and the stores measure stall seconds. :func:`chain` composes handles into one; callers
reach it through ``TransferEngine.chain``, which counts the stalls (NOTE [Chained requests]).
"""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import CancelledError, Future
from typing import Any, Callable, Iterable, Optional, Sequence, Union

StallSink = Callable[[float], None]


class Handle:
    """A pending (or finished) request of a store or the engine. ``wait()`` returns its result or
    raises its error; ``done()`` never blocks.

    Args:
        future: the ``concurrent.futures.Future`` the request completes.
        on_stall: called with the seconds a caller spent blocked in ``wait()``.
        issued: for a request that ends with GPU work, the moment that work is queued.
    """

    __slots__ = ("_future", "_on_stall", "_issued")

    def __init__(self, future: Future[Any], *, on_stall: Optional[StallSink] = None, issued: Optional["Issued"] = None):
        self._future = future
        self._on_stall = on_stall
        self._issued = issued

    @classmethod
    def completed(cls, value: Any = None) -> "Handle":
        """A handle already finished with ``value``.

        Args:
            value: what ``wait()`` returns.
        """
        f: Future[Any] = Future()
        f.set_result(value)
        return cls(f)

    def done(self) -> bool:
        """Finished, with or without an error (never blocks)."""
        return self._future.done()

    def succeeded(self) -> bool:
        """Finished without an error (never blocks)."""
        return self._future.done() and not self._future.cancelled() and self._future.exception() is None

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until the request finished; return its result or raise its error.

        Args:
            timeout: seconds to wait at most (``TimeoutError`` past it); None waits as long as it takes.
        """
        if not self._future.done() and self._on_stall is not None:
            t0 = time.perf_counter()
            try:
                self._future.exception(timeout)  # block without raising yet
            finally:
                self._on_stall(time.perf_counter() - t0)
        return self._future.result(timeout)

    def wait_issued(self) -> Optional["Issued"]:
        """For a request that ends with GPU work: wait until that work is queued (not done) and
        return its :class:`Issued`; None for any other request (then ``wait()`` is the way)."""
        issued = self._issued
        if issued is None:
            return None
        if not issued.is_set() and self._on_stall is not None:
            t0 = time.perf_counter()
            try:
                issued.wait()
            finally:
                self._on_stall(time.perf_counter() - t0)
        issued.wait()
        return issued

    def add_done_callback(self, fn: Callable[[Future[Any]], None]) -> None:
        """Call ``fn(future)`` once the request finished (at once when it has).

        Args:
            fn: the callback, given the underlying future.
        """
        self._future.add_done_callback(fn)

    def wraps(self, future: Future[Any]) -> bool:
        """Whether ``future`` (a done-callback's argument) is the one this request completes. A
        callback that needs its handle finds it this way: one holding the handle itself would make
        a reference cycle (future -> callback -> handle -> future) that keeps the request's result,
        often a large buffer, alive until Python's next full garbage collection.

        Args:
            future: the future a done-callback was given.
        """
        return self._future is future

    def observed(self, on_stall: StallSink) -> "Handle":
        """The same request, reporting the caller's stalls to ``on_stall``.

        Args:
            on_stall: called with the seconds each ``wait()`` blocked.
        """
        return Handle(self._future, on_stall=on_stall, issued=self._issued)


class Issued:
    """The first moment of a request that ends with GPU work (NOTE [Issued, then done] in
    :mod:`tiermem.transfer.lanes`): set once the work is queued, with the CUDA ``event`` that
    completes it and the request's ``value``; ``failed`` when issuing it raised."""

    __slots__ = ("_flag", "event", "value", "failed")

    def __init__(self) -> None:
        self._flag = threading.Event()
        self.event: Any = None
        self.value: Any = None
        self.failed = False

    def set(self, event: Any, value: Any) -> None:
        self.event, self.value = event, value
        self._flag.set()

    def fail(self) -> None:
        self.failed = True
        self._flag.set()

    def is_set(self) -> bool:
        return self._flag.is_set()

    def wait(self) -> None:
        self._flag.wait()


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


def chain(
    first: Union[Handle, Sequence[Handle]],
    then: Optional[Callable[[], Any]] = None,
    *,
    cleanup: Optional[Callable[[], None]] = None,
    on_stall: Optional[StallSink] = None,
) -> Handle:
    """One handle for "``then()`` once ``first`` has finished"; see NOTE [Chained requests] in
    :mod:`tiermem.transfer.engine`, whose ``TransferEngine.chain`` is the way in."""
    link = _Link(then, cleanup, isinstance(first, Handle))
    firsts = [first] if isinstance(first, Handle) else list(first)
    if len(firsts) == 1:
        firsts[0].add_done_callback(link.first_done)
    else:
        _when_all(firsts, link.start)
    return Handle(link.out, on_stall=on_stall)


class _Link:
    """One chain in flight. It refers to neither ``first`` nor what waits on it, and lets go of
    ``then`` and ``cleanup`` once it ended, so a finished chain holds nothing and no cycle."""

    __slots__ = ("then", "cleanup", "single", "out")

    def __init__(self, then: Optional[Callable[[], Any]], cleanup: Optional[Callable[[], None]], single: bool):
        self.then, self.cleanup, self.single = then, cleanup, single
        self.out: Future[Any] = Future()

    def first_done(self, f: Future[Any]) -> None:
        error = _error_of(f)
        self.start(error, [f.result()] if error is None and self.then is None else [])

    def start(self, error: Optional[BaseException], results: list[Any]) -> None:
        if error is not None:
            self.end(error)
            return
        try:
            value = self.then() if self.then is not None else (results[0] if self.single else results)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the chain
            self.end(e)
            return
        if isinstance(value, Handle):  # a request issued by `then`: the chain ends with it
            value.add_done_callback(self.request_done)
        else:
            self.end(None, value)

    def request_done(self, f: Future[Any]) -> None:
        error = _error_of(f)
        self.end(error, f.result() if error is None else None)

    def end(self, error: Optional[BaseException], value: Any = None) -> None:
        cleanup, self.then, self.cleanup = self.cleanup, None, None
        if cleanup is not None:
            try:
                cleanup()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the chain
                error = error or e
        self.out.set_exception(error) if error is not None else self.out.set_result(value)


def _when_all(handles: list[Handle], fn: Callable[[Optional[BaseException], list[Any]], None]) -> None:
    """Call ``fn(first error in the order given or None, results)`` once every handle is done, on
    the thread that finished the last one (at once, on this thread, if there are none)."""
    if not handles:
        fn(None, [])
        return
    errors: list[Optional[BaseException]] = [None] * len(handles)
    results: list[Any] = [None] * len(handles)
    left, lock = [len(handles)], threading.Lock()

    def one(i: int, f: Future[Any]) -> None:
        errors[i] = _error_of(f)
        if errors[i] is None:
            results[i] = f.result()
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            error = next((e for e in errors if e is not None), None)
            fn(error, [] if error is not None else results)

    for i, h in enumerate(handles):
        h.add_done_callback(functools.partial(one, i))


def _error_of(f: Future[Any]) -> Optional[BaseException]:
    """A finished future's error (a cancelled one's is CancelledError), or None."""
    try:
        return f.exception()
    except CancelledError as e:
        return e
