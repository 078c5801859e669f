"""Where ZeroInfinity's CPU goes, against ZeroOffload on the same steps, in one process.

    python bench/zi_cpu.py [--n-embd 64] [--n-layer 2] [--steps 20] [--reps 3] [--bucket-size 64KiB]

The golden test's run (tests/test_golden.py: the tiny GPT, fp32, AdamW, clipping, micro-batches
of 4x16 tokens) under both policies, after one untimed warm-up run of each, then ``--reps``
repetitions interleaved (ZeroInfinity, ZeroOffload, ZeroInfinity, ...). Per run: CPU seconds of
the whole process (``time.process_time``: every thread), of the main thread
(``time.thread_time``), of the threads the run started and ended (tiermem's lanes and the NVMe
store's I/O and hashing threads, each read as it ends), the CPU of the scheduler's fetch-ahead
bookkeeping on the main thread (``ResidencyScheduler._fetch_ahead`` less the moves it starts),
and the wall time. Each figure is the fastest of the repetitions. ``--n-embd``/``--n-layer``
widen or deepen the model: per-request and per-op costs stay, the bytes and FLOPs grow. The
ratio ZeroInfinity / ZeroOffload of process CPU comes last.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for examples.gpt

from examples.gpt import GPT, GPTConfig, lm_loss
from tiermem import AdamW, TieredModel
from tiermem.policies import ZeroInfinity, ZeroOffload
from tiermem.transfer import residency as residency_mod, schedule as schedule_mod

_threads_cpu = [0.0]  # CPU seconds of threads that ended, summed
_fetch = [0.0, 0.0]  # CPU in _fetch_ahead, CPU in the moves it (and acquire) started


def _patch() -> None:
    """Count the CPU of threads as they end, and of the scheduler's fetch-ahead (bench only)."""
    run = threading.Thread.run

    def counted(self: threading.Thread) -> None:
        try:
            run(self)
        finally:
            _threads_cpu[0] += time.thread_time()

    threading.Thread.run = counted  # type: ignore[method-assign]
    fetch_ahead = schedule_mod.ResidencyScheduler._fetch_ahead
    prefetch = residency_mod.KeyedResidency.prefetch

    def timed_fetch(self):  # type: ignore[no-untyped-def]
        t = time.thread_time()
        fetch_ahead(self)
        _fetch[0] += time.thread_time() - t

    def timed_prefetch(self, *a, **k):  # type: ignore[no-untyped-def]
        t = time.thread_time()
        try:
            return prefetch(self, *a, **k)
        finally:
            if threading.current_thread() is threading.main_thread():
                _fetch[1] += time.thread_time() - t

    schedule_mod.ResidencyScheduler._fetch_ahead = timed_fetch  # type: ignore[method-assign]
    residency_mod.KeyedResidency.prefetch = timed_prefetch  # type: ignore[method-assign]


def train(policy: str, cfg: GPTConfig, steps: int, bucket_size: str) -> None:
    """tests/test_golden.py's ``train``, with the model's size and the bucket size as given."""
    torch.manual_seed(0)
    setup: dict = (
        {"policy": ZeroOffload()}
        if policy == "zero-offload"
        else {"policy": ZeroInfinity(), "nvme_dir": tempfile.mkdtemp()}
    )
    tm = TieredModel(
        GPT(cfg),
        optimizer=AdamW(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1),
        precision="fp32",
        grad_clip=1.0,
        bucket_size=bucket_size,
        device="cpu",
        **setup,
    )
    g = torch.Generator().manual_seed(1234)
    for i in range(steps):
        idx = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1), generator=g)
        x, y = idx[:, :-1], idx[:, 1:]
        for _ in range(2 if i % 5 == 0 else 1):  # some steps accumulate two micro-batches
            tm.backward(lm_loss(tm(x), y) / (2 if i % 5 == 0 else 1))
        tm.step()
    tm.detach()


def measure(policy: str, cfg: GPTConfig, steps: int, bucket_size: str) -> dict[str, float]:
    _threads_cpu[0], _fetch[:] = 0.0, [0.0, 0.0]
    p, m, w = time.process_time(), time.thread_time(), time.perf_counter()
    train(policy, cfg, steps, bucket_size)
    for t in threading.enumerate():  # the run's threads end as its engine closes; wait for stragglers
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    return {
        "process_cpu": time.process_time() - p,
        "main_cpu": time.thread_time() - m,
        "ended_threads_cpu": _threads_cpu[0],
        "fetch_ahead_bookkeeping_cpu": _fetch[0] - _fetch[1],
        "wall": time.perf_counter() - w,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-size", default="64KiB")
    args = ap.parse_args()
    over: dict = {"vocab_size": 41, "block_size": 16}
    if args.n_embd != 64:
        over.update(n_embd=args.n_embd, n_head=max(1, args.n_embd // 64))
    if args.n_layer is not None:
        over["n_layer"] = args.n_layer
    cfg = GPTConfig.preset("tiny", **over)
    _patch()
    policies = ("zero-infinity", "zero-offload")
    for policy in policies:  # warm-up: kernels built, caches filled
        measure(policy, cfg, args.steps, args.bucket_size)
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in policies}
    for _ in range(args.reps):
        for policy in policies:
            runs[policy].append(measure(policy, cfg, args.steps, args.bucket_size))
    best = {p: {k: min(r[k] for r in rs) for k in rs[0]} for p, rs in runs.items()}
    print(f"n_embd {cfg.n_embd}, n_layer {cfg.n_layer}, {args.steps} steps, fastest of {args.reps}:")
    for p, b in best.items():
        print(f"  {p:14s} " + "  ".join(f"{k} {v:.3f}s" for k, v in b.items()))
    ratio = best["zero-infinity"]["process_cpu"] / best["zero-offload"]["process_cpu"]
    print(json.dumps({"best": best, "process_cpu_ratio_zi_over_zo": round(ratio, 3)}))
    print(f"process CPU, zero-infinity / zero-offload: {ratio:.2f}x")


if __name__ == "__main__":
    main()
