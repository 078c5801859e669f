"""What several bench scripts share."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import torch


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


def token_batches(
    vocab: int, batch: int, seq_len: int, n: int, *, device: str | torch.device = "cpu", rank: int = 0, world: int = 1
) -> list[torch.Tensor]:
    """``n`` random batches of ``batch`` x ``seq_len + 1`` token ids below ``vocab``, the same ones in
    every process (seed 0); with ``world`` ranks, every rank draws the global batches and keeps its
    ``rank``-th share of the rows. Each on ``device``."""
    gen = torch.Generator().manual_seed(0)
    share = batch // world
    return [
        torch.randint(vocab, (batch, seq_len + 1), generator=gen)[rank * share :][:share].to(device) for _ in range(n)
    ]


def peak_rss() -> int:
    """The process's peak resident set so far, in bytes (``ru_maxrss``, which Linux gives in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
