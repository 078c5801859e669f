"""The device check's figures, in one run (bench/gpu_check.sh calls it after the cuda tests).

    python bench/gpu_check.py --out DIR [--dry-run] [--batch-size 16] [--steps 5] [--warmup 2]

1. Copies: the pinned peak (plain torch, one pinned buffer, timed with CUDA events) against the
   engine's ``copy_async`` in each direction, several copies in flight, and the gradient path
   (bf16 on the device -> fp32 on the host, converted on the completion thread). GB/s from wall
   time (first request to last landing) and from the engine's own busy seconds.
2. CPU Adam: tiermem's ``adam_step`` (bf16 grad in, bf16 weights out) against torch's fused CPU
   AdamW on the same tensors, in params/s.
3. The step of a ~300M-parameter GPT at sequence 1024 (24 layers x 1024, heads of 64), sized so
   GPU work and CPU Adam are comparable: the plain loop (fp32 weights, autocast bf16,
   clip_grad_norm_, fused AdamW on the GPU) vs ZeroOffload vs ZeroOffload with overlap_step,
   stepped round-robin, median of ``--steps``.

Writes DIR/gpu_check.json (every figure) and prints the ratios last. ``--dry-run`` runs every
part on the CPU at tiny sizes (the pinned peak is skipped), so the script is checked before a
device session spends its minutes on it. Exits non-zero if a part fails.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for examples.gpt and tiermem from the tree

from examples.gpt import GPT, GPTConfig, lm_loss  # noqa: E402
from tiermem import AdamW, TieredModel, Tier  # noqa: E402
from tiermem.memory.resident import DeviceStore, HostStore  # noqa: E402
from tiermem.optim import adam_step  # noqa: E402
from tiermem.policies import ZeroOffload  # noqa: E402
from tiermem.transfer.engine import TransferEngine  # noqa: E402

LR, BETAS, WD, CLIP = 3e-4, (0.9, 0.95), 0.1, 1.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu-check", help="directory for gpu_check.json")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: check the script itself")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=24)
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--copy-mib", type=int, default=256, help="bytes per copy request")
    p.add_argument("--copies", type=int, default=8, help="copy requests in flight per measurement")
    p.add_argument("--adam-params", type=int, default=100_000_000)
    a = p.parse_args()
    if a.dry_run:
        a.batch_size, a.seq_len, a.n_layer, a.n_embd, a.steps, a.warmup = 2, 32, 2, 64, 2, 1
        a.copy_mib, a.copies, a.adam_params = 4, 3, 1_000_000
    return a


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
            "engine_h2d": lambda: [e.copy_async(d, h, src_tier=Tier.HOST, dst_tier=Tier.DEVICE)
                                   for d, h in zip(dev, host)],
            "engine_d2h": lambda: [e.copy_async(h, d, src_tier=Tier.DEVICE, dst_tier=Tier.HOST)
                                   for d, h in zip(dev, host)],
            "engine_d2h_bf16_to_fp32": lambda: [e.copy_async(h, g, src_tier=Tier.DEVICE, dst_tier=Tier.HOST)
                                                for g, h in zip(grads, host)],
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
        torch._fused_adamw_([master], [g32], [m], [v], [], [torch.tensor(1.0)], lr=LR, beta1=BETAS[0],
                            beta2=BETAS[1], weight_decay=WD, eps=1e-8, amsgrad=False, maximize=False)
    best = {"tiermem": float("inf"), "torch_fused": float("inf")}
    ours()  # compile (or load) first
    for _ in range(3):
        for name, fn in (("tiermem", ours), ("torch_fused", fused)):
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {f"adam_{k}_mparams_s": n / t / 1e6 for k, t in best.items()}


# -- 3. the step --------------------------------------------------------------------------------
def step_variants(args, device: torch.device) -> dict[str, float]:
    cfg = GPTConfig(block_size=args.seq_len, n_layer=args.n_layer, n_head=max(1, args.n_embd // 64),
                    n_embd=args.n_embd, vocab_size=96)

    def model() -> GPT:
        torch.manual_seed(0)
        return GPT(cfg)
    plain = model().to(device)
    opt = torch.optim.AdamW(plain.parameters(), lr=LR, betas=BETAS, weight_decay=WD, fused=True)

    def plain_step(x, y) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(plain(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def tiered(overlap: bool) -> tuple[Callable, TieredModel]:
        tm = TieredModel(model(), ZeroOffload(), optimizer=AdamW(lr=LR, betas=BETAS, weight_decay=WD),
                         precision="bf16", grad_clip=CLIP, device=device, bucket_size="64MiB", overlap_step=overlap)

        def step(x, y) -> None:
            tm.backward(lm_loss(tm(x), y))
            tm.step()
        return step, tm
    zo_step, zo = tiered(False)
    ov_step, ov = tiered(True)
    n_params = plain.num_params()
    print(f"step: GPT {cfg.n_layer} x {cfg.n_embd}, {n_params / 1e6:.0f}M parameters, batch {args.batch_size} x "
          f"{args.seq_len}, device {device}", flush=True)
    gen = torch.Generator().manual_seed(0)
    variants = {"plain": plain_step, "zero_offload": zo_step, "zero_offload_overlap": ov_step}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(args.warmup + args.steps):
        b = torch.randint(96, (args.batch_size, args.seq_len + 1), generator=gen).to(device)
        x, y = b[:, :-1], b[:, 1:]
        for name, fn in variants.items():
            sync(device)
            t0 = time.perf_counter()
            fn(x, y)
            sync(device)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
        print(f"  step {i + 1}: " + "  ".join(f"{k} {1e3 * v[-1]:.0f} ms" for k, v in times.items() if v),
              flush=True)
    figures = {f"step_{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()}
    figures["params_m"] = n_params / 1e6
    for name, tm in (("zero_offload", zo), ("zero_offload_overlap", ov)):
        rep = tm.report()
        figures[f"{name}_stall_s"] = rep.stall_seconds
        tm.detach()
    return figures


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.dry_run else "cuda")
    figures: dict[str, object] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                  "torch": torch.__version__, "dry_run": args.dry_run,
                                  "cpu_threads": torch.get_num_threads()}
    if device.type == "cuda":
        figures["gpu"] = torch.cuda.get_device_name(device)
    failed = []
    def copies() -> dict[str, float]:
        peak = pinned_peak(args.copy_mib << 20, device) if device.type == "cuda" else {}
        return {f"pinned_peak_{k}_gbs": v for k, v in peak.items()} | engine_copies(args, device)
    parts = [("copies", copies),
             ("cpu_adam", lambda: cpu_adam(args)),
             ("step", lambda: step_variants(args, device))]
    for name, part in parts:
        t0 = time.perf_counter()
        try:
            got = part()
            figures.update(got)
            print(f"{name} ({time.perf_counter() - t0:.0f} s): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
        except Exception:  # noqa: BLE001 - report every part, fail at the end
            failed.append(name)
            traceback.print_exc()
        (out / "gpu_check.json").write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    print("\n== ratios ==")
    ratio_lines = []

    def ratio(label: str, num: str, den: str) -> None:
        if num in figures and den in figures and figures[den]:
            r = figures[num] / figures[den]  # type: ignore[operator]
            figures[f"ratio {label}"] = r
            ratio_lines.append(f"{label:<52} {r:6.2f}x")
    for d in ("h2d", "d2h"):
        ratio(f"engine {d} / pinned peak {d} (wall)", f"engine_{d}_wall_gbs", f"pinned_peak_{d}_gbs")
    ratio("engine d2h bf16->fp32 / pinned peak d2h (wall)", "engine_d2h_bf16_to_fp32_wall_gbs", "pinned_peak_d2h_gbs")
    ratio("tiermem CPU Adam / torch fused CPU AdamW", "adam_tiermem_mparams_s", "adam_torch_fused_mparams_s")
    ratio("ZeroOffload step / plain step", "step_zero_offload_ms", "step_plain_ms")
    ratio("ZeroOffload+overlap_step step / plain step", "step_zero_offload_overlap_ms", "step_plain_ms")
    ratio("ZeroOffload+overlap_step / ZeroOffload", "step_zero_offload_overlap_ms", "step_zero_offload_ms")
    (out / "gpu_check.json").write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    print("\n".join(ratio_lines))
    if failed:
        print(f"FAILED parts: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
