"""Trace-driven prefetch and Belady eviction against fetch-on-demand and LRU, in one run.

    python bench/prefetch.py [--tensors 24] [--size 8MiB] [--fraction 0.33] [--iterations 8]
                             [--untied] [--dir DIR]

A synthetic training loop: ``--tensors`` weight matrices homed on NVMe, a device budget of
``--fraction`` of their total, and per iteration a forward pass over them in order (one matmul
each) then a backward pass in reverse order (two matmuls each), each weight acquired through a
:class:`~tiermem.transfer.schedule.ResidencyScheduler` just before use and released after. As in a GPT
whose head is tied to the token embedding, weight 0 is used first and last in each pass
(``--untied``: once). Five setups run side by side, one iteration each in turn so drift hits
all alike:

- resident: every weight is a plain tensor in memory (the floor: compute alone)
- prefetch, belady / prefetch, lru: the trace-driven window ahead, victims by next use / recency
- on demand, belady / on demand, lru: nothing fetched ahead

The first iteration records the trace and is left out of the figures; times are medians of
the rest. Between iterations each engine is drained untimed, standing in for the optimizer step
that the next iteration's first prefetches overlap in training. Every setup must produce the
same outputs as the resident one (checked), within the device budget (checked). The ratios come
last.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import torch

from tiermem import TensorClass, TensorInfo, Tier
from tiermem.config.budgets import parse_bytes
from tiermem.memory.nvme import NvmeStore
from tiermem.memory.resident import DeviceStore, HostStore
from tiermem.transfer.engine import TransferEngine
from tiermem.transfer.residency import KeyedResidency
from tiermem.transfer.schedule import ResidencyScheduler, ScheduleStats

MiB = 2**20


@dataclass
class Setup:
    name: str
    sched: ResidencyScheduler | None  # None: weights stay resident as plain tensors
    res: KeyedResidency | None = None
    seconds: list[float] = field(default_factory=list)
    checksums: list[float] = field(default_factory=list)


def make_setup(name: str, weights: list[torch.Tensor], directory: str | None, budget: int, **options) -> Setup:
    if directory is None:
        return Setup(name, None)
    os.makedirs(directory)
    res = KeyedResidency(
        TransferEngine(
            {Tier.DEVICE: DeviceStore("cpu", budget), Tier.HOST: HostStore(), Tier.NVME: NvmeStore(directory)}
        )
    )
    for i, w in enumerate(weights):
        key = f"layers.{i}.weight"
        res.register(TensorInfo(key, TensorClass.PARAM, w.nbytes, tuple(w.shape), w.dtype), Tier.NVME)
        res.put(key, w)
    return Setup(name, ResidencyScheduler(**options).connect(res), res)


def iteration(setup: Setup, weights: list[torch.Tensor], x: torch.Tensor, order: list[int]) -> None:
    """One forward (``order``) and backward (reversed) pass; records time and a checksum."""

    def use(i: int) -> torch.Tensor:
        return weights[i] if setup.sched is None else setup.sched.acquire(f"layers.{i}.weight")

    def done(i: int) -> None:
        if setup.sched is not None:
            setup.sched.release(f"layers.{i}.weight")

    t0 = time.perf_counter()
    total = 0.0
    for i in order:  # forward: y = x @ W
        total += float((x @ use(i)).sum())
        done(i)
    g = torch.ones(x.shape[0], weights[0].shape[1])
    for i in reversed(order):  # backward: dx = g @ W.T and dW = x.T @ g
        w = use(i)
        total += float((g @ w.T).sum()) + float((x.T @ g).sum())
        done(i)
    if setup.sched is not None:
        setup.sched.end_iteration()
    setup.seconds.append(time.perf_counter() - t0)
    setup.checksums.append(total)
    if setup.res is not None:
        setup.res.synchronize()  # untimed: the optimizer step would overlap this


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=24)
    ap.add_argument("--size", default="8MiB", help="bytes per weight (fp32, 1024 rows)")
    ap.add_argument("--fraction", type=float, default=1 / 3, help="device budget / total weight bytes")
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--untied", action="store_true", help="use weight 0 once per pass, not first and last")
    ap.add_argument("--batch", type=int, default=96, help="rows of the activations (sets compute time)")
    ap.add_argument("--dir", default=None, help="directory for the NVMe files (default: a temp dir)")
    args = ap.parse_args()

    size = parse_bytes(args.size, what="--size")
    rows = 1024
    cols = max(size // (4 * rows), 1)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(rows, cols, generator=g) / rows**0.5 for _ in range(args.tensors)]
    x = torch.randn(args.batch, rows, generator=g)
    total_bytes = sum(w.nbytes for w in weights)
    budget = max(int(total_bytes * args.fraction), 2 * weights[0].nbytes)

    root = tempfile.mkdtemp(prefix="tiermem-prefetch-", dir=args.dir)
    setups = []
    try:
        configs = [
            ("resident", None, {}),
            ("prefetch, belady", "a", dict(prefetch=True, eviction="belady")),
            ("prefetch, lru", "b", dict(prefetch=True, eviction="lru")),
            ("on demand, belady", "c", dict(prefetch=False, eviction="belady")),
            ("on demand, lru", "d", dict(prefetch=False, eviction="lru")),
        ]
        for name, sub, options in configs:
            setups.append(
                make_setup(name, weights, None if sub is None else os.path.join(root, sub), budget, **options)
            )
        order = list(range(args.tensors)) + ([] if args.untied else [0])
        for _ in range(args.iterations):
            for setup in setups:
                iteration(setup, weights, x, order)
        for setup in setups[1:]:
            assert setup.checksums == setups[0].checksums, f"{setup.name}: outputs differ from resident"
            ledger = setup.res.engine.stores[Tier.DEVICE].ledger
            assert ledger.peak <= ledger.allowed, f"{setup.name}: device budget exceeded"
        report(args, setups, weights, total_bytes, budget, root)
    finally:
        for setup in setups:
            if setup.res is not None:
                setup.res.engine.close()
                setup.res.engine.stores[Tier.NVME].close()
        shutil.rmtree(root, ignore_errors=True)


def steady(setup: Setup) -> ScheduleStats:
    total = ScheduleStats()
    for s in setup.sched.history[1:]:
        total = total + s
    return total


def report(args, setups: list[Setup], weights, total_bytes: int, budget: int, root: str) -> None:
    n = args.iterations - 1
    nvme = setups[1].res.engine.stores[Tier.NVME]
    print(
        f"{args.tensors} weights x {weights[0].nbytes / MiB:.1f} MiB on NVMe ({total_bytes / MiB:.0f} MiB), "
        f"device budget {budget / MiB:.0f} MiB ({budget / total_bytes:.2f} of it), "
        f"{2 * (args.tensors + (not args.untied))} accesses per iteration, batch {args.batch}, "
        f"{'O_DIRECT' if nvme.direct else 'buffered'} I/O under {root}"
    )
    print(f"steady state, per iteration: seconds the median, the rest the mean of iterations 2..{args.iterations}")
    print(
        f"{'':20s} {'seconds':>8s} {'stall s':>8s} {'stall %':>8s} {'misses':>7s} {'late':>6s} "
        f"{'ahead':>6s} {'evicted':>8s} {'MiB read':>9s}"
    )
    secs = {s.name: statistics.median(s.seconds[1:]) for s in setups}
    stall, evicted = {}, {}
    for s in setups:
        if s.sched is None:
            print(
                f"{s.name:20s} {secs[s.name]:8.3f} {0.0:8.3f} {0.0:7.1f}% {'-':>7s} {'-':>6s} {'-':>6s} "
                f"{'-':>8s} {'-':>9s}"
            )
            continue
        st = steady(s)
        stall[s.name], evicted[s.name] = st.stall_seconds / n, st.evictions / n
        read = (st.bytes_prefetched + st.bytes_fetched) / n / MiB
        print(
            f"{s.name:20s} {secs[s.name]:8.3f} {stall[s.name]:8.3f} {100 * stall[s.name] / secs[s.name]:7.1f}% "
            f"{st.misses / n:7.1f} {st.late / n:6.1f} {st.prefetches / n:6.1f} {evicted[s.name]:8.1f} "
            f"{read:9.0f}"
        )
    print(
        f"stall per iteration: prefetch / on demand (belady) = "
        f"{stall['prefetch, belady'] / max(stall['on demand, belady'], 1e-9):.3f}x"
    )
    print(
        f"iteration time: prefetch / on demand (belady) = {secs['prefetch, belady'] / secs['on demand, belady']:.2f}x"
    )
    print(f"iteration time: prefetch, belady / resident = {secs['prefetch, belady'] / secs['resident']:.2f}x")
    print(f"iteration time: on demand, belady / resident = {secs['on demand, belady'] / secs['resident']:.2f}x")
    print(
        f"evictions: belady / lru (prefetch) = {evicted['prefetch, belady'] / max(evicted['prefetch, lru'], 1e-9):.2f}x"
    )
    print(
        f"evictions: belady / lru (on demand) = "
        f"{evicted['on demand, belady'] / max(evicted['on demand, lru'], 1e-9):.2f}x"
    )


if __name__ == "__main__":
    main()
