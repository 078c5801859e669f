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
from typing import Any, Callable, NamedTuple

import pytest
from ranks import forkserver as context


class Child(NamedTuple):
    exitcode: int  # negative: the signal that ended it
    error: str  # the traceback it raised, or ""
    value: Any  # what the target returned (None if it did not return)


def _child_main(env: dict[str, str], said: Any, target: Callable[..., Any], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's environment at the call, not the forkserver's at its start
    try:
        said.put(("ok", target(*args)))
    except BaseException:  # sent to the parent, which shows it; re-raised: the exit code says so too
        said.put(("error", traceback.format_exc()))
        raise


def run(target: Callable[..., Any], *args: Any, deadline: float = 120.0, hang: str = "") -> Child:
    """``target(*args)`` in a child, and how it ended. A child not done by ``deadline`` seconds is
    killed and fails the test with ``hang`` (a deadlock stays in the child)."""
    ctx = context()
    said = ctx.Queue()
    child = ctx.Process(target=_child_main, args=(dict(os.environ), said, target, args))
    child.start()
    child.join(deadline)
    if child.exitcode is None:
        child.kill()
        child.join()
        pytest.fail(hang or f"the child process was not done within {deadline:.0f} s")
    try:
        status, what = said.get(timeout=1.0)
    except queue.Empty:  # killed, or died without a word
        status, what = "", None
    return Child(child.exitcode, what if status == "error" else "", what if status == "ok" else None)
