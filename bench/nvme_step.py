"""Steady-state training step with the optimizer state on NVMe, against its floor, in one run.

    python bench/nvme_step.py [--width 2048] [--depth 24] [--rows 128] [--steps 3] [--rounds 2]
                              [--warmup 2] [--dir DIR] [--fio-size 1GiB] [--bucket-size 32MiB]

The model is a stack of ``--depth`` square bias-free Linear layers (``--width``; the defaults give
~100M parameters, 1.2 GB of optimizer state, so that state I/O dominates the step), trained in
bf16 on ``--rows`` random rows per step. Three setups, each trained in a fresh process of its own
(the script runs itself with ``--one NAME``, which prints one JSON line) on its own directory under
``--dir``: on this machine identical models in one process step at systematically different
speeds (bench/RESULTS.md, "2026-12-01 One model per process"), which made the setup stepped first
(state-on-nvme) look slow. ``--rounds`` rounds, the setups' order reversed every other round
(A B C, C B A, ...) so that drift in the load and the disk falls on all alike; each run takes
``--warmup`` steps, then ``--steps`` measured ones:

- ``state-on-nvme``: ZeRO-Offload with OPTIM_STATE on NVMe (examples/nvme_offload.py's policy):
  weights on the device tier, grads on the host, the state streamed through the three-stage
  pipeline (read ahead, Adam, write behind);
- ``zero-infinity``: ``ZeroInfinity()``: the weights on NVMe too, fetched ahead of each layer in
  the order the first step recorded (the scheduler's prefetch);
- ``zero-infinity, no prefetch``: the same, with the scheduler fetching only on demand (its
  ``prefetch`` flag cleared before the first step), for contrast.

The floor of ``tm.step()`` is max(I/O, Adam). I/O is the bytes the step must read from and write
to NVMe at fio's sequential bandwidth (8 MiB blocks, O_DIRECT, libaio, iodepth 8) on the same
directory, three ways: ``serial`` (the target's: bytes read / fio read + bytes written / fio
write, the disk doing one thing at a time), ``mixed`` (all bytes / fio reading and writing at
once, half each, as the pipeline issues them) and ``overlapped`` (max of bytes read / fio read and
bytes written / fio write: each direction at its own full speed, the lowest floor). The disk
drifts by tens of percent within a minute, so fio runs after every measured step, in the same
process, and each step is compared with the floor measured right after it (ratios are medians
over all of a setup's measured steps). Adam is ``adam_step`` over as many parameters in
memory (fp32 grads in, bf16 weights out, as the step calls it), measured in this run. The
state-on-nvme step moves exactly the state (12 B/param read, 12 written; with ``--state 8bit``,
AdamW8bit with bf16 master weights rounded stochastically, 4.03 and 4.03, the Adam term then
``adam8bit_step``'s); ZeroInfinity's also
writes the new bf16 weights home (2 B/param; the report's bytes_moved does not count those
writes, so the bytes a step must move are computed, and the report's count printed beside them;
with ``--state 8bit`` the bf16 master is the weights, so nothing more is written).
The floor of a whole iteration is the state-on-nvme setup's forward+backward (weights resident:
compute alone) plus the step's serial floor.

Stall time is what the training thread spent waiting on transfers (``tm.report()``, per step):
during forward+backward that is waiting for weights (ZeroInfinity), which prefetch is meant to
hide; during ``tm.step()`` it is mostly the pipeline waiting on the disk, which is the floor
itself. Figures are medians over a setup's ``--rounds`` x ``--steps`` measured steps (each run's
``--warmup`` steps first: the first records the trace and loads the compiled Adam). The load average is printed: other processes share the CPUs.
Ratios come last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for examples

from bench._common import at_most, nvme_bytes, run_again
from bench._fio import sequential_bandwidth
from examples.nvme_offload import OptimStateOnNvme
from tiermem import AdamW, AdamW8bit, TieredModel, parse_bytes
from tiermem.errors import fmt_bytes
from tiermem.optim import StochasticRound, adam8bit_step, adam_step, quantize_blockwise, warm_up
from tiermem.policies import ZeroInfinity

GB = 1e9
LR, BETAS, WD = 1e-4, (0.9, 0.95), 0.1


class LinearStack(nn.Module):
    """``depth`` bias-free ``width`` x ``width`` Linear layers with tanh between them."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def windowed_stack(width: int, depth: int) -> LinearStack:
    """A LinearStack whose layers' weights are windows of one random buffer, each shifted by a few
    thousand elements: distinct weights, but the module takes the memory of one layer, so a model
    larger than RAM can be handed to TieredModel, which copies each weight to its home tier."""
    with torch.device("meta"):
        model = LinearStack(width, depth)
    shift = 4099
    base = torch.randn(width * width + depth * shift, dtype=torch.bfloat16) * width**-0.5
    for i, layer in enumerate(model.layers):
        layer.weight = nn.Parameter(base[i * shift : i * shift + width * width].view(width, width))
    return model


@dataclass
class Setup:
    name: str
    tm: Optional[TieredModel] = None  # only in the process that trains it
    weights_on_nvme: bool = False
    fwd_bwd: list[float] = field(default_factory=list)
    step: list[float] = field(default_factory=list)
    stall_fwd_bwd: list[float] = field(default_factory=list)
    stall_step: list[float] = field(default_factory=list)
    read: list[int] = field(default_factory=list)  # NVMe bytes read during tm.step()
    written: list[int] = field(default_factory=list)  # NVMe bytes written during tm.step()
    read_fwd_bwd: list[int] = field(default_factory=list)  # NVMe bytes read during forward+backward
    fios: list[dict[str, float]] = field(default_factory=list)  # fio right after each measured step
    sched: Optional[dict[str, float]] = None  # the scheduler's last iteration (ZeroInfinity)
    report: str = ""

    SERIES = ("fwd_bwd", "step", "stall_fwd_bwd", "stall_step", "read", "written", "read_fwd_bwd", "fios")


def run_step(s: Setup, x: torch.Tensor, record: bool) -> str:
    """One forward + backward + step, timed in two parts, with the stalls and NVMe bytes of each."""
    r0 = s.tm.report()
    t0 = time.perf_counter()
    s.tm.backward(s.tm(x).float().square().mean())
    t1 = time.perf_counter()
    r1 = s.tm.report()
    t2 = time.perf_counter()
    s.tm.step()
    t3 = time.perf_counter()
    r2 = s.tm.report()
    (a0, _), (a1, w1), (a2, w2) = nvme_bytes(r0), nvme_bytes(r1), nvme_bytes(r2)
    row = (
        t1 - t0,
        t3 - t2,
        r1.stall_seconds - r0.stall_seconds,
        r2.stall_seconds - r1.stall_seconds,
        a2 - a1,
        w2 - w1,
        a1 - a0,
    )
    if record:
        for series, value in zip(
            (s.fwd_bwd, s.step, s.stall_fwd_bwd, s.stall_step, s.read, s.written, s.read_fwd_bwd), row
        ):
            series.append(value)
    return (
        f"{s.name}: fwd+bwd {1e3 * row[0]:7.0f} ms (stall {1e3 * row[2]:5.0f}), step {1e3 * row[1]:7.0f} ms "
        f"(stall {1e3 * row[3]:5.0f}, NVMe read {row[4] / GB:.2f} GB, written {row[5] / GB:.2f} GB)"
    )


def fio(directory: str, size: int) -> dict[str, float]:
    """fio's sequential bandwidth (B/s) on ``directory``: ``write``, ``read``, and ``mixed`` (reads and
    writes at once, half each, the sum of both) -- 8 MiB blocks, O_DIRECT, libaio, iodepth 8."""
    return sequential_bandwidth(directory, size, {"write": "write", "read": "read", "mixed": "rw"}, name="nvme-step")


def adam_seconds(n: int, state: str = "fp32", repeats: int = 3) -> float:
    """Best time of the step's kernel over ``n`` parameters in memory, as the step calls it:
    ``adam_step`` (fp32 master and moments, bf16 weights out), or with ``state="8bit"``
    ``adam8bit_step`` (bf16 master rounded stochastically, 8-bit moments)."""
    warm_up((torch.float32,), (torch.bfloat16,))
    grad, best = torch.randn(n) * 1e-3, float("inf")
    hyper = dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=1e-8, weight_decay=WD, adamw=True, check_finite=False)
    if state == "fp32":
        master, out = torch.randn(n), torch.empty(n, dtype=torch.bfloat16)
        moments = (torch.zeros(n), torch.zeros(n))
        kernel, extra = adam_step, {"out": out}
    else:
        master = torch.randn(n).to(torch.bfloat16)
        moments = (*quantize_blockwise(torch.zeros(n), True), *quantize_blockwise(torch.zeros(n), False))
        kernel, extra = adam8bit_step, {"stochastic_round": StochasticRound.for_parameter(0, "w")}
    for step in range(1, repeats + 1):
        t0 = time.perf_counter()
        kernel(master, *moments, grad, step=step, **hyper, **extra)
        best = min(best, time.perf_counter() - t0)
    return best


def state_bytes(state: str) -> float:
    """Optimizer-state bytes per parameter on NVMe: fp32 master and moments (12), or a bf16 master
    that is the weights themselves and 8-bit moments with an fp32 absmax per 256 (4.03)."""
    return 12.0 if state == "fp32" else 2 + 2 * (1 + 4 / 256)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=24)
    p.add_argument("--rows", type=int, default=128, help="rows of input per step")
    p.add_argument("--steps", type=int, default=3, help="measured steps per run of a setup (fio after each)")
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="runs per setup, each in a fresh process, the order reversed every other round",
    )
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first in each run")
    p.add_argument("--bucket-size", default="32MiB", help="TieredModel bucket_size")
    p.add_argument(
        "--state",
        choices=("fp32", "8bit"),
        default="fp32",
        help="optimizer state: fp32 AdamW (12 B/param), or AdamW8bit with bf16 master weights rounded "
        "stochastically (4.03 B/param, the master being the weights: one copy on NVMe)",
    )
    p.add_argument("--fio-size", default="1GiB", help="bytes per fio pass (three passes after each measured step)")
    p.add_argument(
        "--dir",
        default=None,
        help="directory on the disk to test (default: a temporary one under the current directory, removed afterwards)",
    )
    p.add_argument("--one", choices=SETUPS, default=None, help=argparse.SUPPRESS)  # one run, as a JSON line
    args = p.parse_args()
    if min(args.width, args.depth, args.rows, args.steps, args.rounds) < 1 or args.warmup < 1:
        p.error(
            "--width, --depth, --rows, --steps, --rounds must be >= 1 and --warmup >= 1 (the first step "
            "records the trace)"
        )
    return args


def med(xs: list[float]) -> float:
    return statistics.median(xs)


SETUPS = ("state-on-nvme", "zero-infinity", "zero-infinity, no prefetch")


def run_one(args: argparse.Namespace, root: str) -> Setup:
    """``args.one`` trained in this process in a directory of its own under ``root``: ``--warmup``
    steps, then ``--steps`` measured ones, fio on the same directory after each."""
    d = tempfile.mkdtemp(prefix=args.one.replace(" ", "").replace(",", "-") + "-", dir=root)
    try:
        torch.manual_seed(0)
        policy = OptimStateOnNvme() if args.one == "state-on-nvme" else ZeroInfinity()
        tm = TieredModel(
            LinearStack(args.width, args.depth),
            policy,
            optimizer=AdamW(lr=LR, betas=BETAS, weight_decay=WD)
            if args.state == "fp32"
            else AdamW8bit(lr=LR, betas=BETAS, weight_decay=WD, bf16_stochastic_round=True),
            precision="bf16",
            nvme_dir=d,
            bucket_size=args.bucket_size,
            prefetch=args.one != "zero-infinity, no prefetch",
        )
        s = Setup(args.one, tm, weights_on_nvme=tm.param_offload is not None)
        gen = torch.Generator().manual_seed(0)
        for i in range(args.warmup + args.steps):
            line = run_step(s, torch.randn(args.rows, args.width, generator=gen), record=i >= args.warmup)
            print(f"{'warm-up' if i < args.warmup else 'step':>7} {i + 1}: {line}", file=sys.stderr, flush=True)
            if i >= args.warmup:  # the disk drifts: measure it right after the step it is compared with
                s.fios.append(fio(d, parse_bytes(args.fio_size, what="--fio-size")))
        if tm.param_offload:
            st = tm.param_offload.scheduler.history[-1]
            s.sched = {k: getattr(st, k) for k in ("acquires", "hits", "late", "misses", "prefetches", "stall_seconds")}
        s.report = str(tm.report())
        tm.detach()  # deletes the model's files
        s.tm = None
        return s
    finally:
        shutil.rmtree(d, ignore_errors=True)


def spawn(name: str, root: str) -> Setup:
    """One run of ``name`` in a fresh process; its last output line is the JSON result."""
    d = run_again(__file__, [*sys.argv[1:], "--one", name, "--dir", root], name)  # its per-step lines: our stderr
    return Setup(name, **d)


def main() -> int:
    args = parse_args()
    if shutil.which("fio") is None:
        print(
            "fio not found on PATH: the floor needs fio's bandwidth on the same directory; install fio", file=sys.stderr
        )
        return 2
    parse_bytes(args.fio_size, what="--fio-size")  # a bad size fails here, before any run
    root = args.dir or tempfile.mkdtemp(prefix="tiermem-nvme-step-", dir=os.getcwd())
    n = args.width * args.width * args.depth
    if args.one is None:
        print(
            f"{args.depth} Linear layers of {args.width} x {args.width}: {n / 1e6:.1f}M parameters, optimizer "
            f"state ({args.state}) {fmt_bytes(int(state_bytes(args.state) * n))} (as much on disk: each value "
            f"once); {args.rows} rows per step; "
            f"directory {root}; {torch.get_num_threads()} CPU threads; load average at start "
            f"{os.getloadavg()[0]:.2f}; each setup in its own process, {args.rounds} rounds of {args.steps} "
            f"measured steps",
            flush=True,
        )

    def show(when: str, bw: dict[str, float]) -> str:
        return f"fio{when}: " + ", ".join(f"{k} {v / GB:.2f} GB/s" for k, v in bw.items())

    if args.one is not None:
        s = run_one(args, root)
        print(json.dumps({k: getattr(s, k) for k in (*Setup.SERIES, "weights_on_nvme", "sched", "report")}), flush=True)
        return 0
    try:
        setups = {name: Setup(name) for name in SETUPS}
        for r in range(args.rounds):
            for name in SETUPS if r % 2 == 0 else SETUPS[::-1]:  # A B C, then C B A
                t0 = time.perf_counter()
                one = spawn(name, root)
                s = setups[name]
                for k in Setup.SERIES:
                    getattr(s, k).extend(getattr(one, k))
                s.weights_on_nvme, s.sched, s.report = one.weights_on_nvme, one.sched, one.report
                print(
                    f"round {r + 1}, {name}: tm.step() "
                    + " ".join(f"{1e3 * t:.0f}" for t in one.step)
                    + " ms; "
                    + "; ".join(show("", f) for f in one.fios)
                    + f"; run {time.perf_counter() - t0:.0f} s; load average {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
        setups = list(setups.values())
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    adam = adam_seconds(n, args.state)

    fios = [f for s in setups for f in s.fios]
    bw = {k: med([f[k] for f in fios]) for k in fios[0]}
    print(
        f"\n{show(f' (median of {len(fios)} passes)', bw)}; "
        f"{'adam_step' if args.state == 'fp32' else 'adam8bit_step (bf16 master, SR)'} over {n / 1e6:.1f}M "
        f"parameters in memory: {1e3 * adam:.0f} ms ({n / adam / 1e9:.2f} Gparam/s)"
    )
    # What a step must move: the state, read and written; ZeroInfinity also writes the new bf16 weights
    # home, unless its bf16 master is those weights (--state 8bit: NOTE [One copy of bf16 master weights]).
    sb, weights = state_bytes(args.state), 2 if args.state == "fp32" else 0
    must = {s.name: (sb * n, sb * n + (weights * n if s.weights_on_nvme else 0)) for s in setups}

    def floors(name: str, kind: str) -> list[float]:
        """The floor of each of the setup's measured steps, from the fio run right after it."""
        s = next(s for s in setups if s.name == name)
        r, w = must[name]
        io = {
            "serial": lambda f: r / f["read"] + w / f["write"],  # the disk doing one thing at a time
            "mixed": lambda f: (r + w) / f["mixed"],  # reads and writes at once, as the pipeline issues them
            "overlapped": lambda f: max(r / f["read"], w / f["write"]),
        }[kind]  # each at its own full speed
        return [max(io(f), adam) for f in s.fios]

    def ratio_of(s: Setup, kind: str) -> float:
        """Median over rounds of the step's time against the floor measured in its round."""
        return med([t / fl for t, fl in zip(s.step, floors(s.name, kind))])

    floor = {s.name: med(floors(s.name, "serial")) for s in setups}
    compute = med(setups[0].fwd_bwd)  # weights resident: forward+backward is compute alone
    iteration = {s.name: med([a + b for a, b in zip(s.fwd_bwd, s.step)]) for s in setups}
    for s in setups:
        r, w = must[s.name]
        print(
            f"\n{s.name} (median of {len(s.step)} steps): fwd+bwd {1e3 * med(s.fwd_bwd):.0f} ms "
            f"(stalled {1e3 * med(s.stall_fwd_bwd):.0f} ms, NVMe read {med(s.read_fwd_bwd) / GB:.3f} GB), "
            f"tm.step() {1e3 * med(s.step):.0f} ms (stalled {1e3 * med(s.stall_step):.0f} ms), iteration "
            f"{1e3 * iteration[s.name]:.0f} ms"
        )
        print(
            f"  the step must read {r / GB:.2f} GB from NVMe and write {w / GB:.2f} GB (the report counted "
            f"{med(s.read) / GB:.2f} and {med(s.written) / GB:.2f}); floor max(I/O, Adam), I/O at fio's "
            + ", ".join(
                f"{kind} bandwidth {1e3 * med(floors(s.name, kind)):.0f} ms"
                for kind in ("serial", "mixed", "overlapped")
            )
        )
        if s.sched is not None:
            st = s.sched
            print(
                f"  scheduler, last iteration of the last run: {st['acquires']} acquires = {st['hits']} hits + "
                f"{st['late']} late + {st['misses']} misses; {st['prefetches']} prefetches; stalled "
                f"{1e3 * st['stall_seconds']:.0f} ms"
            )
        print("  last run's report: " + s.report.replace("\n", "\n  "))

    print(
        f"\nload average at the end {os.getloadavg()[0]:.2f} (1 min), {os.getloadavg()[1]:.2f} (5 min) "
        f"on {os.cpu_count()} CPUs: other processes share them"
    )
    print("\n== ratios ==")
    for kind in ("serial", "mixed", "overlapped"):
        for s in setups:
            ratio = ratio_of(s, kind)
            target = f"  ({at_most(ratio, 1.15)})" if s is setups[0] and kind == "serial" else ""
            print(f"{s.name + ':':<28} tm.step() / floor, {kind + ' I/O':<15}{ratio:5.2f}x{target}")
    for s in setups:
        ratio = med([a + b for a, b in zip(s.fwd_bwd, s.step)]) / (compute + floor[s.name])
        print(f"{s.name + ':':<28} fwd+bwd+step / (compute + floor)  {ratio:5.2f}x")
    for s in setups[1:]:
        frac = med(s.stall_fwd_bwd) / iteration[s.name]
        target = f"  (target <= 10%: {'met' if frac <= 0.10 else 'NOT met'})" if s is setups[1] else "  (contrast)"
        print(f"{s.name + ':':<28} weight stalls / iteration         {100 * frac:5.1f}%{target}")
    for s in setups:
        frac = (med(s.stall_fwd_bwd) + med(s.stall_step)) / iteration[s.name]
        print(
            f"{s.name + ':':<28} all stalls / iteration            {100 * frac:5.1f}%  (with the step's waits "
            f"on the disk)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
