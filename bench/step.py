"""One training step of a ~50M-parameter GPT: TieredModel against the plain PyTorch loop, in one run.

    python bench/step.py [--preset gpt50m] [--n-layer N --n-embd C] [--batch-size 4] [--seq-len 256]
                         [--steps 8] [--warmup 2] [--device cpu|cuda]
    python bench/step.py --llama 374m|1b|1.3b [--rounds 3] [--steps 4] [--warmup 2]

``--llama``: a transformers ``LlamaForCausalLM`` of that size (vocab 32000, batch 2 x 256 unless
given) under ZeroOffload against the same plain loop, each variant in its own process (at 1B the
two would not fit in memory together), the processes taking turns for ``--rounds`` rounds; per
step, forward, backward and ``step()`` are timed apart, and tiermem's report sets the cost model's
prediction beside what it measured (``tiermem bench`` must have profiled the machine).

Three ways to run the same model on the same batches, each step = forward + backward + optimizer
step (global-norm clipping at 1.0 in all three):

- ``torch``: what a user would otherwise write: fp32 weights, ``torch.autocast`` to bf16,
  ``clip_grad_norm_``, ``torch.optim.AdamW(fused=True)``.
- ``zero-offload``: ``TieredModel(ZeroOffload(), precision="bf16")``: bf16 weights on the device
  tier; fp32 grads, master weights and moments on the host tier, where Adam runs.
- ``keep-on-device``: ``TieredModel(KeepOnDevice(), precision="bf16")``: the same data flow with
  every tensor on the device tier.

The three are stepped in turn (round-robin), so load from other processes hits all of them alike;
each figure is the median (and the best) over ``--steps`` steps after ``--warmup``. Memory comes from
``tm.report()``: peak bytes per tier and per (class, tier), divided by the parameter count. On a
machine without an accelerator both tiers are the CPU's memory, so the step times measure the
bookkeeping that tiermem adds, not transfer overlap. Ratios come last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for examples.gpt

from bench._common import (
    CLIP,
    at_most,
    llama_config,
    run_again,
    sync,
    tiered as tiered_model,
    token_batches,
    torch_adamw,
)
from examples.gpt import GPT, GPTConfig, add_model_args, config_from_args as build_config, lm_loss
from tiermem import TensorClass, Tier, TieredModel
from tiermem.config.budgets import parse_bytes
from tiermem.errors import fmt_bytes
from tiermem.policies import KeepOnDevice, ZeroOffload


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--steps", type=int, default=8, help="measured steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per variant first")
    p.add_argument("--bucket-size", default="32MiB", help="TieredModel bucket_size")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--llama", choices=sorted(LLAMAS), help="a transformers Llama of this size instead (see above)")
    p.add_argument("--rounds", type=int, default=3, help="--llama: turns of the two processes")
    p.add_argument("--only", choices=("torch", "zero-offload"), help=argparse.SUPPRESS)  # --llama: one variant
    args = p.parse_args()
    if args.llama and "--batch-size" not in sys.argv:
        args.batch_size = 2  # the measurement: 2 x 256
    return args


#: --llama sizes: (hidden, layers, intermediate); heads of 64, vocab 32000, untied embeddings
LLAMAS = {"374m": (1024, 24, 2816), "1b": (2048, 18, 5504), "1.3b": (2048, 24, 5504)}


def llama_model(size: str, seq_len: int) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    hidden, layers, inter = LLAMAS[size]
    cfg = llama_config(
        hidden=hidden,
        layers=layers,
        intermediate=inter,
        heads=hidden // 64,
        vocab=32000,
        max_position_embeddings=seq_len,
    )
    torch.manual_seed(0)  # the same initial weights for every variant
    return LlamaForCausalLM(cfg)


def llama_variant(args: argparse.Namespace) -> dict:
    """One variant's steps in this process: per step (forward, backward, step) seconds; tiermem's
    report stages (predicted, measured) and its text. The JSON result is the last line."""
    device = torch.device(args.device)
    # tiermem's model is built on the meta device and initialized at its homes (as a model bigger
    # than the machine is): at 1.3B the fp32 model in memory and its homes would not fit together
    with torch.device("meta") if args.only == "zero-offload" else contextlib.nullcontext():
        model = llama_model(args.llama, args.seq_len)
    model = model if args.only == "zero-offload" else model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    batches = token_batches(32000, args.batch_size, args.seq_len, args.warmup + args.steps, device=device)
    if args.only == "torch":
        opt = torch_adamw(model.parameters(), fused=True)

        def forward(x, y):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return model(input_ids=x, labels=y).loss

        def backward(loss):
            loss.backward()

        def update():
            plain_update(model, opt)

    else:
        tm = tiered_model(model, ZeroOffload(), device=device, bucket_size=args.bucket_size)

        def forward(x, y):
            return tm(input_ids=x, labels=y).loss

        backward, update = tm.backward, tm.step
    steps = []
    for b in batches:
        x = b[:, :-1]
        t0 = time.perf_counter()
        loss = forward(x, x)
        t1 = time.perf_counter()
        backward(loss)
        t2 = time.perf_counter()
        update()
        sync(device)
        steps.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    out: dict = {"n_params": n_params, "steps": steps[args.warmup :]}
    if args.only != "torch":
        rep = tm.report()
        out.update(stages=rep.stages, report=str(rep))
    return out


def llama_main(args: argparse.Namespace) -> int:
    tokens = args.batch_size * args.seq_len
    print(
        f"transformers Llama {args.llama} {LLAMAS[args.llama]} (hidden, layers, intermediate), batch "
        f"{args.batch_size} x {args.seq_len} = {tokens} tokens; device {args.device}, {torch.get_num_threads()} CPU "
        f"threads, torch {torch.__version__}; each variant in its own process, {args.rounds} rounds in turn",
        flush=True,
    )
    argv = [
        "--llama", args.llama, "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--bucket-size", args.bucket_size,
    ]  # fmt: skip
    runs: dict[str, list[dict]] = {"torch": [], "zero-offload": []}
    for r in range(args.rounds):
        for name in runs:
            res = run_again(__file__, [*argv, "--only", name], f"{name} (round {r + 1})")
            runs[name].append(res)
            print(
                f"round {r + 1} {name:>12}: "
                + "  ".join(f"{1e3 * sum(s):7.0f} ms ({1e3 * s[0]:.0f}+{1e3 * s[1]:.0f}+{1e3 * s[2]:.0f})" for s in res["steps"]),
                flush=True,
            )  # fmt: skip
    n_params = runs["torch"][0]["n_params"]
    steps = {name: [s for res in rs for s in res["steps"]] for name, rs in runs.items()}
    med = {name: statistics.median(sum(s) for s in ss) for name, ss in steps.items()}
    part = {name: [statistics.median(s[i] for s in ss) for i in range(3)] for name, ss in steps.items()}
    last = runs["zero-offload"][-1]
    print(f"\n{n_params / 1e6:.0f}M parameters; zero-offload's last report:\n{last['report']}")
    if last["stages"]:
        print("\ncost model, seconds per step (predicted / measured, the last zero-offload process):")
        for stage, (p, m) in last["stages"].items():
            print(f"  {stage:<24} {p:7.3f} / {m:7.3f}  ({p / m if m else float('inf'):.2f}x)")
    print(f"\nmedian of {len(steps['torch'])} steps each (forward / backward / step):")
    for name in runs:
        print(f"  {name:>12}: {med[name]:.3f} s  ({' / '.join(f'{v:.3f}' for v in part[name])})")
    ratio = med["zero-offload"] / med["torch"]
    print("\n== ratios ==")
    print(f"zero-offload step / plain torch step:      {ratio:5.2f}x  ({at_most(ratio, 1.05)})")  # fmt: skip
    return 0


def make_model(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)  # the same initial weights for every variant
    return GPT(cfg)


def plain_update(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """The plain loop's update: clip the global norm, step, clear the grads."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)


def plain_torch(cfg: GPTConfig, device: torch.device) -> tuple[Callable, Callable[[], int]]:
    """The loop a user writes without tiermem. Returns (step function, bytes of model state)."""
    model = make_model(cfg).to(device)
    opt = torch_adamw(model.parameters(), fused=True)
    grad_bytes = [0]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(model(x), y)
        loss.backward()
        grad_bytes[0] = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
        plain_update(model, opt)

    def state_bytes() -> int:  # weights + grads (at their peak, after backward) + Adam state
        weights = sum(p.nbytes for p in model.parameters())
        moments = sum(t.nbytes for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
        return weights + grad_bytes[0] + moments

    return step, state_bytes


def tiered(cfg: GPTConfig, device: torch.device, policy, bucket_size: str) -> tuple[Callable, TieredModel]:
    tm = tiered_model(make_model(cfg), policy, device=device, bucket_size=bucket_size)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        tm.backward(lm_loss(tm(x), y))
        tm.step()

    return step, tm


def timed(step: Callable, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    step(x, y)
    sync(device)
    return time.perf_counter() - t0


def per_param(n: int, n_params: int) -> str:
    return f"{n / n_params:6.2f} B/param ({fmt_bytes(n)})"


def main() -> int:
    args = parse_args()
    if args.llama and args.only:
        print(json.dumps(llama_variant(args)))
        return 0
    if args.llama:
        return llama_main(args)
    device = torch.device(args.device)
    cfg = build_config(args)
    n_params = make_model(cfg).num_params()
    tokens = args.batch_size * args.seq_len
    print(
        f"GPT {cfg.n_layer} layers x {cfg.n_embd} wide, {n_params / 1e6:.1f}M parameters; batch "
        f"{args.batch_size} x {args.seq_len} = {tokens} tokens; device {device}, "
        f"{torch.get_num_threads()} CPU threads, torch {torch.__version__}",
        flush=True,
    )

    batches = token_batches(args.vocab_size, args.batch_size, args.seq_len, args.warmup + args.steps, device=device)

    plain_step, plain_bytes = plain_torch(cfg, device)
    zo_step, zo = tiered(cfg, device, ZeroOffload(), args.bucket_size)
    kd_step, kd = tiered(cfg, device, KeepOnDevice(), args.bucket_size)
    variants = {"torch": plain_step, "zero-offload": zo_step, "keep-on-device": kd_step}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i, b in enumerate(batches):
        x, y = b[:, :-1], b[:, 1:]
        row = {name: timed(step, x, y, device) for name, step in variants.items()}
        if i >= args.warmup:
            for name, t in row.items():
                times[name].append(t)
        print(
            f"{'warm-up' if i < args.warmup else 'step':>7} {i + 1:2d}: "
            + "  ".join(f"{name} {1e3 * t:8.1f} ms" for name, t in row.items()),
            flush=True,
        )
    med = {name: statistics.median(ts) for name, ts in times.items()}
    best = {name: min(ts) for name, ts in times.items()}  # least disturbed by other processes

    print(
        f"\nstep time, median (best) of {args.steps}: "
        + ", ".join(f"{n} {1e3 * m:.1f} ms ({1e3 * best[n]:.1f} ms), {tokens / m:,.0f} tok/s" for n, m in med.items())
    )
    print(f"\nplain torch model state (fp32 weights + grads + AdamW moments): {per_param(plain_bytes(), n_params)}")
    reports = {"zero-offload": zo.report(), "keep-on-device": kd.report()}
    for name, rep in reports.items():
        print(f"\n{name}:\n{rep}")
        for tier in (Tier.DEVICE, Tier.HOST):
            parts = ", ".join(
                f"{c.value} {v / n_params:.2f}"
                for (c, t), v in sorted(rep.class_peak_bytes.items(), key=lambda kv: kv[0][0].value)
                if t == tier and v
            )
            print(
                f"  {tier.value:<6} peak {per_param(rep.peak_bytes.get(tier, 0), n_params)}; "
                f"by class (B/param): {parts or '-'}"
            )

    rep = reports["zero-offload"]
    dev = rep.peak_bytes.get(Tier.DEVICE, 0)
    act = rep.class_peak_bytes.get((TensorClass.ACTIVATION, Tier.DEVICE), 0)
    ratio = med["zero-offload"] / med["torch"]
    print("\n== ratios ==")
    print(f"zero-offload step / plain torch step:      {ratio:5.2f}x  ({at_most(ratio, 1.15)})")
    print(f"zero-offload / plain torch, best steps:    {best['zero-offload'] / best['torch']:5.2f}x")
    print(f"keep-on-device step / plain torch step:    {med['keep-on-device'] / med['torch']:5.2f}x")
    print(f"zero-offload step / keep-on-device step:   {med['zero-offload'] / med['keep-on-device']:5.2f}x")
    # bucket_size counts fp32 bytes; the grads in flight on the device are bf16
    bucket = min(parse_bytes(args.bucket_size) / 4, n_params) * 2 / n_params
    print(
        f"zero-offload device tier, peak:            {dev / n_params:5.2f} B/param "
        f"(activations {act / n_params:.2f} + the rest {(dev - act) / n_params:.2f}; target: activations "
        f"+ 2 + one bucket of bf16 grads {bucket:.2f} = {2 + bucket:.2f})"
    )
    print(
        f"zero-offload host tier, peak:              {rep.peak_bytes.get(Tier.HOST, 0) / n_params:5.2f} B/param "
        f"(target 16)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
