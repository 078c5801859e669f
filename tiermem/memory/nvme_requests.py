"""The order of an NVMe store's requests: one key's one after another, different keys' at once,
and one request's chunks spread over the I/O threads, their hashes over the hashing threads: the
store's threads, and the profiler spans of their chunks.

# NOTE [Per-key order]
Every request (write, read, delete) of a key waits for the key's previous request, so a read
sees the latest write issued before it, and an overwrite never races an older write. The wait is
a done-callback that submits the next request to the pool, so no I/O thread ever blocks on
another. Requests of different keys run concurrently, each split into chunks (:class:`Fanout`).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Callable, Optional

from tiermem.memory.nvme_keys import KeyState
from tiermem.spans import lazy_span

# hashing threads per store (NOTE [Hashing beside the I/O]): one hashes ~12 GB/s of memory the cache does not
# hold, faster than the disk; a second keeps chunks that land together from queueing behind each other
HASH_THREADS = 2


class Requests:
    """A store's queued requests on its ``io_threads`` I/O threads (and, with ``hashing``, its
    hashing threads: NOTE [Hashing beside the I/O] in :mod:`tiermem.memory.nvme_io`); ``lock`` is
    the store's lock, held by the callers of :meth:`enqueue`, :meth:`finished` and :meth:`drain`."""

    def __init__(self, lock: threading.Lock, io_threads: int, *, hashing: bool):
        self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="tiermem-nvme")
        self.hasher = (
            ThreadPoolExecutor(min(HASH_THREADS, io_threads), thread_name_prefix="tiermem-nvme-hash")
            if hashing
            else None
        )
        self._idle = threading.Condition(lock)
        self._outstanding = 0

    def enqueue(self, state: KeyState, start: Callable[[Future[Any]], None]) -> Future[Any]:
        """Queue ``start`` behind the key's previous request (NOTE [Per-key order])."""
        future: Future[Any] = Future()
        previous, state.tail = state.tail, future
        self._outstanding += 1

        if previous is None:
            self.pool.submit(start, future)  # refused at shutdown: the caller (holding the lock) sees it
        else:  # the previous request's end submits it, without the lock
            previous.add_done_callback(lambda _done: self._submit(start, future))
        return future

    def finished(self, state: Optional[KeyState], future: Future[Any]) -> bool:
        """Count ``future``'s request as done; whether it was the last one queued for ``state``."""
        last = state is not None and state.tail is future
        if state is not None and last:
            state.tail = None
        self._outstanding -= 1
        if not self._outstanding:
            self._idle.notify_all()
        return last

    def drain(self) -> None:
        """Wait until every queued request is done."""
        while self._outstanding:
            self._idle.wait()

    def shutdown(self) -> None:
        """Stop the threads once the requests on them are done (without the lock held)."""
        self.pool.shutdown(wait=True)
        if self.hasher is not None:
            self.hasher.shutdown(wait=True)

    def fan_out(
        self,
        jobs: list[Callable[[], object]],
        finish: Callable[[Optional[BaseException], list[Any]], None],
        hashes: Optional[list[Callable[[], object]]] = None,
        *,
        hash_first: bool = False,
    ) -> None:
        """Run ``jobs`` (one per chunk) on the pool, the first on this thread; the thread that ends
        the last part calls ``finish`` with the first error (or None) and the chunks' results in
        order. With ``hashes`` (one per chunk; needs ``hasher``) each chunk's hash runs on the
        hashing threads, handed over as its job starts (``hash_first``: a write hashes its source
        while the bytes go out) or once its job ended (a read hashes the bytes that landed), and
        the results are the hashes'; without, they are the jobs' (a chunk hashed inline returns
        its digest): NOTE [Hashing beside the I/O]."""
        results: list[Any] = [None] * len(jobs)
        fan = Fanout(len(jobs) * (2 if hashes else 1), lambda err: finish(err, results))
        if hashes:
            parts = [
                partial(self._io_and_hash, fan, job, _into(results, i, digest), hash_first)
                for i, (job, digest) in enumerate(zip(jobs, hashes))
            ]
        else:
            parts = [partial(fan.run, _into(results, i, job)) for i, job in enumerate(jobs)]
        for part in parts[1:]:
            self._submit(part)
        parts[0]()

    def _submit(self, job: Callable[..., object], *args: Any) -> None:
        """``job(*args)`` on the pool; on this thread where the pool takes no more work (the
        interpreter is shutting down, or the store closed): a request already queued behind another
        one, or a chunk of a request that started, must still finish, or whoever waits for it
        (a prefetch's lane thread, which the interpreter's exit joins) waits forever."""
        try:
            self.pool.submit(job, *args)
        except RuntimeError:
            job(*args)

    def _io_and_hash(
        self, fan: "Fanout", job: Callable[[], object], digest: Callable[[], None], hash_first: bool
    ) -> None:
        """One chunk on an I/O thread: its job, and its hash handed to the hashing threads before
        or after it. A hash whose chunk failed is skipped (:meth:`Fanout.run`), but still counted."""
        if hash_first:
            self._hand_over(fan, digest)
        fan.run(job)
        if not hash_first:
            self._hand_over(fan, digest)

    def _hand_over(self, fan: "Fanout", digest: Callable[[], None]) -> None:
        assert self.hasher is not None, "hashes are handed over only where the store has hashing threads"
        try:
            self.hasher.submit(fan.run, digest)
        except RuntimeError:  # the interpreter is shutting down: hash here rather than never finish
            fan.run(digest)


class Fanout:
    """Runs one request's chunks on several threads; the thread that ends the last chunk calls
    ``finish`` with the first error (or None). Chunks after an error are skipped."""

    __slots__ = ("_left", "_error", "_lock", "_finish")

    def __init__(self, n: int, finish: Callable[[Optional[BaseException]], None]):
        self._left, self._lock, self._finish = n, threading.Lock(), finish
        self._error: Optional[BaseException] = None

    def run(self, job: Callable[[], object]) -> None:
        error: Optional[BaseException] = None
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


def _into(results: list[Any], i: int, job: Callable[[], object]) -> Callable[[], None]:
    """``job``, keeping what it returns at ``results[i]``."""

    def run() -> None:
        results[i] = job()

    return run


def spanned(op: str, key: str, chunk: Callable[[], Optional[int]]) -> Callable[[], Optional[int]]:
    """``chunk`` as a ``tiermem::nvme <op> <key>`` span of a running torch profiler (NOTE [tiermem in
    the torch profiler] in tiermem/spans.py)."""

    def run() -> Optional[int]:
        with lazy_span(lambda: f"nvme {op} {key}"):
            return chunk()

    return run
