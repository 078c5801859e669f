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


class RssSampler:
    """The resident set's peak, sampled from ``/proc/self/statm`` every ``interval`` seconds by a
    daemon thread. ``ru_maxrss`` (:func:`peak_rss`) is the kernel's high-water mark, which Linux
    updates only when memory is unmapped: pages glibc hands back with ``madvise`` leave it behind,
    so it can miss a peak by gigabytes (seen on bench/largest_llama.py: 7.1 GB against 11.1 GB
    sampled). Start with ``with RssSampler() as rss:``; ``rss.peak`` (bytes) since the last
    ``rss.reset()``."""

    def __init__(self, interval: float = 0.02):
        import os
        import threading

        self.interval, self.peak = interval, 0
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.now())

    def reset(self) -> int:
        """The peak so far (bytes), then start again from the resident set now."""
        peak, self.peak = max(self.peak, self.now()), self.now()
        return peak

    def __enter__(self) -> "RssSampler":
        self.peak = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
