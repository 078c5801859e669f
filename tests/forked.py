"""A test's second process, forked from the forkserver of tests/ranks.py (which imported torch,
torch._dynamo and tiermem once per test session) instead of a fresh ``python -c`` or a spawned
process, which imports them again: ~5 CPU s a process on this 2-core machine, for tests whose own
work in the child is a fraction of that. The forkserver has run nothing and started no thread, so a
child starts as clean as a spawned one (torch's default thread count, no tiermem state); the
environment is the caller's at the call, as with spawn. A child may kill itself (SIGKILL) or be
killed: nothing here needs it to end cleanly."""

from __future__ import annotations

import os
import queue
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp
from ranks import PRELOAD


def context() -> Any:
    """The forkserver context shared with tests/ranks.py (one forkserver per test process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the forkserver starts: the first child of the session
    return ctx


def _child_main(env: dict[str, str], errors: Any, target: Callable[..., None], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's environment at the call, not the forkserver's at its start
    try:
        target(*args)
    except BaseException:  # sent to the parent, which shows it; re-raised: the exit code says so too
        errors.put(traceback.format_exc())
        raise


def run(target: Callable[..., None], *args: Any, deadline: float = 120.0) -> tuple[int, str]:
    """``target(*args)`` in a child; its exit code (negative: the signal that ended it) and the
    traceback it raised, if any. A child not done by ``deadline`` is killed and fails the test."""
    ctx = context()
    errors = ctx.Queue()
    child = ctx.Process(target=_child_main, args=(dict(os.environ), errors, target, args))
    child.start()
    child.join(deadline)
    if child.exitcode is None:
        child.kill()
        child.join()
        raise AssertionError(f"the child process was not done within {deadline:.0f} s (hung?)")
    try:
        said = errors.get(timeout=1.0) if child.exitcode > 0 else ""
    except queue.Empty:
        said = ""
    return child.exitcode, said
