"""tests/fresh.py, the harness the example and CLI tests run scripts with, against its oracle: the
same script run by ``subprocess.run([sys.executable, ...])`` gives the same stdout, stderr and exit
status (NOTE [Scripts forked from the forkserver] in tests/fresh.py). The probe imports nothing
heavy, so each fresh interpreter here costs tens of milliseconds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from fresh import Python, run_python

PROBE = textwrap.dedent(
    """\
    import atexit, os, sys, threading, time
    print("argv", sys.argv)
    print("path", sys.path)
    print("main", __name__, __file__ if __name__ == "__main__" else None)
    print("env", os.environ.get("PROBE"), os.environ.get("PYTHONPATH") is not None, os.getcwd())
    print("fds", [os.isatty(fd) for fd in (1, 2)])
    atexit.register(lambda: print("atexit ran", flush=True))
    threading.Thread(target=lambda: (time.sleep(0.2), print("the thread finished"))).start()
    print("to stderr", file=sys.stderr)
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "raise":
        raise ValueError("boom")
    if what:
        sys.exit(int(what) if what.isdigit() else what)
    """
)


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fresh")
    (d / "probe.py").write_text(PROBE)
    (d / "probe_pkg").mkdir()
    (d / "probe_pkg" / "__init__.py").write_text("")
    (d / "probe_pkg" / "__main__.py").write_text(PROBE)
    return d


@pytest.mark.parametrize("how", [[], ["3"], ["a message"], ["raise"], ["-m"]])
def test_a_script_runs_as_python_runs_it(probe: Path, how: list[str]) -> None:
    args = ["-m", "probe_pkg"] if how == ["-m"] else [str(probe / "probe.py"), *how]
    env = {**os.environ, "PROBE": "x"}
    ours = run_python(*args, cwd=probe, env=env, timeout=60)
    theirs = subprocess.run([sys.executable, *args], cwd=probe, env=env, capture_output=True, text=True, timeout=60)
    assert (ours.returncode, ours.stdout, ours.stderr) == (theirs.returncode, theirs.stdout, theirs.stderr)
    assert "atexit ran" in ours.stdout and "the thread finished" in ours.stdout  # the interpreter's exit, in order
    assert ours.returncode == {"": 0, "3": 3, "a message": 1, "raise": 1, "-m": 0}[(how or [""])[0]]


def test_a_timeout_kills_the_process_and_what_it_started(tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    p = Python(str(script), cwd=tmp_path)
    with pytest.raises(subprocess.TimeoutExpired):
        p.communicate(timeout=2)
    p.kill()
    out, _ = p.communicate(timeout=30)
    assert p.returncode == -9
    child = int(out.split()[0])
    for _ in range(100):  # the grandchild is reaped by init once killed
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.05)
    else:
        raise AssertionError(f"process {child}, started by the script, outlived the kill")
