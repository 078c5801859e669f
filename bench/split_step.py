"""The split optimizer: step time of the example GPT across ``ZeroOffload(device_fraction=f)``, in one run.

    python bench/split_step.py [--preset gpt50m] [--n-layer N --n-embd C] [--batch-size 4] [--seq-len 256]
                               [--fractions 0,0.25,0.5,1] [--steps 6] [--warmup 2] [--device cpu|cuda]
                               [--profile PROFILE.json] [--gpu-profile PROFILE.json]

Each variant is one TieredModel with the same initial weights, trained in a process of its own (the
script runs itself with ``--one F``, which prints one JSON line): identical TieredModels in one
process step at systematically different speeds (bench/RESULTS.md, "2026-12-01 One model per
process"), so a variant's place in a shared process would be part of its figure. Each is timed per
iteration in two parts: forward+backward, and ``tm.step()`` (waiting for the last grads, the norm,
both Adams, the uploads), synchronised on a GPU. The variants run one after another.

Besides the measured figures it prints the cost model's prediction of ``tm.step()`` for each fraction
(tiermem/plan/cost.py, NOTE [Cost model]) from this machine's profile (``tiermem bench``; measured
here, quickly, when there is none) and, for a machine without an accelerator, the predicted step on a
GPU: the GPU's rates from ``--gpu-profile`` (a profile saved by ``tiermem bench`` on a GPU machine) or,
without one, nominal H100-class figures (stated in the output), with this machine's CPU Adam. With
``--device cuda`` the measured figures are the real GPU gain. Ratios against f=0 come last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for examples.gpt

from bench._common import run_again, tiered, timed_iteration, token_batches
from examples.gpt import GPT, add_model_args, config_from_args
from tiermem.plan import cost
from tiermem.plan.profile import Profile, load_profile
from tiermem.policies import ZeroOffload

# Nominal figures for a GPU machine when no --gpu-profile is given: PCIe 5 x16 pinned copies as
# commonly measured, and torch's fused AdamW on HBM3 at about half its 3.35 TB/s over 28 B/param.
NOMINAL_GPU = dict(h2d=25e9, d2h=25e9, device_adam=60e9)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--fractions", default="0,0.25,0.5,1", help="device_fraction values, comma separated")
    p.add_argument("--steps", type=int, default=6, help="measured steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per variant first")
    p.add_argument("--bucket-size", default="32MiB", help="TieredModel bucket_size")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--profile", help="this machine's profile (default: the saved one; measured if none)")
    p.add_argument("--gpu-profile", help="a GPU machine's profile, for the predicted GPU gain")
    # one variant in this process, printed as a JSON line (what the script passes to itself)
    p.add_argument("--one", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--rates", default=None, help=argparse.SUPPRESS)
    p.add_argument("--gpu-rates", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def machine_profile(path: str | None) -> Profile:
    prof = load_profile(path) if path else load_profile()
    if prof is not None:
        return prof
    from tiermem.cli.bench import QUICK, collect

    print("no machine profile: measuring this machine (tiermem bench --quick, not saved) ...", flush=True)
    return Profile(collect(QUICK, None, quick=True))


def run_one(args) -> dict:
    """The variant ``device_fraction=args.one``, the only model of this process: its timings, and
    the cost model's predictions for its layout (here, and on a GPU when ``--gpu-rates``)."""
    device = torch.device(args.device)
    cfg = config_from_args(args)
    torch.manual_seed(0)
    tm = tiered(GPT(cfg), ZeroOffload(device_fraction=args.one), device=device, bucket_size=args.bucket_size)
    batches = token_batches(args.vocab_size, args.batch_size, args.seq_len, args.warmup + args.steps, device=device)
    fb: list[float] = []
    st: list[float] = []
    for i, b in enumerate(batches):
        took = timed_iteration(tm, b[:, :-1], b[:, 1:], device)
        if i >= args.warmup:
            fb.append(took.forward_backward)
            st.append(took.step)
        print(
            f"{'warm-up' if i < args.warmup else 'step':>7} {i + 1:2d}: f={args.one:g} "
            f"{1e3 * took.forward_backward:7.1f} + {1e3 * took.step:6.1f} ms",
            file=sys.stderr,
            flush=True,
        )
    itemsize = tm.dtype.itemsize
    here = cost.predict(
        tm.layout.buckets, itemsize, cost.Rates(**json.loads(args.rates)), forward_backward=statistics.median(fb)
    )
    result = {"n_params": tm.layout.n_params, "fb": fb, "st": st, "here": here.stages}
    if args.gpu_rates:
        result["gpu"] = cost.predict(tm.layout.buckets, itemsize, cost.Rates(**json.loads(args.gpu_rates))).stages
    tm.detach()
    return result


def spawn(f: float, rates: cost.Rates, gpu: cost.Rates | None) -> dict:
    """``run_one`` for fraction ``f`` in a fresh process; its last output line is the JSON result."""
    argv = [*sys.argv[1:], "--one", repr(f), "--rates", json.dumps(dataclasses.asdict(rates))]
    if gpu is not None:
        argv += ["--gpu-rates", json.dumps(dataclasses.asdict(gpu))]
    return run_again(__file__, argv, f"device_fraction={f:g}")  # its step lines: our stderr


def main() -> int:
    args = parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args)), flush=True)
        return 0
    device = torch.device(args.device)
    fractions = [float(f) for f in args.fractions.split(",")]
    cfg = config_from_args(args)
    rates = cost.Rates.from_profile(machine_profile(args.profile))
    gpu = source = None
    if device.type == "cpu":
        if args.gpu_profile:
            gpu, source = cost.Rates.from_profile(load_profile(args.gpu_profile)), args.gpu_profile
        else:
            gpu = cost.Rates(
                h2d=NOMINAL_GPU["h2d"],
                d2h=NOMINAL_GPU["d2h"],
                host_copy=rates.host_copy,
                nvme_read=rates.nvme_read,
                nvme_write=rates.nvme_write,
                cpu_adam=rates.cpu_adam,
                device_adam=NOMINAL_GPU["device_adam"],
                device_is_cpu=False,
            )
            source = (
                f"nominal GPU: h2d/d2h {NOMINAL_GPU['h2d'] / 1e9:g} GB/s, device Adam "
                f"{NOMINAL_GPU['device_adam'] / 1e9:g} Gparam/s; this machine's CPU Adam "
                f"{rates.cpu_adam / 1e9:.2f} Gparam/s"
            )
    name = f" ({torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda})" if device.type == "cuda" else ""
    print(
        f"GPT {cfg.n_layer} layers x {cfg.n_embd} wide; batch {args.batch_size} x {args.seq_len}; device {device}"
        f"{name}, {torch.get_num_threads()} CPU threads, torch {torch.__version__}; one process per variant",
        flush=True,
    )
    runs = {f: spawn(f, rates, gpu) for f in fractions}
    print(f"{runs[fractions[0]]['n_params'] / 1e6:.1f}M parameters")
    med_fb = {f: statistics.median(r["fb"]) for f, r in runs.items()}
    med_st = {f: statistics.median(r["st"]) for f, r in runs.items()}
    here = {f: cost.Prediction(r["here"]) for f, r in runs.items()}
    print("\nmedian of", args.steps, "steps (forward+backward | tm.step()), and the cost model's tm.step():")
    for f in fractions:
        p = here[f]
        print(
            f"  f={f:<5g} {1e3 * med_fb[f]:8.1f} | {1e3 * med_st[f]:7.1f} ms   predicted step() "
            f"{1e3 * (p.seconds - p.stages['forward+backward']):7.1f} ms ({p})"
        )
    on_gpu = {}
    if gpu is not None:
        print(f"\npredicted tm.step() on a GPU ({source}):")
        on_gpu = {f: cost.Prediction(r["gpu"]) for f, r in runs.items()}
        for f in fractions:
            print(f"  f={f:<5g} {1e3 * on_gpu[f].seconds:7.2f} ms ({on_gpu[f]})")

    base = fractions[0]
    print(f"\n== ratios (against f={base:g}, measured in this run, one process each) ==")
    for f in fractions[1:]:
        print(
            f"f={f:<5g} tm.step() / f={base:g}: measured {med_st[f] / med_st[base]:5.2f}x, predicted here "
            f"{_step(here[f]) / _step(here[base]):5.2f}x"
            + (f", predicted on a GPU {on_gpu[f].seconds / on_gpu[base].seconds:5.2f}x" if gpu else "")
        )
    for f in fractions[1:]:
        print(
            f"f={f:<5g} whole iteration / f={base:g}: measured "
            f"{(med_fb[f] + med_st[f]) / (med_fb[base] + med_st[base]):5.2f}x"
        )
    return 0


def _step(p: cost.Prediction) -> float:
    return p.seconds - p.stages["forward+backward"]


if __name__ == "__main__":
    sys.exit(main())
