"""The native C++ Adam (``tm_adam``, tiermem/optim/kernels/csrc/elementwise.py) against the torch.compile'd
one (tiermem/optim/kernels/compiled.py) on fp32 master weights: the cases the default ``adam_step`` runs.

    python bench/native_adam_ab.py [--bits-only | --speed-only] [--params 16] [--repeat 9]

Part 1, bits: for each case (grad fp32/bf16/fp16, out none/bf16/fp32/fp16, AdamW / Adam-L2, beta1
above and below 0.5, loss scale and clip, sizes with odd tails) both kernels take the same inputs for
several steps in a row, their state carried on; prints max |diff| in ulps of master, exp_avg,
exp_avg_sq and out per case, and the finite checks' answers on gradients with an inf or a NaN placed
at the head, the middle and the tail.

Part 2, speed: both kernels on the same buffers (bf16 grad in, bf16 out, AdamW), interleaved
rounds, median of --repeat; one thread (CPU time of the calling thread) and the default thread count
(wall time). Ratio native / compiled printed last (below 1: native faster).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for bench._common

from bench._common import interleaved_times
from tiermem.optim.adam_hyper import AdamHyper
from tiermem.optim.hypers import adam_scalars
from tiermem.optim.kernels import compiled as _compiled, dispatch as _run, native as _native

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SIZES = (1, 2, 3, 7, 15, 16, 17, 31, 33, 63, 64, 65, 127, 1000, 4097, 65537, (1 << 20) + 3)
HYPERS = {  # name -> (AdamHyper keywords, grad_scale, clip_coef)
    "adamw wd=0.01": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True),
    "adamw wd=0": dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-6, weight_decay=0.0, adamw=True),
    "adam l2=0.1": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=False),
    "adamw b1=0.3 scaled clipped": dict(
        lr=1e-2, beta1=0.3, beta2=0.99, eps=1e-8, weight_decay=0.05, adamw=True, grad_scale=1024.0, clip_coef=0.37
    ),
    "adam l2 b1=0.5": dict(lr=1e-2, beta1=0.5, beta2=0.9, eps=1e-8, weight_decay=0.01, adamw=False),
}
STEPS = 3


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Max distance in units of the last place between two same-dtype float tensors (bit-level; 0
    means bit identical; NaN payload differences count)."""
    if a.numel() == 0:
        return 0
    int_t = {F32: torch.int32, BF16: torch.int16, F16: torch.int16}[a.dtype]
    top = {torch.int32: 1 << 31, torch.int16: 1 << 15}[int_t]

    def ordered(x: torch.Tensor) -> torch.Tensor:  # monotone integer image of the float order
        i = x.view(int_t).to(torch.int64)
        return torch.where(i < 0, -(i + top), i)

    return int((ordered(a) - ordered(b)).abs().max())


def _hyper(kw: dict, step: int) -> AdamHyper:
    kw = dict(kw)
    gs, cc = kw.pop("grad_scale", 1.0), kw.pop("clip_coef", 1.0)
    return AdamHyper(step=step, grad_scale=gs, clip_coef=cc, **kw)


def native_adam(master, m, v, grad, out, hyper: AdamHyper) -> None:
    lib = _native.library("elementwise")
    fn, args = _run.ADAM.native(
        lib, master.numel(), master, (m, v), grad, out, _native.floats(adam_scalars(hyper)), None
    )
    fn(*args)


def bits(compiled: _compiled.CompiledAdam) -> int:
    worst = 0
    gen = torch.Generator().manual_seed(0)
    print("part 1: max |diff| in ulps, native vs compiled, after each of", STEPS, "steps (master m v out)")
    for (hname, kw), gdt, odt in itertools.product(HYPERS.items(), (F32, BF16, F16), (None, BF16, F32, F16)):
        case_worst = [0, 0, 0, 0]
        for n in SIZES:
            master = torch.randn(n, generator=gen) * 0.05
            ma, va = torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-6
            a = [master.clone(), ma.clone(), va.clone()]
            b = [master.clone(), ma.clone(), va.clone()]
            out_a = None if odt is None else torch.empty(n, dtype=odt)
            out_b = None if odt is None else torch.empty(n, dtype=odt)
            for step in range(1, STEPS + 1):
                scale = kw.get("grad_scale", 1.0)
                g32 = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3) * 1e-3 * scale
                grad = g32.to(gdt)
                h = _hyper(kw, step)
                compiled.adam(*a, grad, out_a, h)
                native_adam(*b, grad, out_b, h)
                d = [ulps(x, y) for x, y in zip(a, b)] + [0 if out_a is None else ulps(out_a, out_b)]  # type: ignore[arg-type]
                case_worst = [max(x, y) for x, y in zip(case_worst, d)]
        worst = max(worst, *case_worst)
        print(f"  {hname:<28} grad {str(gdt)[6:]:<8} out {str(odt)[6:] if odt else 'none':<8} ulps {case_worst}")
    # the finite checks: the same answer everywhere
    disagree = 0
    for gdt, n in itertools.product((F32, BF16, F16), (1, 17, 1 << 15, (1 << 16) + 5, (1 << 20) + 3)):
        for bad, where in itertools.product((float("inf"), float("-inf"), float("nan"), None), (0, n // 2, n - 1)):
            g = torch.randn(n).to(gdt)
            if bad is not None:
                g[where] = bad
            if compiled.any_nonfinite(g) != _native.any_nonfinite(g):
                disagree += 1
    print(f"  finite check: {disagree} disagreements (grad fp32/bf16/fp16, 5 sizes, inf/-inf/nan/none x 3 places)")
    return max(worst, disagree)


def speed(compiled: _compiled.CompiledAdam, n: int, repeat: int) -> list[tuple[str, float]]:
    grad, out = (torch.randn(n) * 1e-3).to(BF16), torch.empty(n, dtype=BF16)
    master, m, v = torch.randn(n), torch.randn(n) * 1e-3, torch.rand(n) * 1e-6
    h = _hyper(HYPERS["adamw wd=0.01"], 3)
    ratios = []
    default_threads = torch.get_num_threads()
    for threads, clock, what in ((1, time.thread_time, "CPU time"), (default_threads, time.perf_counter, "wall")):
        torch.set_num_threads(threads)
        fns: dict[str, Callable[[], None]] = {
            "compiled": lambda: compiled.adam(master, m, v, grad, out, h),
            "native": lambda: native_adam(master, m, v, grad, out, h),
            "compiled check": lambda: compiled.any_nonfinite(grad),
            "native check": lambda: _native.any_nonfinite(grad),
        }
        t = {k: statistics.median(v) for k, v in interleaved_times(fns, repeat, clock).items()}
        print(f"  {threads} thread(s), {what}, median of {repeat}, {n / 1e6:.0f}M params bf16 grad -> bf16 out:")
        for k, s in t.items():
            print(f"    {k:<16} {s * 1e3:8.1f} ms")
        ratios.append((f"update, {threads} thread(s)", t["native"] / t["compiled"]))
        ratios.append((f"finite check, {threads} thread(s)", t["native check"] / t["compiled check"]))
    torch.set_num_threads(default_threads)
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bits-only", action="store_true")
    ap.add_argument("--speed-only", action="store_true")
    ap.add_argument("--params", type=float, default=16.0, help="millions of parameters (speed part)")
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args()
    compiled = _compiled.CompiledAdam()
    if not args.speed_only:
        worst = bits(compiled)
        print(f"bits: worst {worst} ulps / disagreements over all cases ({'IDENTICAL' if worst == 0 else 'DIFFERENT'})")
    if args.bits_only:
        return
    print(f"part 2: speed, default threads = {torch.get_num_threads()}")
    ratios = speed(compiled, int(args.params * 1e6), args.repeat)
    print("ratios native / compiled (time; below 1 native is faster):")
    for k, r in ratios:
        print(f"  {k:<28} {r:5.3f}")


if __name__ == "__main__":
    main()
