"""The device check's figures (bench/gpu_check.sh runs each part in a process of its own, under
its own timeout, after the cuda tests).

    python bench/gpu_check.py --out DIR [--dry-run]                 # every part, one process each, then the ratios
    python bench/gpu_check.py --out DIR --part copies|cpu_adam      # one part, in this process
    python bench/gpu_check.py --out DIR --part step --variant plain|zero_offload|zero_offload_overlap
    python bench/gpu_check.py --out DIR --ratios                    # DIR/gpu_check.json and the ratios

1. ``copies``: the pinned peak (plain torch, one pinned buffer, timed with CUDA events) against the
   engine's ``copy_async`` in each direction, several copies in flight, and the gradient path
   (bf16 on the device -> fp32 on the host, converted on the completion thread). GB/s from wall
   time (first request to last landing) and from the engine's own busy seconds.
2. ``cpu_adam``: tiermem's ``adam_step`` (bf16 grad in, bf16 weights out) against torch's fused CPU
   AdamW on the same tensors, in params/s.
3. ``step``: the step of a ~300M-parameter GPT at sequence 1024 (24 layers x 1024, heads of 64),
   sized so GPU work and CPU Adam are comparable, one variant per process (identical models built
   one after another in one process step at different speeds: bench/RESULTS.md, "2026-12-01 One
   model per process"): the plain loop (fp32 weights, autocast bf16, clip_grad_norm_, fused AdamW
   on the GPU), ZeroOffload, ZeroOffload with overlap_step; median of ``--steps``.

Each part appends one JSON line (its figures, or its error) to DIR/figures.jsonl, so a part that
fails or hangs leaves the others' figures; ``--ratios`` merges the lines into DIR/gpu_check.json
with the machine's facts (device, torch and CUDA versions) and prints each ratio with its anchor,
last. ``--dry-run`` runs every part on the CPU at tiny sizes (the pinned peak is skipped), so the
script is checked before a device session spends its minutes on it. Exits non-zero if a part
failed (``--ratios``: if a part failed or is missing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for examples.gpt and tiermem from the tree

from bench._common import BETAS, CLIP, LR, WD, sync, tiered, torch_adamw
from examples.gpt import GPT, GPTConfig, lm_loss
from tiermem import Tier
from tiermem.memory.resident import DeviceStore, HostStore
from tiermem.optim import adam_step
from tiermem.policies import ZeroOffload
from tiermem.transfer.engine import TransferEngine

PARTS = ("copies", "cpu_adam", "step")
VARIANTS = ("plain", "zero_offload", "zero_offload_overlap")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu-check", help="directory for figures.jsonl and gpu_check.json")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: check the script itself")
    p.add_argument("--part", choices=PARTS, help="run this part only, in this process")
    p.add_argument("--variant", choices=VARIANTS, help="with --part step: the variant to run")
    p.add_argument("--ratios", action="store_true", help="merge DIR/figures.jsonl and print the ratios")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=24)
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--copy-mib", type=int, default=256, help="bytes per copy request")
    p.add_argument("--copies", type=int, default=8, help="copy requests in flight per measurement")
    p.add_argument("--adam-params", type=int, default=100_000_000)
    a = p.parse_args(argv)
    if a.part == "step" and a.variant is None:
        p.error("--part step needs --variant " + "|".join(VARIANTS))
    if a.dry_run:
        a.batch_size, a.seq_len, a.n_layer, a.n_embd, a.steps, a.warmup = 2, 32, 2, 64, 2, 2
        a.copy_mib, a.copies, a.adam_params = 4, 3, 1_000_000
    return a


# -- 1. copies ---------------------------------------------------------------------------------
def pinned_peak(nbytes: int, device: torch.device, repeat: int = 5) -> dict[str, float]:
    """GB/s of one plain pinned copy per direction, best of ``repeat`` (CUDA events)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, (dst, src) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
        best = float("inf")
        for _ in range(repeat):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3)
        out[name] = nbytes / best / 1e9
    return out


def engine_copies(args, device: torch.device) -> dict[str, float]:
    nbytes = args.copy_mib << 20
    n = nbytes // 4
    e = TransferEngine({Tier.DEVICE: DeviceStore(device), Tier.HOST: HostStore()}, device=device)
    figures: dict[str, float] = {}
    try:
        host = [e.lease(nbytes, f"<h{i}>").view(torch.float32) for i in range(args.copies)]
        dev = [torch.empty(n, dtype=torch.float32, device=device) for _ in range(args.copies)]
        grads = [torch.randn(n, device=device).bfloat16() for _ in range(args.copies)]
        for h in host:
            h.fill_(1.0)
        cases: dict[str, Callable[[], list]] = {
            "engine_h2d": lambda: [
                e.copy_async(d, h, src_tier=Tier.HOST, dst_tier=Tier.DEVICE) for d, h in zip(dev, host)
            ],
            "engine_d2h": lambda: [
                e.copy_async(h, d, src_tier=Tier.DEVICE, dst_tier=Tier.HOST) for d, h in zip(dev, host)
            ],
            "engine_d2h_bf16_to_fp32": lambda: [
                e.copy_async(h, g, src_tier=Tier.DEVICE, dst_tier=Tier.HOST) for g, h in zip(grads, host)
            ],
        }
        for name, issue in cases.items():
            for _ in range(2):  # the second round counts: staging buffers are pooled by then
                sync(device)
                before = e.stats.snapshot()["busy_seconds"]
                t0 = time.perf_counter()
                for h in issue():
                    h.wait()
                wall = time.perf_counter() - t0
            moved = sum(g.numel() * g.element_size() for g in grads) if "bf16" in name else nbytes * args.copies
            key = (Tier.HOST, Tier.DEVICE) if name.endswith("h2d") else (Tier.DEVICE, Tier.HOST)
            busy = e.stats.snapshot()["busy_seconds"].get(key, 0.0) - before.get(key, 0.0)
            figures[f"{name}_wall_gbs"] = moved / wall / 1e9
            figures[f"{name}_busy_gbs"] = moved / busy / 1e9 if busy > 0 else float("nan")
        assert bool((host[0] == grads[0].float().cpu()).all()), "the converting copy landed wrong bytes"
    finally:
        e.close()
    return figures


# -- 2. CPU Adam ---------------------------------------------------------------------------------
def cpu_adam(args) -> dict[str, float]:
    n = args.adam_params
    g = torch.Generator().manual_seed(0)
    master, m, v = torch.randn(n, generator=g), torch.zeros(n), torch.zeros(n)
    grad, out = (torch.randn(n, generator=g) * 1e-3).bfloat16(), torch.empty(n, dtype=torch.bfloat16)
    kw = dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=1e-8, weight_decay=WD, adamw=True)

    def ours() -> None:
        adam_step(master, m, v, grad, step=1, out=out, check_finite=False, **kw)

    g32 = grad.float()

    def fused() -> None:  # the anchor: torch's fused CPU AdamW (fp32 grad, no bf16 weights out)
        torch._fused_adamw_(
            [master],
            [g32],
            [m],
            [v],
            [],
            [torch.tensor(1.0)],
            lr=LR,
            beta1=BETAS[0],
            beta2=BETAS[1],
            weight_decay=WD,
            eps=1e-8,
            amsgrad=False,
            maximize=False,
        )

    best = {"tiermem": float("inf"), "torch_fused": float("inf")}
    ours()  # compile (or load) first
    for _ in range(3):
        for name, fn in (("tiermem", ours), ("torch_fused", fused)):
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {f"adam_{k}_mparams_s": n / t / 1e6 for k, t in best.items()}


# -- 3. the step --------------------------------------------------------------------------------
def step(args, device: torch.device, variant: str) -> dict[str, float]:
    """One variant of the step, the only model of this process."""
    cfg = GPTConfig(
        block_size=args.seq_len,
        n_layer=args.n_layer,
        n_head=max(1, args.n_embd // 64),
        n_embd=args.n_embd,
        vocab_size=96,
    )
    torch.manual_seed(0)
    model = GPT(cfg)
    n_params = model.num_params()
    tm = None
    if variant == "plain":
        model.to(device)
        opt = torch_adamw(model.parameters(), fused=True)

        def run(x, y) -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = lm_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        tm = tiered(
            model,
            ZeroOffload(),
            device=device,
            bucket_size="64MiB",
            overlap_step=variant == "zero_offload_overlap",
        )

        def run(x, y) -> None:
            tm.backward(lm_loss(tm(x), y))
            tm.step()

    print(
        f"step {variant}: GPT {cfg.n_layer} x {cfg.n_embd}, {n_params / 1e6:.0f}M parameters, batch "
        f"{args.batch_size} x {args.seq_len}, device {device}",
        flush=True,
    )
    gen = torch.Generator().manual_seed(0)
    times: list[float] = []
    for i in range(args.warmup + args.steps):
        b = torch.randint(96, (args.batch_size, args.seq_len + 1), generator=gen).to(device)
        x, y = b[:, :-1], b[:, 1:]
        sync(device)
        t0 = time.perf_counter()
        run(x, y)
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        print(
            f"  {'warm-up' if i < args.warmup else 'step'} {i + 1}: {1e3 * (time.perf_counter() - t0):.0f} ms",
            flush=True,
        )
    figures = {f"step_{variant}_ms": 1e3 * statistics.median(times), "params_m": n_params / 1e6}
    if device.type == "cuda":
        figures[f"step_{variant}_max_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if tm is not None:
        figures[f"step_{variant}_stall_s"] = tm.report().stall_seconds
        tm.detach()
    return figures


# -- the parts, each in a process of its own, and the ratios ------------------------------------
def machine(device: torch.device) -> dict[str, object]:
    """The facts bench/RESULTS.md records with the figures."""
    facts: dict[str, object] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "cpu_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
    return facts


def run_part(args) -> int:
    """One part in this process: its figures (or its error) as one line of DIR/figures.jsonl."""
    device = torch.device("cpu" if args.dry_run else "cuda")
    name = args.part + (f":{args.variant}" if args.variant else "")
    line: dict[str, object] = {
        "part": name,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "dry_run": args.dry_run,
    }
    t0 = time.perf_counter()
    try:
        line |= machine(device)
        if args.part == "copies":
            peak = pinned_peak(args.copy_mib << 20, device) if device.type == "cuda" else {}
            got = {f"pinned_peak_{k}_gbs": v for k, v in peak.items()} | engine_copies(args, device)
        elif args.part == "cpu_adam":
            got = cpu_adam(args)
        else:
            got = step(args, device, args.variant)
        line["figures"] = got
        print(
            f"{name} ({time.perf_counter() - t0:.0f} s): " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()),
            flush=True,
        )
    except Exception as e:  # noqa: BLE001 - recorded for --ratios, and the exit status says it
        traceback.print_exc()
        line["error"] = f"{type(e).__name__}: {e}"
    line["seconds"] = time.perf_counter() - t0
    with open(Path(args.out) / "figures.jsonl", "a") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")
    return 0 if "error" not in line else 1


def expected_parts() -> list[str]:
    return [p for p in PARTS if p != "step"] + [f"step:{v}" for v in VARIANTS]


RATIOS = (  # label, figure, anchor
    ("engine h2d / pinned peak h2d (wall)", "engine_h2d_wall_gbs", "pinned_peak_h2d_gbs"),
    ("engine d2h / pinned peak d2h (wall)", "engine_d2h_wall_gbs", "pinned_peak_d2h_gbs"),
    ("engine d2h bf16->fp32 / pinned peak d2h (wall)", "engine_d2h_bf16_to_fp32_wall_gbs", "pinned_peak_d2h_gbs"),
    ("tiermem CPU Adam / torch fused CPU AdamW", "adam_tiermem_mparams_s", "adam_torch_fused_mparams_s"),
    ("ZeroOffload step / plain step", "step_zero_offload_ms", "step_plain_ms"),
    ("ZeroOffload+overlap_step step / plain step", "step_zero_offload_overlap_ms", "step_plain_ms"),
    ("ZeroOffload+overlap_step / ZeroOffload", "step_zero_offload_overlap_ms", "step_zero_offload_ms"),
)


def ratios(out: Path) -> int:
    """Merge DIR/figures.jsonl (the latest line of each part) into DIR/gpu_check.json; print the
    machine, each part's state, and each ratio with its two figures, last."""
    lines: dict[str, dict] = {}
    path = out / "figures.jsonl"
    if path.exists():
        for raw in path.read_text().splitlines():
            if raw.strip():
                d = json.loads(raw)
                lines[d["part"]] = d
    merged: dict[str, object] = {"parts": {}}
    for name in expected_parts():
        d = lines.get(name)
        state = (
            "missing (timed out or never ran)"
            if d is None
            else (f"FAILED: {d['error']}" if "error" in d else f"ok, {d['seconds']:.0f} s")
        )
        merged["parts"][name] = state  # type: ignore[index]
        if d is not None:
            merged |= {k: v for k, v in d.items() if k not in ("part", "figures", "error", "seconds")}
            merged |= d.get("figures", {})
    print(
        "machine: "
        + ", ".join(
            f"{k} {merged[k]}"
            for k in ("gpu", "torch", "cuda", "python", "cpu_threads", "date", "dry_run")
            if k in merged
        )
    )
    for name, state in merged["parts"].items():  # type: ignore[union-attr]
        print(f"  {name:<28} {state}")
    rows = []
    for label, num, den in RATIOS:
        if num in merged and den in merged and merged[den]:
            r = merged[num] / merged[den]  # type: ignore[operator]
            merged[f"ratio {label}"] = r
            rows.append(f"{label:<48} {r:6.2f}x   ({num} {merged[num]:.4g} / {den} {merged[den]:.4g})")
        else:
            rows.append(f"{label:<48}    n/a   ({num} or {den} missing)")
    (out / "gpu_check.json").write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    print("\n== ratios (figure / anchor, measured in this run) ==")
    print("\n".join(rows))
    return 0 if all(s.startswith("ok") for s in merged["parts"].values()) else 1  # type: ignore[union-attr]


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part is not None:
        return run_part(args)
    if not args.ratios:  # every part, each in a fresh process (bench/gpu_check.sh adds a timeout to each)
        (out / "figures.jsonl").unlink(missing_ok=True)
        me = [sys.executable, str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:])]
        for name in expected_parts():
            part, _, variant = name.partition(":")
            subprocess.run(me + ["--part", part] + (["--variant", variant] if variant else []), env=os.environ)
    return ratios(out)


if __name__ == "__main__":
    sys.exit(main())
