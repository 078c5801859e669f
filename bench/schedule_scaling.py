"""The residency scheduler's own CPU per acquire, at 64 and at 1,024 managed tensors.

    PYTHONPATH=$PWD python bench/schedule_scaling.py [--steps 4] [--repeats 3] [--quick]

Model-free: N weights homed on the host, a :class:`~tiermem.transfer.schedule.ResidencyScheduler`
keeping them on a CPU "device" store, and per step every weight acquired and released in a
forward order (0..N-1) then a backward one (N-1..0), as in bench/prefetch.py but without the
matmuls. The first step records the trace and is left out; the next ``--steps`` replay it.
The figure is the calling thread's CPU seconds (``time.thread_time``) spent inside ``acquire``
and ``release``, divided by the number of acquires: the scheduler's decisions plus the moves it
asks for on this thread (allocation, submission). The engine's copy threads are not counted
(their work is per byte, and the bytes are the same at both counts in the "same total" rows).
As CPU time on a busy machine varies, one more step is run under cProfile and the Python calls
made per acquire on the calling thread are shown too: a count of work that load does not change.

Setups, each at N = 64 and N = 1,024:

- same total: 16 MiB in all, so a tensor is 256 KiB at 64 and 16 KiB at 1,024;
- same size: 16 KiB a tensor, so 1 MiB in all at 64 and 16 MiB at 1,024;

each with a device budget of (a) 8 tensors (a small window: every acquire evicts and prefetches),
(b) every tensor (everything stays once fetched) and (c) half the tensors with ``lookahead_bytes``
of 8 (a small window, many released tensors to choose victims among). Runs alternate 64 and 1,024 and the figure
is the fastest of ``--repeats`` (the machine is shared). The ratios 1,024 / 64 come last.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from tiermem import TensorClass, TensorInfo, Tier
from tiermem.memory.resident import DeviceStore, HostStore
from tiermem.transfer.engine import TransferEngine
from tiermem.transfer.residency import KeyedResidency
from tiermem.transfer.schedule import ResidencyScheduler, ScheduleStats

KiB, MiB = 2**10, 2**20


def build(n: int, nbytes: int, budget: int, **options) -> tuple[ResidencyScheduler, KeyedResidency]:
    sched = ResidencyScheduler(**options)
    engine = TransferEngine({Tier.DEVICE: DeviceStore("cpu", budget, reclaimers=(sched,)), Tier.HOST: HostStore()})
    res = KeyedResidency(engine)
    numel = nbytes // 4
    for i in range(n):
        key = f"layers.{i}.weight"
        res.register(TensorInfo(key, TensorClass.PARAM, nbytes, (numel,), torch.float32), Tier.HOST)
        res.put(key, torch.full((numel,), float(i)))
    sched.connect(res)
    return sched, res


def one_step(sched: ResidencyScheduler, keys: list[str]) -> tuple[float, int]:
    """Thread CPU seconds inside acquire/release over one step, and the acquires made."""
    spent = 0.0
    for key in keys + keys[::-1]:
        t0 = time.thread_time()
        sched.acquire(key)
        sched.release(key)
        spent += time.thread_time() - t0
    t0 = time.thread_time()
    sched.end_iteration()
    spent += time.thread_time() - t0
    sched.residency.synchronize()  # untimed: the copies in flight land (an optimizer step would overlap them)
    return spent, 2 * len(keys)


def measure(n: int, nbytes: int, window: int | str | None, steps: int) -> tuple[float, float, ScheduleStats]:
    """Microseconds of scheduler CPU per acquire over ``steps`` replayed steps; ``window``: the
    budget in tensors (None: all of them; "half": half of them, 8 fetched ahead)."""
    if window == "half":
        sched, res = build(n, nbytes, nbytes * (n // 2), lookahead_bytes=8 * nbytes)
    else:
        sched, res = build(n, nbytes, nbytes * (n if window is None else int(window)))
    keys = [f"layers.{i}.weight" for i in range(n)]
    try:
        one_step(sched, keys)  # records the trace
        spent = acquires = 0
        for _ in range(steps):
            s, a = one_step(sched, keys)
            spent += s
            acquires += a
        ledger = res.engine.stores[Tier.DEVICE].ledger
        assert ledger.peak <= ledger.allowed, "device budget exceeded"
        steady = sum(sched.history[1 : steps + 1], ScheduleStats())
        profile = cProfile.Profile()
        profile.enable()
        _, a = one_step(sched, keys)
        profile.disable()
        calls = pstats.Stats(profile).total_calls / a  # type: ignore[attr-defined]
        return 1e6 * spent / acquires, calls, steady
    finally:
        res.engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 step, 1 repeat")
    args = ap.parse_args()
    steps, repeats = (1, 1) if args.quick else (args.steps, args.repeats)
    counts = (64, 1024)
    setups = [
        ("same total (16 MiB)", lambda n: 16 * MiB // n),
        ("same size (16 KiB)", lambda n: 16 * KiB),
    ]
    windows: list[tuple[str, int | str | None]] = [
        ("window 8", 8),
        ("budget holds all", None),
        ("half, 8 ahead", "half"),
    ]
    print(f"scheduler CPU per acquire (us, main thread), fastest of {repeats}, {steps} replayed steps each")
    print(
        f"{'setup':22s} {'budget':17s} {'N':>5s} {'tensor':>8s} {'us/acq':>8s} {'calls/acq':>9s} "
        f"{'ahead':>6s} {'evicted':>8s}"
    )
    ratios = []
    for sname, size_of in setups:
        for wname, window in windows:
            best: dict[int, float] = {}
            calls: dict[int, float] = {}
            stats: dict[int, ScheduleStats] = {}
            for _ in range(repeats):
                for n in counts:
                    us, calls[n], stats[n] = measure(n, size_of(n), window, steps)
                    best[n] = min(best.get(n, us), us)
            for n in counts:
                st = stats[n]
                print(
                    f"{sname:22s} {wname:17s} {n:5d} {size_of(n) / KiB:6.0f}Ki {best[n]:8.1f} {calls[n]:9.0f} "
                    f"{st.prefetches / steps:6.0f} {st.evictions / steps:8.0f}"
                )
            ratios.append((f"{sname}, {wname}", best[1024] / best[64], calls[1024] / calls[64]))
    for name, r, c in ratios:
        print(f"per acquire, 1024 / 64 tensors, {name}: CPU {r:.2f}x, calls {c:.2f}x")


if __name__ == "__main__":
    main()
