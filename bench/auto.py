"""policies.Auto on the example GPT under three budget settings: its predicted against its measured
step time, and its step time against the best built-in policy that fits, in one run.

    python bench/auto.py [--preset gpt50m] [--n-layer N --n-embd C] [--batch-size 4] [--seq-len 256]
                         [--steps 3] [--warmup 1] [--nvme-dir DIR] [--device cpu|cuda]

First a ZeroOffload run measures what every placement shares: the forward+backward time (fed to Auto
as ``forward_backward``, the "first measured forward/backward") and the device bytes that are not
training state (activations and temporaries, from which Auto's ``device_reserve`` is set). Then, for
each setting:

- ``roomy``: no budgets;
- ``device short``: the device holds ZeroOffload's bytes plus half the model's 16 B/param of grads and
  optimizer state (KeepOnDevice does not fit);
- ``host short``: the device 1.3x ZeroOffload's peak there, the host 60% of ZeroOffload's, NVMe in
  ``--nvme-dir`` (ZeroOffload does not fit).

every built-in that the constructor accepts (ZeroOffload with device_fraction 0, 0.25, 0.5, 0.75, 1,
KeepOnDevice, ZeroInfinity) and Auto run side by side (round-robin, the order rotated each time), each iteration = forward +
backward + step, medians over ``--steps``. Auto's prediction is given twice: as made at construction
(with the ZeroOffload run's forward+backward, measured earlier: on a shared machine the load can
change in between) and as ``tm.report()`` gives it after the run (fed Auto's own forward+backward,
measured alongside the rest). Ratios last.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for examples.gpt

from examples.gpt import GPT, PRESETS, config_from_args, lm_loss  # noqa: E402
from tiermem import AdamW, Budgets, TierMemError, TieredModel, Tier  # noqa: E402
from tiermem.errors import fmt_bytes  # noqa: E402
from tiermem.policies import Auto, KeepOnDevice, ZeroInfinity, ZeroOffload  # noqa: E402

LR, BETAS, WD, CLIP = 3e-4, (0.9, 0.95), 0.1, 1.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpt50m")
    p.add_argument("--n-layer", type=int, default=None)
    p.add_argument("--n-embd", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--nvme-dir", default=None, help="default: a temporary directory here")
    p.add_argument("--bucket-size", default="8MiB", help="TieredModel bucket_size (the NVMe pipelines hold 3)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args()


BUCKET = "8MiB"


def build(cfg, policy, device, budgets=None, nvme_dir=None) -> TieredModel:
    torch.manual_seed(0)
    return TieredModel(GPT(cfg), policy, optimizer=AdamW(lr=LR, betas=BETAS, weight_decay=WD), precision="bf16",
                       grad_clip=CLIP, device=device, budgets=budgets, nvme_dir=nvme_dir, bucket_size=BUCKET)


def iteration(tm: TieredModel, x, y, device) -> tuple[float, float]:
    """Seconds of forward+backward and of the whole iteration."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    tm.backward(lm_loss(tm(x), y))
    sync()
    t1 = time.perf_counter()
    tm.step()
    sync()
    return t1 - t0, time.perf_counter() - t0


def builtins() -> dict[str, object]:
    out = {f"ZeroOffload(device_fraction={f})": ZeroOffload(device_fraction=f) for f in (0.25, 0.5, 0.75, 1.0)}
    return {"ZeroOffload()": ZeroOffload(), **out, "KeepOnDevice()": KeepOnDevice(), "ZeroInfinity()": ZeroInfinity()}


def main() -> int:
    global BUCKET
    args = parse_args()
    BUCKET = args.bucket_size
    device = torch.device(args.device)
    cfg = config_from_args(args)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(args.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen).to(device)
               for _ in range(args.warmup + args.steps)]
    # what every placement shares, measured once under ZeroOffload
    base = build(cfg, ZeroOffload(), device)
    fb = []
    for i, b in enumerate(batches):
        f, _ = iteration(base, b[:, :-1], b[:, 1:], device)
        if i >= args.warmup:
            fb.append(f)
    forward_backward = statistics.median(fb)
    rep = base.report()
    n = base.layout.n_params
    dev0, host0 = rep.peak_bytes[Tier.DEVICE], rep.peak_bytes.get(Tier.HOST, 0)
    act = dev0 - sum(v for (c, t), v in rep.class_peak_bytes.items() if t == Tier.DEVICE and c.value != "activation")
    base.detach()
    del base
    print(f"GPT {cfg.n_layer} x {cfg.n_embd}, {n / 1e6:.1f}M parameters, batch {args.batch_size} x {args.seq_len}, "
          f"device {device}; ZeroOffload: forward+backward {forward_backward * 1e3:.0f} ms, device peak "
          f"{fmt_bytes(dev0)} (activations {fmt_bytes(act)}), host peak {fmt_bytes(host0)}", flush=True)

    tmp = tempfile.TemporaryDirectory(prefix="tiermem-auto-", dir=args.nvme_dir or ".")
    device_short = dev0 + 8 * n
    settings = {
        "roomy": dict(budgets=None, nvme_dir=None),
        "device short": dict(budgets=Budgets(device=device_short), nvme_dir=None),
        "host short": dict(budgets=Budgets(device=dev0 * 13 // 10, host=host0 * 6 // 10), nvme_dir=tmp.name),
    }
    rows = []
    for setting, kw in settings.items():
        limit = (kw["budgets"].device if kw["budgets"] is not None and kw["budgets"].device else None)
        reserve = min(0.9, 1.1 * act / limit) if limit else 0.1  # room for the activations measured above
        auto = Auto(forward_backward=forward_backward, device_reserve=reserve)
        variants: dict[str, TieredModel] = {}
        for i, (name, policy) in enumerate({"Auto": auto, **builtins()}.items()):
            own = dict(kw)
            if kw["nvme_dir"] is not None:  # a run owns its NVMe directory
                own["nvme_dir"] = str(Path(kw["nvme_dir"]) / f"v{i}")
                Path(own["nvme_dir"]).mkdir()
            try:
                variants[name] = build(cfg, policy, device, **own)
            except TierMemError as e:
                print(f"  [{setting}] {name}: refused ({str(e).splitlines()[0][:140]})")
        if "Auto" not in variants:
            print(f"  [{setting}] Auto found nothing that fits; skipped")
            continue
        times: dict[str, list[float]] = {k: [] for k in variants}
        for i, b in enumerate(batches):
            names = list(variants)
            for name in names[i % len(names):] + names[:i % len(names)]:  # rotated: no one always goes first
                tm = variants[name]
                try:
                    _, t = iteration(tm, b[:, :-1], b[:, 1:], device)
                except TierMemError as e:  # e.g. activations past a tight device budget: it does not fit
                    print(f"  [{setting}] {name}: failed while training ({str(e).splitlines()[0][:140]})")
                    variants.pop(name).detach()
                    times.pop(name)
                    continue
                if i >= args.warmup:
                    times[name].append(t)
        med = {k: statistics.median(v) for k, v in times.items() if v}
        chosen = variants["Auto"].placement.chosen
        predicted = chosen.evaluation.seconds  # at construction, with the ZeroOffload run's forward+backward
        fed = variants["Auto"].report().stages  # report(): fed Auto's own forward+backward, measured alongside
        predicted_fed = sum(p for p, _ in fed.values()) if fed else float("nan")
        best_name = min((k for k in med if k != "Auto"), key=med.get, default=None)
        print(f"\n[{setting}] Auto chose: {chosen.label}")
        print(f"  predicted {predicted * 1e3:.0f} ms ({', '.join(f'{k} {v * 1e3:.0f}' for k, v in chosen.evaluation.stages.items())})")
        print(f"  report(): " + ", ".join(f"{k} {p * 1e3:.0f} predicted / {m * 1e3:.0f} measured" for k, (p, m) in fed.items()))
        for k in sorted(med, key=med.get):
            print(f"  {k:<34} {med[k] * 1e3:8.0f} ms")
        rows.append((setting, predicted / med["Auto"], predicted_fed / med["Auto"],
                     med["Auto"] / med[best_name] if best_name else None, best_name))
        for tm in variants.values():
            tm.detach()
    tmp.cleanup()

    print("\n== ratios ==")
    for setting, pred, fed, vs_best, best_name in rows:
        print(f"{setting:<13} Auto predicted at construction / measured step: {pred:5.2f}x (its forward+backward "
              f"from the ZeroOffload run before)")
        verdict = "met" if abs(fed - 1) <= 0.25 else "NOT met"
        print(f"{setting:<13} Auto predicted / measured step, report(): {fed:5.2f}x (target 0.75-1.25x: {verdict})")
        if vs_best is not None:
            print(f"{setting:<13} Auto / best built-in that fits ({best_name}): {vs_best:5.2f}x "
                  f"(target <= 1.05x: {'met' if vs_best <= 1.05 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
