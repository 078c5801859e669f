"""Work a finalizer must not do where it runs: given to one worker thread, and waited for on demand.

# NOTE [Finalizers only enqueue]
A weakref finalizer runs wherever the last reference went or a garbage-collection pass started:
on any thread, between any two bytecodes, possibly while that thread holds a lock that is not
reentrant (``concurrent.futures`` takes a module-wide one in ``submit``; a store holds its own).
Closing a dropped model there (joining its threads, deleting its files through its store's
pool) can deadlock on such a lock. So a finalizer only calls :func:`defer`, which puts the work
on a ``queue.SimpleQueue`` (whose ``put`` is safe inside finalizers), and one daemon thread,
``tiermem-release``, started by :func:`start` from an ordinary call, runs it. :func:`settle`
waits until everything deferred so far has run; :func:`collect` first collects garbage, so that
what nothing references any more is given back before it returns (a new model on the same
directory or module calls it before refusing). At exit the worker finishes what was deferred
before the interpreter tears down, and before thread pools stop taking work (a release deletes its
files through its store's pool: a model dropped as a script ends leaves none behind); what is
dropped later, or still alive then, is left to the process's end.

A forked child starts with nothing deferred and no worker (:func:`_forget_in_child`): the jobs
queued in the parent are the parent's to run, and a lock another parent thread held at the fork
would never be let go in the child.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import queue
import threading
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

_jobs: "queue.SimpleQueue[Callable[[], Any]]" = queue.SimpleQueue()
_worker: Optional[threading.Thread] = None
_start_lock = threading.Lock()
_exiting = False  # the interpreter is ending: it frees everything itself, nothing more is deferred
_exit_registered = False  # a forked child inherits the parent's atexit handlers, this one included


def start() -> None:
    """Make sure the worker runs (call from an ordinary call, never from a finalizer)."""
    global _worker, _exit_registered
    with _start_lock:
        if _worker is None or not _worker.is_alive():
            if not _exit_registered:
                _exit_registered = True
                # first a drain before concurrent.futures refuses new work at exit (its hook is
                # registered the same way, earlier: these run last-registered first), so a release
                # can still delete its files through its store's pool; then, at atexit, after the
                # non-daemon threads ended, what they dropped meanwhile, and nothing more
                with contextlib.suppress(AttributeError, RuntimeError):  # RuntimeError: shutting down already
                    threading._register_atexit(_drain)  # type: ignore[attr-defined]  # private, hence the suppress
                atexit.register(_at_exit)
            _worker = threading.Thread(target=_work, name="tiermem-release", daemon=True)
            _worker.start()


def defer(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` on the worker; safe to call from a finalizer."""
    if not _exiting:
        _jobs.put(lambda: fn(*args))


def settle(timeout: float = 60.0) -> None:
    """Wait until everything deferred before this call has run (no-op on the worker itself, and
    where none runs: never started, or a forked child's copy of the parent's)."""
    worker = _worker
    if worker is None or not worker.is_alive() or threading.current_thread() is worker:
        return
    done = threading.Event()
    _jobs.put(done.set)  # FIFO: set once every earlier job has run
    if not done.wait(timeout):
        log.warning("tiermem: giving back a dropped model's resources took over %.0f s; going on", timeout)


def collect() -> None:
    """Collect garbage, then :func:`settle`: what nothing references any more is given back."""
    gc.collect()
    settle()


def _drain() -> None:
    """The main thread has ended: what was dropped so far is given back while thread pools
    still take work (other threads may still run, and drop more)."""
    settle(timeout=30.0)


def _at_exit() -> None:
    """The interpreter is ending: what was dropped before runs now (a daemon thread must not be
    in the middle of it once the interpreter tears down); later drops are left to the exit."""
    global _exiting
    _exiting = True
    settle(timeout=30.0)


def _forget_in_child() -> None:
    """After a fork, in the child: nothing of the parent's is run here (its worker did not come
    along, and what it had queued is the parent's business)."""
    global _jobs, _worker, _start_lock
    _jobs, _worker, _start_lock = queue.SimpleQueue(), None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _work() -> None:
    while True:
        job = _jobs.get()
        try:
            job()
        except Exception as e:  # noqa: BLE001 - one failed release must not stop the others
            (log.debug if _exiting else log.warning)(  # at exit, thread pools refuse work: expected
                "tiermem: giving back a dropped model's resources failed: %s: %s", type(e).__name__, e
            )
        del job  # what it referred to goes now, not when the next job comes
