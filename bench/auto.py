"""policies.Auto on the example GPT under three budget settings: its predicted against its measured
step time, and its step time against the best built-in policy that fits, one fresh process per run.

    python bench/auto.py [--preset gpt50m] [--n-layer N --n-embd C] [--batch-size 4] [--seq-len 256]
                         [--steps 3] [--warmup 1] [--rounds 2] [--all-builtins] [--nvme-dir DIR]
                         [--device cpu|cuda]

Every model trains in a process of its own (the script runs itself with ``--one NAME --setting S``,
which prints one JSON line): on this machine identical TieredModels in one process step at
systematically different speeds (bench/RESULTS.md, "2026-12-01 One model per process"), so a
variant's place in a shared process would be part of its figure (Auto, built first, measured
1.27x-1.80x of a built-in with its very layout).

First a ZeroOffload run measures what every placement shares: the forward+backward time (fed to Auto
as ``forward_backward``, the "first measured forward/backward") and the device bytes that are not
training state (activations and temporaries, from which Auto's ``device_reserve`` is set). Then, for
each setting:

- ``roomy``: no budgets;
- ``device short``: the device holds ZeroOffload's bytes plus half the model's 16 B/param of grads and
  optimizer state (KeepOnDevice does not fit);
- ``host short``: the device 1.3x ZeroOffload's peak there, the host 60% of ZeroOffload's, NVMe in
  ``--nvme-dir`` (ZeroOffload does not fit).

Auto runs against a few built-ins per setting (``BUILTINS``: the one with Auto's layout where there
is one, ZeroOffload() and the built-in that did best before), or against every built-in with
``--all-builtins`` (ZeroOffload with device_fraction 0, 0.25, 0.5, 0.75, 1, KeepOnDevice,
ZeroInfinity; about three times as long). ``--rounds`` rounds, each running every setting's variants
in turn, the order reversed every other round (A B C, C B A, ...) so that drift in the machine's load
falls on all of them alike. A variant the constructor refuses, or that runs out of memory while
training, is reported once and not run again. Each run: ``--warmup`` iterations, then ``--steps``
timed ones (forward + backward + step); a variant's figure is the median over all its timed
iterations. Auto's prediction is given twice: as made at construction (with the ZeroOffload run's
forward+backward, measured earlier: on a shared machine the load can change in between) and as
``tm.report()`` gives it after each run (fed that run's own forward+backward), against the median of
that run. Ratios last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for examples.gpt

from bench._common import at_most, run_again, tiered, timed_iteration, token_batches
from examples.gpt import GPT, PRESETS, config_from_args
from tiermem import Budgets, Tier, TieredModel, TierMemError
from tiermem.errors import fmt_bytes
from tiermem.policies import Auto, KeepOnDevice, ZeroInfinity, ZeroOffload

SETTINGS = ("roomy", "device short", "host short")
# The built-ins run by default: the one with Auto's layout where there is one (roomy: everything on
# the device), ZeroOffload() (the default placement), and the one that did best in the runs of
# 2026-12-01 (device short: half of the state on the device); under "host short" only ZeroInfinity
# fits. --all-builtins runs every one the constructor accepts.
BUILTINS = {
    "roomy": ("ZeroOffload(device_fraction=1.0)", "ZeroOffload()"),
    "device short": ("ZeroOffload(device_fraction=0.5)", "ZeroOffload()"),
    "host short": ("ZeroInfinity()",),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpt50m")
    p.add_argument("--n-layer", type=int, default=None)
    p.add_argument("--n-embd", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="timed iterations per run")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2, help="runs per variant, the order reversed every other round")
    p.add_argument("--all-builtins", action="store_true", help="every built-in, not only those in BUILTINS")
    p.add_argument("--nvme-dir", default=None, help="default: a temporary directory here")
    p.add_argument("--bucket-size", default="8MiB", help="TieredModel bucket_size (the NVMe pipelines hold 3)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    # one run in this process, printed as a JSON line (what the script passes to itself)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--setting", default=None, help=argparse.SUPPRESS)
    p.add_argument("--base", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build(cfg, policy, device, bucket, budgets=None, nvme_dir=None) -> TieredModel:
    torch.manual_seed(0)
    return tiered(
        GPT(cfg),
        policy,
        device=device,
        budgets=budgets,
        nvme_dir=nvme_dir,
        bucket_size=bucket,
    )


def builtins() -> dict[str, object]:
    out = {f"ZeroOffload(device_fraction={f})": ZeroOffload(device_fraction=f) for f in (0.25, 0.5, 0.75, 1.0)}
    return {"ZeroOffload()": ZeroOffload(), **out, "KeepOnDevice()": KeepOnDevice(), "ZeroInfinity()": ZeroInfinity()}


def setting_kw(setting: str, base: dict) -> dict:
    """Budgets of ``setting`` from the ZeroOffload run's figures, and whether it has an NVMe tier."""
    dev0, host0, n = base["dev0"], base["host0"], base["n"]
    if setting == "roomy":
        return dict(budgets=None, nvme=False)
    if setting == "device short":
        return dict(budgets=Budgets(device=dev0 + 8 * n), nvme=False)
    return dict(budgets=Budgets(device=dev0 * 13 // 10, host=host0 * 6 // 10), nvme=True)


def warm_up_process(device, bucket) -> None:
    """Two steps of a throwaway tiny model, so that what a process pays once (compiling or loading
    the CPU Adam kernel: up to seconds) is not charged to the measured model, whose report()
    averages over every step it took, warm-up included. No NVMe: the bias between models in one
    process was seen only there."""
    cfg = PRESETS["tiny"]
    tm = build(cfg, ZeroOffload(), device, bucket)
    for _ in range(2):
        b = torch.randint(cfg.vocab_size, (2, cfg.block_size + 1), device=device)
        timed_iteration(tm, b[:, :-1], b[:, 1:], device)
    tm.detach()


def run_one(args, cfg, device, batches) -> dict:
    """One variant (or the ZeroOffload baseline, ``--one base``) trained in this process."""
    warm_up_process(device, args.bucket_size)
    if args.one == "base":
        tm = build(cfg, ZeroOffload(), device, args.bucket_size)
        fb = [timed_iteration(tm, b[:, :-1], b[:, 1:], device).forward_backward for b in batches][args.warmup :]
        rep = tm.report()
        dev0, host0 = rep.peak_bytes[Tier.DEVICE], rep.peak_bytes.get(Tier.HOST, 0)
        act = dev0 - sum(
            v for (c, t), v in rep.class_peak_bytes.items() if t == Tier.DEVICE and c.value != "activation"
        )
        out = dict(forward_backward=statistics.median(fb), dev0=dev0, host0=host0, act=act, n=tm.layout.n_params)
        tm.detach()
        return out
    base = json.loads(args.base)
    kw = setting_kw(args.setting, base)
    if args.one == "Auto":
        limit = kw["budgets"].device if kw["budgets"] is not None and kw["budgets"].device else None
        reserve = min(0.9, 1.1 * base["act"] / limit) if limit else 0.1  # room for the activations measured there
        policy = Auto(forward_backward=base["forward_backward"], device_reserve=reserve)
    else:
        policy = builtins()[args.one]
    tmp = tempfile.TemporaryDirectory(prefix="tiermem-auto-", dir=args.nvme_dir or ".") if kw["nvme"] else None
    try:
        try:
            tm = build(cfg, policy, device, args.bucket_size, kw["budgets"], tmp.name if tmp else None)
        except TierMemError as e:
            return dict(refused=str(e).splitlines()[0][:140])
        times = []
        try:
            for i, b in enumerate(batches):
                t = timed_iteration(tm, b[:, :-1], b[:, 1:], device).whole
                if i >= args.warmup:
                    times.append(t)
        except TierMemError as e:  # e.g. activations past a tight device budget: it does not fit
            tm.detach()
            return dict(failed=str(e).splitlines()[0][:140])
        out: dict = dict(times=times)
        if args.one == "Auto":
            chosen = tm.placement.chosen
            stages = tm.report().stages  # fed this run's own forward+backward
            out.update(
                label=chosen.label,
                predicted=chosen.evaluation.seconds,
                predicted_stages=chosen.evaluation.stages,
                report={k: list(v) for k, v in stages.items()},
                predicted_fed=sum(p for p, _ in stages.values()) if stages else float("nan"),
            )
        tm.detach()
        return out
    finally:
        if tmp is not None:
            tmp.cleanup()


def spawn(argv: list[str], one: str, setting: str | None = None, base: dict | None = None) -> dict:
    """Run ``one`` in a fresh process; its last output line is the JSON result."""
    extra = ["--one", one] if setting is None else ["--one", one, "--setting", setting, "--base", json.dumps(base)]
    return run_again(__file__, [*argv, *extra], f"{one} ({setting})", keep_stderr=True)


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    cfg = config_from_args(args)
    if args.one is not None:
        batches = token_batches(args.vocab_size, args.batch_size, args.seq_len, args.warmup + args.steps, device=device)
        print(json.dumps(run_one(args, cfg, device, batches)), flush=True)
        return 0

    argv = sys.argv[1:]
    t_start = time.perf_counter()
    base = spawn(argv, "base")  # what every placement shares, measured once under ZeroOffload
    print(
        f"GPT {cfg.n_layer} x {cfg.n_embd}, {base['n'] / 1e6:.1f}M parameters, batch {args.batch_size} x "
        f"{args.seq_len}, device {device}, one process per run, {args.rounds} rounds of {args.steps} timed "
        f"iterations; ZeroOffload: forward+backward {base['forward_backward'] * 1e3:.0f} ms, device peak "
        f"{fmt_bytes(base['dev0'])} (activations {fmt_bytes(base['act'])}), host peak {fmt_bytes(base['host0'])}; "
        f"load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    names = {s: ["Auto", *(builtins() if args.all_builtins else BUILTINS[s])] for s in SETTINGS}
    times: dict[str, dict[str, list[float]]] = {s: {k: [] for k in names[s]} for s in SETTINGS}
    autos: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for r in range(args.rounds):
        for setting in SETTINGS:
            order = names[setting] if r % 2 == 0 else names[setting][::-1]  # A B C, then C B A
            for name in list(order):
                out = spawn(argv, name, setting, base)
                if "refused" in out or "failed" in out:
                    why = "refused" if "refused" in out else "failed while training"
                    print(f"  [{setting}] {name}: {why} ({out.get('refused') or out.get('failed')})", flush=True)
                    names[setting].remove(name)
                    times[setting].pop(name)
                    continue
                times[setting][name] += out["times"]
                if name == "Auto":
                    autos[setting].append(out)
                print(
                    f"  round {r + 1} [{setting}] {name}: "
                    + " ".join(f"{t * 1e3:.0f}" for t in out["times"])
                    + f" ms; load average {os.getloadavg()[0]:.2f}",
                    flush=True,
                )

    rows = []
    for setting in SETTINGS:
        if not autos[setting]:
            print(f"\n[{setting}] Auto found nothing that fits; skipped")
            continue
        med = {k: statistics.median(v) for k, v in times[setting].items() if v}
        a = autos[setting][0]
        fed = statistics.median(x["predicted_fed"] for x in autos[setting])
        best_name = min((k for k in med if k != "Auto"), key=med.get, default=None)
        print(f"\n[{setting}] Auto chose: {a['label']}")
        print(
            f"  predicted {a['predicted'] * 1e3:.0f} ms ("
            + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in a["predicted_stages"].items())
            + ")"
        )
        for i, x in enumerate(autos[setting]):
            print(
                f"  report(), run {i + 1}: "
                + ", ".join(
                    f"{k} {p * 1e3:.0f} predicted / {m * 1e3:.0f} measured" for k, (p, m) in x["report"].items()
                )
            )
        for k in sorted(med, key=med.get):
            print(
                f"  {k:<34} {med[k] * 1e3:8.0f} ms  (iterations: "
                + " ".join(f"{t * 1e3:.0f}" for t in times[setting][k])
                + ")"
            )
        rows.append(
            (
                setting,
                a["predicted"] / med["Auto"],
                fed / med["Auto"],
                med["Auto"] / med[best_name] if best_name else None,
                best_name,
            )
        )
    print(f"\n({time.perf_counter() - t_start:.0f} s in all; load average at the end {os.getloadavg()[0]:.2f})")

    print("\n== ratios ==")
    for setting, pred, fed, vs_best, best_name in rows:
        print(
            f"{setting:<13} Auto predicted at construction / measured step: {pred:5.2f}x (its forward+backward "
            f"from the ZeroOffload run before)"
        )
        verdict = "met" if abs(fed - 1) <= 0.25 else "NOT met"
        print(f"{setting:<13} Auto predicted / measured step, report(): {fed:5.2f}x (target 0.75-1.25x: {verdict})")
        if vs_best is not None:
            print(
                f"{setting:<13} Auto / best built-in that fits ({best_name}): {vs_best:5.2f}x "
                f"({at_most(vs_best, 1.05)})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
