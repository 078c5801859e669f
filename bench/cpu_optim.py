"""tiermem's fused CPU optimizer kernels against the memory floor, and its drop-in optimizers against
torch's, in one run.

    python bench/cpu_optim.py [--params 32M] [--dropin 4x2M] [--repeat 9]

1. Each fused kernel, bf16 gradient in and bf16 weights out (TieredModel's call, check_finite=False),
   against "its floor": a kernel that reads and writes exactly the same bytes with next to no
   arithmetic, built by the same compiler with the same threads (tiermem/optim/kernels/csrc/*.py
   ``tm_streams*``, ``tm_adafactor_floor``). Bytes per parameter: Adam 28 (fp32 master and two
   moments read and written, grad and out 2 each), SGD with momentum / Adagrad / Lion 20, 8-bit Adam
   16, 8-bit Adam with bf16 master weights 12, Adam with bf16 master weights 20, Adafactor 20 over its
   three passes (a square matrix). Target >= 0.90x of the floor. (Adam with fp32 master weights runs
   the compiled kernel in adam_step and the native one, bit-identical to it, in the drop-ins: both.)
2. The 8-bit step, and the 8-bit step with bf16 master weights, against the fp32 Adam kernel
   (adam_step): target >= 1.4x faster.
3. The drop-ins against torch on the same fp32 parameters (the issue's case: 4 tensors of 2M): CPUAdam
   against AdamW(fused=True) with the found_inf check (its default) and without (the same bytes as
   torch's), CPUSGD / CPUAdagrad against fused SGD / Adagrad, CPUAdafactor against Adafactor(foreach),
   CPUAdam8bit against AdamW(fused=True). Target >= 0.90x where the bytes are equal. And each drop-in
   against its floor on the same tensors: the native streams kernel moving its bytes (fp32 grad, no
   out: Adam 28 B, SGD / Adagrad / Lion 20 B, 8-bit Adam 14 B, Adafactor three passes), one call per
   tensor as the drop-ins make them; torch's fused AdamW against the 28 B floor shows what the floor
   means on the machine. Target >= 0.90x. ``--dropins-only`` skips part 1 and 2.

Every measurement is the fastest of ``--repeat`` calls, taken in interleaved rounds so that other
work on the machine hits every contender alike. On a loaded machine, ``--threads 1 --cpu-time``
compares the contenders by the CPU time they take on one core (a two-thread call waits whenever
either thread is descheduled, which dominates wall times there). The ratios come last.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for bench._common

from bench._common import fastest_of
from tiermem.cli.models import parse_count
from tiermem.optim import (
    CPUSGD,
    CPUAdafactor,
    CPUAdagrad,
    CPUAdam,
    CPUAdam8bit,
    CPULion,
    StochasticRound,
    adafactor_step,
    adagrad_step,
    adam8bit_step,
    adam_step,
    lion_step,
    quantize_blockwise,
    sgd_step,
)
from tiermem.optim.adam_hyper import AdamHyper
from tiermem.optim.hypers import adam_scalars
from tiermem.optim.kernels import dispatch as _run, native as _native, quant as _quant

BF16 = torch.bfloat16
ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


CLOCK = time.perf_counter


def kernels(n: int) -> tuple[dict[str, Callable[[], None]], dict[str, str], dict[str, int]]:
    """name -> call of each fused kernel and each floor; kernel -> its floor; floor -> bytes/param."""
    torch.manual_seed(0)
    grad, out = torch.randn(n).mul_(1e-3).to(BF16), torch.empty(n, dtype=BF16)
    f32 = lambda: torch.randn(n)  # noqa: E731
    sr = StochasticRound.for_parameter(0, "w")
    keys = (ctypes.c_uint32 * 3)(*sr.keys(1))
    side = int(math.isqrt(n))
    mats = dict(
        master=torch.randn(side, side),
        grad=torch.randn(side, side).mul_(1e-3).to(BF16),
        out=torch.empty(side, side, dtype=BF16),
        row=torch.zeros(side),
        col=torch.zeros(side),
    )
    s = {
        k: f32()
        for k in (
            "adam_m",
            "adam_e",
            "adam_v",
            "adamn_m",
            "adamn_e",
            "adamn_v",
            "sgd_m",
            "sgd_b",
            "ada_m",
            "ada_s",
            "lion_m",
            "lion_e",
            "f1_m",
            "f1_s",
            "f2_m",
            "f2_a",
            "f2_b",
            "f8_m",
            "q8_m",
            "q8p_m",
        )
    }
    s["ada_s"].abs_()
    s["adam_v"].abs_().mul_(1e-6)
    s["adamn_v"].abs_().mul_(1e-6)
    b16 = {k: torch.randn(n).to(BF16) for k in ("sr_m", "q8sr_m", "f2sr_m", "f8sr_m")}
    q8 = [*quantize_blockwise(torch.randn(n) * 1e-3, True), *quantize_blockwise(torch.rand(n) * 1e-6, False)]
    q8sr, q8p = [t.clone() for t in q8], [t.clone() for t in q8]
    f8 = [t.clone() for t in q8]
    adam_sr_state = [torch.zeros(n), torch.zeros(n)]
    ew, a8, af = _native.library("elementwise"), _native.library("adam8bit"), _native.library("adafactor")
    a8p = _native.portable_library("adam8bit")
    P, nt, step = _native.ptr, _native.threads(), [0]

    def nxt() -> int:
        step[0] += 1
        return step[0]

    fns = {
        "Adam (fp32 master, compiled)": lambda: adam_step(
            s["adam_m"], s["adam_e"], s["adam_v"], grad, step=nxt(), out=out, check_finite=False, **ADAM
        ),
        "Adam (fp32 master, native)": lambda: _run.run(
            _run.ADAM,
            s["adamn_m"],
            (s["adamn_e"], s["adamn_v"]),
            grad,
            out,
            AdamHyper(step=nxt(), **ADAM),
            stochastic_round=None,
            check_finite=False,
            impl="native",
        ),
        "SGD momentum": lambda: sgd_step(
            s["sgd_m"], s["sgd_b"], grad, step=nxt() + 1, lr=1e-3, momentum=0.9, out=out, check_finite=False
        ),
        "Adagrad": lambda: adagrad_step(s["ada_m"], s["ada_s"], grad, step=nxt(), lr=1e-3, out=out, check_finite=False),
        "Lion": lambda: lion_step(s["lion_m"], s["lion_e"], grad, step=nxt(), lr=1e-4, out=out, check_finite=False),
        "Adafactor": lambda: adafactor_step(
            mats["master"],
            mats["grad"],
            step=nxt(),
            row_var=mats["row"],
            col_var=mats["col"],
            out=mats["out"],
            check_finite=False,
        ),
        "Adam (bf16 master, SR)": lambda: adam_step(
            b16["sr_m"], *adam_sr_state, grad, step=nxt(), out=out, stochastic_round=sr, check_finite=False, **ADAM
        ),
        "Adam 8-bit": lambda: adam8bit_step(s["q8_m"], *q8, grad, step=nxt(), out=out, check_finite=False, **ADAM),
        "Adam 8-bit + bf16 SR": lambda: adam8bit_step(
            b16["q8sr_m"], *q8sr, grad, step=nxt(), out=out, stochastic_round=sr, check_finite=False, **ADAM
        ),
        # the library's portable scalar build (-DTM_PORTABLE): what CPUs without AVX-512 ran before AVX2 codes
        "Adam 8-bit (portable scalar build)": lambda: a8p.tm_adam8bit(
            n,
            P(s["q8p_m"]),
            0,
            *(P(t) for t in q8p),
            P(grad),
            1,
            P(out),
            1,
            _native.floats(adam_scalars(AdamHyper(step=nxt(), **ADAM))),
            P(_quant.CONSTANTS),
            None,
            nt,
        ),
        "floor 28 B (2 fp32 states)": lambda: ew.tm_streams(
            n, P(s["f2_m"]), 0, P(s["f2_a"]), P(s["f2_b"]), P(grad), 1, P(out), 1, None, nt
        ),
        "floor 20 B (1 fp32 state)": lambda: ew.tm_streams(
            n, P(s["f1_m"]), 0, P(s["f1_s"]), None, P(grad), 1, P(out), 1, None, nt
        ),
        "floor 20 B (bf16 master, 2 states)": lambda: ew.tm_streams(
            n, P(b16["f2sr_m"]), 1, P(s["f2_a"]), P(s["f2_b"]), P(grad), 1, P(out), 1, keys, nt
        ),
        "floor 16 B (8-bit)": lambda: a8.tm_streams8(
            n, P(s["f8_m"]), 0, *(P(t) for t in f8), P(grad), 1, P(out), 1, None, nt
        ),
        "floor 12 B (8-bit, bf16 master)": lambda: a8.tm_streams8(
            n, P(b16["f8sr_m"]), 1, *(P(t) for t in f8), P(grad), 1, P(out), 1, keys, nt
        ),
        "floor Adafactor (3 passes, 20 B)": lambda: af.tm_adafactor_floor(
            side * side, P(mats["master"]), 0, P(mats["grad"]), 1, P(mats["out"]), 1, None, nt
        ),
    }
    floors = {
        "Adam (fp32 master, compiled)": "floor 28 B (2 fp32 states)",
        "Adam (fp32 master, native)": "floor 28 B (2 fp32 states)",
        "SGD momentum": "floor 20 B (1 fp32 state)",
        "Adagrad": "floor 20 B (1 fp32 state)",
        "Lion": "floor 20 B (1 fp32 state)",
        "Adafactor": "floor Adafactor (3 passes, 20 B)",
        "Adam (bf16 master, SR)": "floor 20 B (bf16 master, 2 states)",
        "Adam 8-bit": "floor 16 B (8-bit)",
        "Adam 8-bit + bf16 SR": "floor 12 B (8-bit, bf16 master)",
    }
    sizes = {"Adafactor": side * side, "floor Adafactor (3 passes, 20 B)": side * side}
    return fns, floors, sizes


def dropins(
    count: int, numel: int
) -> tuple[dict[str, Callable[[], None]], list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """Each drop-in, its torch counterpart and its floor on ``count`` fp32 tensors of ``numel``: the
    calls; the (label, drop-in, torch) pairs; the (label, drop-in, floor) pairs."""

    def params(two_d: bool = False) -> list[torch.nn.Parameter]:
        torch.manual_seed(1)
        shape = (int(math.isqrt(numel)),) * 2 if two_d else (numel,)
        ps = [torch.nn.Parameter(torch.randn(shape)) for _ in range(count)]
        for p in ps:
            p.grad = torch.randn(shape) * 1e-3
        return ps

    made = {
        "CPUAdam": CPUAdam(params(), lr=1e-3, weight_decay=0.01),
        "CPUAdam check_finite=False": CPUAdam(params(), lr=1e-3, weight_decay=0.01, check_finite=False),
        "torch AdamW(fused=True)": torch.optim.AdamW(params(), lr=1e-3, weight_decay=0.01, fused=True),
        "CPUSGD check_finite=False": CPUSGD(params(), lr=1e-3, momentum=0.9, check_finite=False),
        "torch SGD(fused=True)": torch.optim.SGD(params(), lr=1e-3, momentum=0.9, fused=True),
        "torch SGD(foreach=True)": torch.optim.SGD(params(), lr=1e-3, momentum=0.9, foreach=True),
        "CPUAdagrad check_finite=False": CPUAdagrad(params(), lr=1e-3, check_finite=False),
        "torch Adagrad(fused=True)": torch.optim.Adagrad(params(), lr=1e-3, fused=True),
        "CPUAdafactor check_finite=False": CPUAdafactor(params(True), lr=1e-3, check_finite=False),
        "torch Adafactor(foreach=True)": torch.optim.Adafactor(params(True), lr=1e-3, foreach=True),
        "CPULion check_finite=False": CPULion(params(), lr=1e-4, check_finite=False),
        "CPUAdam8bit check_finite=False": CPUAdam8bit(params(), lr=1e-3, check_finite=False),
    }
    calls = {k: opt.step for k, opt in made.items()}
    calls.update(dropin_floors(count, numel))
    versus_torch = [
        ("CPUAdam (found_inf check) / AdamW fused", "CPUAdam", "torch AdamW(fused=True)"),
        ("CPUAdam check_finite=False / AdamW fused", "CPUAdam check_finite=False", "torch AdamW(fused=True)"),
        ("CPUSGD / SGD fused", "CPUSGD check_finite=False", "torch SGD(fused=True)"),
        ("CPUSGD / SGD foreach", "CPUSGD check_finite=False", "torch SGD(foreach=True)"),
        ("CPUAdagrad / Adagrad fused", "CPUAdagrad check_finite=False", "torch Adagrad(fused=True)"),
        ("CPUAdafactor / Adafactor foreach", "CPUAdafactor check_finite=False", "torch Adafactor(foreach=True)"),
        ("CPUAdam8bit / AdamW fused (fewer bytes)", "CPUAdam8bit check_finite=False", "torch AdamW(fused=True)"),
    ]
    versus_floor = [
        ("CPUAdam check_finite=False / floor 28 B", "CPUAdam check_finite=False", "floor 28 B (fp32 grad, 2 states)"),
        ("torch AdamW fused / floor 28 B", "torch AdamW(fused=True)", "floor 28 B (fp32 grad, 2 states)"),
        ("CPUSGD / floor 20 B", "CPUSGD check_finite=False", "floor 20 B (fp32 grad, 1 state)"),
        ("CPUAdagrad / floor 20 B", "CPUAdagrad check_finite=False", "floor 20 B (fp32 grad, 1 state)"),
        ("CPULion / floor 20 B", "CPULion check_finite=False", "floor 20 B (fp32 grad, 1 state)"),
        ("CPUAdafactor / floor (3 passes)", "CPUAdafactor check_finite=False", "floor Adafactor (fp32, 3 passes)"),
        ("CPUAdam8bit / floor 14 B (8-bit)", "CPUAdam8bit check_finite=False", "floor 14 B (fp32 grad, 8-bit)"),
    ]
    return calls, versus_torch, versus_floor


def dropin_floors(count: int, numel: int) -> dict[str, Callable[[], None]]:
    """The drop-ins' floors: the same tensors' bytes (fp32 master and grad, no out; the drop-ins' calls)
    moved by the native streams kernels, one call per tensor as the drop-ins make them. Bytes per
    parameter: Adam 28, one fp32 state 20, 8-bit 14 (and the absmax), Adafactor three passes."""
    torch.manual_seed(2)
    side = int(math.isqrt(numel))
    f32 = lambda k=numel: [torch.randn(k) for _ in range(count)]  # noqa: E731
    m2, a2, b2, g2 = f32(), f32(), f32(), f32()
    m1, a1, g1 = f32(), f32(), f32()
    m8, g8 = f32(), f32()
    q8 = [[*quantize_blockwise(torch.randn(numel) * 1e-3, True), *quantize_blockwise(torch.rand(numel), False)]]
    q8 += [[t.clone() for t in q8[0]] for _ in range(count - 1)]
    mf, gf = f32(side * side), f32(side * side)
    ew, a8, af = _native.library("elementwise"), _native.library("adam8bit"), _native.library("adafactor")
    P, nt = _native.ptr, _native.threads()

    def each(fn: Callable[[int], object]) -> Callable[[], None]:
        def run() -> None:
            for i in range(count):
                fn(i)

        return run

    return {
        "floor 28 B (fp32 grad, 2 states)": each(
            lambda i: ew.tm_streams(numel, P(m2[i]), 0, P(a2[i]), P(b2[i]), P(g2[i]), 0, None, -1, None, nt)
        ),
        "floor 20 B (fp32 grad, 1 state)": each(
            lambda i: ew.tm_streams(numel, P(m1[i]), 0, P(a1[i]), None, P(g1[i]), 0, None, -1, None, nt)
        ),
        "floor 14 B (fp32 grad, 8-bit)": each(
            lambda i: a8.tm_streams8(numel, P(m8[i]), 0, *(P(t) for t in q8[i]), P(g8[i]), 0, None, -1, None, nt)
        ),
        "floor Adafactor (fp32, 3 passes)": each(
            lambda i: af.tm_adafactor_floor(side * side, P(mf[i]), 0, P(gf[i]), 0, None, -1, None, nt)
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="32M", help="parameters per kernel call (default 32M)")
    ap.add_argument("--dropin", default="4x2M", help="the drop-ins' parameters: COUNTxNUMEL (default 4x2M)")
    ap.add_argument("--repeat", type=int, default=9, help="timed calls per contender (fastest wins)")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op threads for every contender (default: torch's); 1 is steadier on a loaded machine",
    )
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="with --threads 1: time the CPU the calling thread spends, not the wall clock (what other "
        "jobs on a loaded machine take from us does not count)",
    )
    ap.add_argument("--dropins-only", action="store_true", help="measure the drop-ins (part 3) only")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        if torch.get_num_threads() != 1:
            ap.error("--cpu-time needs --threads 1 (other threads' time would not be counted)")
        global CLOCK
        CLOCK = time.thread_time
    n = parse_count(args.params)
    count, numel = (int(args.dropin.split("x")[0]), parse_count(args.dropin.split("x")[1]))
    t0 = time.perf_counter()
    for lib in ("elementwise", "adam8bit", "adafactor"):
        _native.library(lib)
    print(
        f"CPU optimizers, {n / 1e6:.0f}M parameters a kernel, drop-ins on {count} x {numel / 1e6:.0f}M, "
        f"{torch.get_num_threads()} threads, {'CPU time' if args.cpu_time else 'wall clock'}, torch "
        f"{torch.__version__}; native kernels ready in {time.perf_counter() - t0:.1f} s"
    )

    floors: dict[str, str] = {}
    rate: dict[str, float] = {}
    if not args.dropins_only:
        fns, floors, sizes = kernels(n)
        best = fastest_of(fns, args.repeat, CLOCK)
        rate = {k: sizes.get(k, n) / t for k, t in best.items()}
        width = max(len(k) for k in fns) + 2
        print(f"\n{'kernel (bf16 grad in, bf16 out)':<{width}} Gparam/s   ms/step   (fastest of {args.repeat})")
        for k in fns:
            print(f"{k:<{width}} {rate[k] / 1e9:8.3f}  {best[k] * 1e3 * n / sizes.get(k, n):8.1f}")

    steps, pairs, floor_pairs = dropins(count, numel)
    best_d = fastest_of(steps, args.repeat, CLOCK)
    width_d = max(len(k) for k in steps) + 2
    print(f"\n{'drop-in (fp32 parameters)':<{width_d}} ms/step")
    for k in steps:
        print(f"{k:<{width_d}} {best_d[k] * 1e3:8.2f}")

    print("\nratios (speed, higher is faster):")
    for k, floor in floors.items():
        r = rate[k] / rate[floor]
        print(f"  {k + ' / its floor':<44} {r:5.2f}x   [target >= 0.90x: {'ok' if r >= 0.9 else 'MISSED'}]")
    adam = rate.get("Adam (fp32 master, compiled)", math.nan)
    for k in () if args.dropins_only else ("Adam 8-bit", "Adam 8-bit + bf16 SR"):
        r = rate[k] / adam
        print(f"  {k + ' / fp32 Adam kernel':<44} {r:5.2f}x   [target >= 1.40x: {'ok' if r >= 1.4 else 'MISSED'}]")
    if not args.dropins_only:  # the vector codes (AVX-512 or AVX2) against the portable scalar ones
        r = rate["Adam 8-bit"] / rate["Adam 8-bit (portable scalar build)"]
        print(f"  {'Adam 8-bit / its portable scalar build':<44} {r:5.2f}x")
    for label, ours, theirs in pairs + floor_pairs:
        r = best_d[theirs] / best_d[ours]
        verdict = f"   [target >= 0.90x: {'ok' if r >= 0.9 else 'MISSED'}]"
        target = "" if "check)" in label or "fewer" in label or label.startswith("torch") else verdict
        print(f"  {label:<44} {r:5.2f}x{target}")


if __name__ == "__main__":
    main()
