"""Activation offload on a GPT: step time and device activation peak against ZeRO-Offload, in one run.

    python bench/activations.py [--preset small] [--batch-size 16] [--seq-len 128] [--steps 6]
                                [--warmup 2] [--min-bytes 256KiB] [--nvme-dir DIR]

Three variants of one model on the same batches, stepped in turn (round-robin, so load from other
processes hits them alike); each step = forward + backward + optimizer step:

- ``zero-offload``: ``ZeroOffload()``, activations stay on the device tier (the anchor);
- ``act-host``: ``ActivationOffload(ZeroOffload(), tier=Tier.HOST, min_bytes=...)``;
- ``act-nvme``: the same with ``tier=Tier.NVME`` (files under ``--nvme-dir``, default a temp dir).

Figures: median step time, the device tier's ACTIVATION peak from ``tm.report()`` (that peak
includes tensors whose copy to the host has not landed yet, so it is what a budget would have to
allow), bytes offloaded per step and stall seconds per step. The losses of the three must be
equal bit for bit. On a machine without an accelerator the device tier is the CPU's memory and
the copies compete with compute for the same cores, so the times measure the bookkeeping and the
copies, not overlap with a GPU. Ratios come last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for examples.gpt

from bench._common import token_batches
from examples.gpt import GPT, PRESETS, GPTConfig, lm_loss
from tiermem import AdamW, TensorClass, Tier, TieredModel
from tiermem.errors import fmt_bytes
from tiermem.policies import ActivationOffload, ZeroOffload

ACT = TensorClass.ACTIVATION


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=6, help="measured steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per variant first")
    p.add_argument("--min-bytes", default="256KiB", help="ActivationOffload min_bytes")
    p.add_argument("--nvme-dir", default=None, help="directory for act-nvme (default: a temp dir)")
    return p.parse_args()


def make(cfg: GPTConfig, policy, nvme_dir: str, name: str) -> TieredModel:
    torch.manual_seed(0)  # the same initial weights for every variant
    home = os.path.join(nvme_dir, name)  # one NvmeStore per directory: each variant its own
    os.makedirs(home)
    return TieredModel(
        GPT(cfg), policy, optimizer=AdamW(lr=3e-4, weight_decay=0.1), precision="bf16", grad_clip=1.0, nvme_dir=home
    )


def main() -> int:
    args = parse_args()
    cfg = GPTConfig.preset(args.preset, block_size=args.seq_len)
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as nvme_dir:
        variants = {
            "zero-offload": make(cfg, ZeroOffload(), nvme_dir, "zero-offload"),
            "act-host": make(
                cfg, ActivationOffload(ZeroOffload(), tier=Tier.HOST, min_bytes=args.min_bytes), nvme_dir, "act-host"
            ),
            "act-nvme": make(
                cfg, ActivationOffload(ZeroOffload(), tier=Tier.NVME, min_bytes=args.min_bytes), nvme_dir, "act-nvme"
            ),
        }
        n_params = variants["zero-offload"].layout.n_params
        print(
            f"GPT {args.preset}: {cfg.n_layer} layers x {cfg.n_embd} wide, {n_params / 1e6:.2f}M parameters; "
            f"batch {args.batch_size} x {args.seq_len}; min_bytes {args.min_bytes}; "
            f"{torch.get_num_threads()} CPU threads, torch {torch.__version__}",
            flush=True,
        )
        batches = token_batches(cfg.vocab_size, args.batch_size, args.seq_len, args.warmup + args.steps)
        times: dict[str, list[float]] = {name: [] for name in variants}
        losses: dict[str, list[float]] = {name: [] for name in variants}
        for i, b in enumerate(batches):
            for name, tm in variants.items():
                t0 = time.perf_counter()
                loss = lm_loss(tm(b[:, :-1]), b[:, 1:])
                tm.backward(loss)
                tm.step()
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
                losses[name].append(loss.item())
        steps = len(batches)
        med = {name: statistics.median(t) for name, t in times.items()}
        peak = {}
        print(f"\n{'variant':<14}{'step (median)':>15}{'device act. peak':>18}{'offloaded/step':>16}{'stall/step':>12}")
        for name, tm in variants.items():
            rep = tm.report()
            peak[name] = rep.class_peak_bytes.get((ACT, Tier.DEVICE), 0)
            moved = sum(tm.activations.stats.offloaded_bytes.values()) / steps
            print(
                f"{name:<14}{med[name] * 1e3:>12.1f} ms{fmt_bytes(peak[name]):>18}{fmt_bytes(moved):>16}"
                f"{rep.stall_seconds_per_tier.get(Tier.DEVICE, 0.0) / steps * 1e3:>9.1f} ms"
            )
        same = losses["zero-offload"] == losses["act-host"] == losses["act-nvme"]
        print(f"losses equal bit for bit across the three: {'yes' if same else 'NO'}")
        print("\n== ratios ==")
        for name in ("act-host", "act-nvme"):
            print(f"{name} step / zero-offload step:               {med[name] / med['zero-offload']:5.2f}x")
        for name in ("act-host", "act-nvme"):
            print(f"{name} device activation peak / zero-offload:  {peak[name] / peak['zero-offload']:5.2f}x")
        for tm in variants.values():
            tm.detach()
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
