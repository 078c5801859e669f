"""What several bench scripts share."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_again(script: str, argv: list[str], what: str, *, keep_stderr: bool = False) -> dict:
    """``script`` (a bench script's ``__file__``) run again with ``argv`` in a fresh process; its last
    output line is the JSON result. Its stderr goes to ours, or with ``keep_stderr`` is held and its
    tail shown if the run fails."""
    res = subprocess.run(
        [sys.executable, str(Path(script).resolve()), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if keep_stderr else None,
        text=True,
    )
    lines = res.stdout.strip().splitlines()
    if res.returncode != 0 or not lines:
        tail = f":\n{res.stderr[-2000:]}" if keep_stderr else ""
        raise RuntimeError(f"bench/{Path(script).name}: the run of {what} exited {res.returncode}{tail}")
    return json.loads(lines[-1])
