"""The generic path's step (NOTE [Generic optimizers]) against the same optimizer in a plain fp32 loop,
in one run; and, for scale, the fused paths of AdamW and Adafactor against theirs.

    python bench/generic_step.py [--layers 8] [--width 1024] [--repeat 7] [--threads N]

A stack of ``--layers`` Linear(width, width) layers (8 x 1024^2 = 8.4M parameters by default), fp32.
Each contender takes ``--repeat`` steps; only the optimizer step is timed: ``opt.step()`` (and
``zero_grad``) in the plain loop, ``tm.step()`` under TieredModel (ZeroOffload on this CPU machine:
the step reads the gradients from their home, takes the global norm, runs the update on the fp32
master and sends the new weights home). The gradients come from one backward before each step, not
timed. The rounds are interleaved so that other work on the machine hits every contender alike;
each figure is the median of its steps. Ratios come last: the plain loop's time over tiermem's
(speed, higher is faster; 1.0 means the generic path costs nothing beside the optimizer itself).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from tiermem import TieredModel

OPTIMIZERS: dict[str, Callable] = {
    "RAdam (generic)": lambda ps: torch.optim.RAdam(ps, lr=1e-3, weight_decay=0.01),
    "NAdam (generic)": lambda ps: torch.optim.NAdam(ps, lr=1e-3),
    "Rprop (generic)": lambda ps: torch.optim.Rprop(ps, lr=1e-3),
    "AdamW (fused)": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "Adafactor (fused)": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
}


def model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


class Plain:
    """The optimizer in a plain fp32 loop (torch's default implementation on this device)."""

    def __init__(self, make: Callable, layers: int, width: int):
        self.m = model(layers, width)
        self.opt = make(self.m.parameters())
        self.x = torch.randn(8, width)

    def grads(self) -> None:
        self.m(self.x).square().mean().backward()

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()


class Tiered:
    """The same optimizer given to a TieredModel (fp32, ZeroOffload)."""

    def __init__(self, make: Callable, layers: int, width: int):
        m = model(layers, width)
        self.tm = TieredModel(m, optimizer=make(m.parameters()), precision="fp32")
        self.x = torch.randn(8, width)

    def grads(self) -> None:
        self.tm.backward(self.tm(self.x).square().mean())

    def step(self) -> None:
        self.tm.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=7, help="timed steps per contender (median)")
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.layers * args.width * args.width
    print(
        f"generic path: {args.layers} x Linear({args.width}, {args.width}) = {n / 1e6:.1f}M fp32 parameters, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, median of {args.repeat} steps"
    )
    runs = {}
    for name, make in OPTIMIZERS.items():
        runs[(name, "plain")] = Plain(make, args.layers, args.width)
        runs[(name, "tiermem")] = Tiered(make, args.layers, args.width)
    times: dict[tuple[str, str], list[float]] = {k: [] for k in runs}
    for _ in range(args.repeat + 1):  # the first round warms up (state made, kernels built)
        for k, r in runs.items():
            r.grads()
            t0 = time.perf_counter()
            r.step()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    width = max(len(k[0]) for k in runs) + 2
    print(f"\n{'optimizer':<{width}} {'plain loop ms':>14} {'tiermem ms':>11}")
    for name in OPTIMIZERS:
        print(f"{name:<{width}} {med[(name, 'plain')] * 1e3:14.1f} {med[(name, 'tiermem')] * 1e3:11.1f}")
    print("\nratios (plain fp32 loop's step time / tiermem's step time; higher is faster):")
    for name in OPTIMIZERS:
        r = med[(name, "plain")] / med[(name, "tiermem")]
        print(f"  {name + ' / its plain loop':<36} {r:5.2f}x")


if __name__ == "__main__":
    main()
