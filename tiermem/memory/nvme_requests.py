"""The order of an NVMe store's requests: one key's one after another, different keys' at once,
and one request's chunks spread over the I/O threads.

# NOTE [Per-key order]
Every request (write, read, delete) of a key waits for the key's previous request, so a read
sees the latest write issued before it, and an overwrite never races an older write. The wait is
a done-callback that submits the next request to the pool, so no I/O thread ever blocks on
another. Requests of different keys run concurrently, each split into chunks (:class:`Fanout`).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

from tiermem.memory.nvme_keys import KeyState


class Requests:
    """A store's queued requests on its I/O ``pool``; ``lock`` is the store's lock, held by the
    callers of :meth:`enqueue`, :meth:`finished` and :meth:`drain`."""

    def __init__(self, pool: ThreadPoolExecutor, lock: threading.Lock):
        self.pool = pool
        self._idle = threading.Condition(lock)
        self._outstanding = 0

    def enqueue(self, state: KeyState, start: Callable[[Future], None]) -> Future:
        """Queue ``start`` behind the key's previous request (NOTE [Per-key order])."""
        future: Future = Future()
        previous, state.tail = state.tail, future
        self._outstanding += 1
        go = lambda _done=None: self.pool.submit(start, future)  # noqa: E731
        if previous is None:
            go()
        else:
            previous.add_done_callback(go)
        return future

    def finished(self, state: Optional[KeyState], future: Future) -> bool:
        """Count ``future``'s request as done; whether it was the last one queued for ``state``."""
        last = state is not None and state.tail is future
        if last:
            state.tail = None
        self._outstanding -= 1
        if not self._outstanding:
            self._idle.notify_all()
        return last

    def drain(self) -> None:
        """Wait until every queued request is done."""
        while self._outstanding:
            self._idle.wait()

    def fan_out(self, jobs: list[Callable[[], object]],
                finish: Callable[[Optional[BaseException], list], None]) -> None:
        """Run ``jobs`` on the pool, the first on this thread; the thread that ends the last one
        calls ``finish`` with the first error (or None) and what each job returned, in order
        (a chunk's digest, NOTE [Data checksums])."""
        results: list = [None] * len(jobs)
        fan = Fanout(len(jobs), lambda err: finish(err, results))
        for i, job in enumerate(jobs[1:], 1):
            self.pool.submit(fan.run, _into(results, i, job))
        fan.run(_into(results, 0, jobs[0]))


class Fanout:
    """Runs one request's chunks on several threads; the thread that ends the last chunk calls
    ``finish`` with the first error (or None). Chunks after an error are skipped."""

    __slots__ = ("_left", "_error", "_lock", "_finish")

    def __init__(self, n: int, finish: Callable[[Optional[BaseException]], None]):
        self._left, self._error, self._lock, self._finish = n, None, threading.Lock(), finish

    def run(self, job: Callable[[], object]) -> None:
        error = None
        if self._error is None:
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - handed to finish, which fails the request
                error = e
        with self._lock:
            self._error = self._error or error
            self._left -= 1
            last = self._left == 0
        if last:
            self._finish(self._error)


def _into(results: list, i: int, job: Callable[[], object]) -> Callable[[], None]:
    """``job``, keeping what it returns at ``results[i]``."""
    def run() -> None:
        results[i] = job()
    return run
