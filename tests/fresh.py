"""Run ``python SCRIPT ARGS`` or ``python -m MODULE ARGS`` as a process of its own, the way the example
and CLI tests run what users run, without paying ``import torch`` in every one.

NOTE [Scripts forked from the forkserver]
A fresh interpreter spends ~3 CPU seconds importing torch and tiermem before the script's first
line; the example and CLI tests start a dozen of them. Here the process is forked from the
forkserver of tests/ranks.py, which imported those once per session (ranks.PRELOAD) and has run
nothing else, so what starts is a process of its own as clean as a spawned one, and the script
runs in it as ``python`` would run it:

- ``sys.argv``, ``sys.path`` (the script's directory, or the working directory for ``-m``, then
  the path a fresh interpreter with that environment gets), the environment and the working
  directory are the call's; the script runs as ``__main__`` (runpy), its own imports fresh;
- stdout and stderr are files the caller reads back, as ``capture_output=True`` pipes would be;
- the exit status is the interpreter's: 0 at the end, ``SystemExit``'s code (a message: printed,
  status 1), an uncaught exception's traceback on stderr and status 1; non-daemon threads are
  waited for and atexit handlers run before the process exits;
- it leads a session of its own (``start_new_session=True``), so a timeout kills it with every
  process it started (torchrun's workers).

What is not the same: torch and tiermem were imported before the environment was set. Neither
reads it at import (tiermem reads TIERMEM_*, XDG_CACHE_HOME at the call that needs them; torch's
OpenMP reads OMP_* when it loads, and the forkserver was started with the suite's). A test whose
point is a fresh interpreter (what an import pulls in, an error's exit through Python itself)
starts one with subprocess instead."""

from __future__ import annotations

import atexit
import functools
import io
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from typing import Optional, Sequence

from ranks import forkserver


@functools.cache
def _interpreter_path(pythonpath: Optional[str], cwd: str) -> tuple[str, ...]:
    """``sys.path[1:]`` of a fresh interpreter with this PYTHONPATH (no torch imported: ~30 ms)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run(
        [sys.executable, "-c", "import sys, json; print(json.dumps(sys.path[1:]))"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return tuple(json.loads(out))


_OURS = {__file__, runpy.__file__, "<frozen runpy>"}  # frames above the script's


def _exit_code(e: SystemExit) -> int:
    """The status Python exits with for ``raise SystemExit(e.code)``."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _child(
    args: Sequence[str], cwd: str, env: dict[str, str], path: Sequence[str], out: str, err: Optional[str]
) -> None:
    os.setsid()  # a session of its own: killpg reaches every process it starts
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    f = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(f, 1)
    os.close(f)
    if err is None:  # stderr=subprocess.STDOUT
        os.dup2(1, 2)
    else:
        f = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, 2)
        os.close(f)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8")
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
    )
    sys.stdin = open(os.devnull)
    if args[0] == "-m":
        sys.argv, sys.path[:] = ["-m", *args[2:]], [cwd, *path]
    else:
        sys.argv, sys.path[:] = list(args), [os.path.dirname(os.path.abspath(args[0])), *path]
    try:
        if args[0] == "-m":
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(args[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException as e:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in _OURS:
            tb = tb.tb_next  # the traceback from the script's frame on, as python prints it
        traceback.print_exception(type(e), e, tb)
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's exit: threads, then atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _read(name: str) -> str:
    """A file the process wrote; empty if it died before it opened it."""
    try:
        with open(name, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


class Python:
    """``subprocess.Popen([sys.executable, *args], stdout=PIPE, stderr=PIPE, text=True,
    start_new_session=True)`` forked from the forkserver (NOTE [Scripts forked from the forkserver]);
    ``merge=True``: ``stderr=STDOUT``, its stderr then comes back as ``""``."""

    def __init__(self, *args: str, cwd: str | os.PathLike, env: Optional[dict[str, str]] = None, merge: bool = False):
        env = dict(os.environ if env is None else env)
        self.args = [sys.executable, *args]
        self._dir = tempfile.mkdtemp(prefix="tiermem-fresh-")
        self._out, self._err = os.path.join(self._dir, "stdout"), os.path.join(self._dir, "stderr")
        cwd = os.fspath(cwd)
        path = _interpreter_path(env.get("PYTHONPATH"), cwd)
        self._proc = forkserver().Process(
            target=_child, args=(list(args), cwd, env, path, self._out, None if merge else self._err)
        )
        self._proc.start()
        assert self._proc.pid is not None
        self.pid: int = self._proc.pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self._proc.exitcode is not None:
            self.returncode = self._proc.exitcode
        return self.returncode

    def kill(self) -> None:
        """SIGKILL to its session: the process and every process it started."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def communicate(self, timeout: Optional[float] = None) -> tuple[str, str]:
        """(stdout, stderr) once it exits; ``subprocess.TimeoutExpired`` (it still runs) after ``timeout``."""
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.returncode = self._proc.exitcode
        out, err = (_read(name) for name in (self._out, self._err))
        shutil.rmtree(self._dir, ignore_errors=True)
        return out, err


def run_python(
    *args: str, cwd: str | os.PathLike, env: Optional[dict[str, str]] = None, timeout: float
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)``, forked
    (NOTE [Scripts forked from the forkserver]); on timeout its session is killed and
    ``subprocess.TimeoutExpired`` raised."""
    p = Python(*args, cwd=cwd, env=env)
    try:
        out, err = p.communicate(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    assert p.returncode is not None
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)
