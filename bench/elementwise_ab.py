"""The elementwise kernels of two builds side by side: the library of a git revision (default main)
against this tree's, and both against the floor of the same bytes, CPU time of the calling thread,
one thread, interleaved rounds, fastest of --repeat.

    python bench/elementwise_ab.py [--params 16M] [--repeat 9] [--base main]

bf16 gradient in and bf16 out, as bench/cpu_optim.py's part 1: SGD with momentum (fp32 master, and
bf16 master with stochastic rounding), Adagrad, Lion, Adam with bf16 master weights. Ratios last.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for bench._common

from bench._common import fastest_of
from tiermem.optim import StochasticRound
from tiermem.optim.adam_hyper import AdamHyper
from tiermem.optim.hypers import adam_scalars
from tiermem.optim.kernels import native as _native

BF16 = torch.bfloat16


def base_library(rev: str) -> ctypes.CDLL:
    """The elementwise library built from the sources at git revision ``rev`` (cached as any other)."""
    sources = []
    for mod, names in (("common", ("SOURCE",)), ("elementwise", ("ADAM_MATH", "SOURCE"))):
        # the sources' home since the layout of issue 33, and before it
        for path in (f"tiermem/optim/kernels/csrc/{mod}.py", f"tiermem/optim/_csrc_{mod}.py"):
            shown = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
            if shown.returncode == 0:
                break
        shown.check_returncode()
        text = shown.stdout
        ns: dict[str, object] = {}
        exec(compile(text, mod, "exec"), ns)
        sources += [str(ns[n]) for n in names]
    _native.LIBRARIES["elementwise@base"] = (tuple(sources), _native.LIBRARIES["elementwise"][1])
    return _native._load("elementwise@base")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=16.0, help="millions of parameters a call (default 16)")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--base", default="main", help="git revision of the 'before' library (default main)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = int(args.params * 1e6)
    libs = {"base": base_library(args.base), "this": _native.library("elementwise")}
    P, F = _native.ptr, _native.floats
    grad, out = (torch.randn(n) * 1e-3).to(BF16), torch.empty(n, dtype=BF16)
    keys = (ctypes.c_uint32 * 3)(*StochasticRound.for_parameter(0, "w").keys(1))
    # the scalar layouts of tiermem/optim/hypers.py: SGD momentum 0.9 with weight decay, not the first
    # step; Adagrad; Lion; AdamW
    sgd = F([1.0, 1.0, 0.01, 1.0, 0.9, 1.0, 0.0, 0.0, -1e-3])
    ada = F([1.0, 1.0, 0.01, 1.0, -1e-3, 1e-10])
    lion = F([1.0, 1.0, 1 - 1e-5, 0.9, 0.1, 0.99, 0.01, -1e-4])
    adam = F(adam_scalars(AdamHyper(step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)))
    fns: dict[str, Callable[[], None]] = {}
    for tag, lib in libs.items():
        m32, m16, s0, s1 = torch.randn(n), torch.randn(n).to(BF16), torch.randn(n), torch.rand(n) * 1e-6
        fns[f"SGD momentum [{tag}]"] = lambda lib=lib, m=m32, s=s0: lib.tm_sgd(
            n, P(m), 0, P(s), P(grad), 1, P(out), 1, sgd, None, 1
        )
        fns[f"SGD momentum bf16 SR [{tag}]"] = lambda lib=lib, m=m16, s=s0: lib.tm_sgd(
            n, P(m), 1, P(s), P(grad), 1, P(out), 1, sgd, keys, 1
        )
        fns[f"Adagrad [{tag}]"] = lambda lib=lib, m=m32, s=s1: lib.tm_adagrad(
            n, P(m), 0, P(s), P(grad), 1, P(out), 1, ada, None, 1
        )
        fns[f"Lion [{tag}]"] = lambda lib=lib, m=m32, s=s0: lib.tm_lion(
            n, P(m), 0, P(s), P(grad), 1, P(out), 1, lion, None, 1
        )
        fns[f"Adam bf16 SR [{tag}]"] = lambda lib=lib, m=m16, a=s0, b=s1: lib.tm_adam(
            n, P(m), 1, P(a), P(b), P(grad), 1, P(out), 1, adam, keys, 1
        )
        fns[f"floor 20 B [{tag}]"] = lambda lib=lib, m=m32, s=s0: lib.tm_streams(
            n, P(m), 0, P(s), None, P(grad), 1, P(out), 1, None, 1
        )
        fns[f"floor 20 B bf16 master [{tag}]"] = lambda lib=lib, m=m16, a=s0, b=s1: lib.tm_streams(
            n, P(m), 1, P(a), P(b), P(grad), 1, P(out), 1, keys, 1
        )
    best = fastest_of(fns, args.repeat, time.thread_time)
    print(f"{n / 1e6:.0f}M parameters, 1 thread, CPU time, fastest of {args.repeat}; base = {args.base}")
    for k, t in best.items():
        print(f"  {k:<36} {t * 1e3:8.1f} ms")
    print("ratios (speed, higher is faster):")
    # SGD with bf16 master weights moves 16 B a parameter: no floor of its own here
    floor = {"SGD momentum bf16 SR": "", "Adam bf16 SR": "floor 20 B bf16 master"}
    for k in ("SGD momentum", "SGD momentum bf16 SR", "Adagrad", "Lion", "Adam bf16 SR"):
        f = floor.get(k, "floor 20 B")
        b, t = best[f"{k} [base]"], best[f"{k} [this]"]
        vs = f"base / floor {best[f'{f} [base]'] / b:5.2f}x   this / floor {best[f'{f} [this]'] / t:5.2f}x" if f else ""
        print(f"  {k:<22} this / base {b / t:5.2f}x   {vs}")


if __name__ == "__main__":
    main()
