"""Optimizer state formats through TieredModel: quality, bytes per parameter, step speed.

    python bench/optim_formats.py                 # --steps 150 (CPU budget); --steps 500 as issue 22 asks
    python bench/optim_formats.py --only size,speed

- quality: the example GPT (examples/gpt.py, preset "small", the train_gpt schedule), bf16, trained
  from one seed with each option; the final loss (mean of the last 10 steps' training losses and the
  held-out loss) against fp32-state AdamW's in the same run (target: within 1%).
- size: bytes per parameter of the training state off the device: the host's grads + optimizer
  state under ZeroOffload (the report's ledger) and the NVMe directory's size under ZeroInfinity
  (``du``), each option against fp32 AdamW (targets with 8-bit + bf16 master: <= 8 and <= 7 B/param).
- speed: tm.step() through TieredModel (ZeroOffload, bf16, 4 linear layers of 1024x1024), each
  option against fp32 AdamW in the same run (the anchor), interleaved rounds, median.
Ratios are printed last.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tiermem
from examples.gpt import GPT, GPTConfig, lm_loss, load_tokens
from examples.train_gpt import get_batch, lr_factor
from tiermem import TensorClass, Tier, TieredModel
from tiermem.policies import ZeroInfinity, ZeroOffload

OPTIONS = {
    "AdamW fp32 state": lambda ps, lr: tiermem.AdamW(ps, lr=lr, betas=(0.9, 0.95), weight_decay=0.1),
    "AdamW8bit": lambda ps, lr: tiermem.AdamW8bit(ps, lr=lr, betas=(0.9, 0.95), weight_decay=0.1),
    "AdamW bf16 master (SR)": lambda ps, lr: tiermem.AdamW(
        ps, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, bf16_stochastic_round=True
    ),
    "AdamW8bit + bf16 master": lambda ps, lr: tiermem.AdamW8bit(
        ps, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, bf16_stochastic_round=True
    ),
}
ANCHOR = "AdamW fp32 state"


def quality(steps: int, batch: int, lr: float, seed: int) -> dict[str, tuple[float, float]]:
    tok, data = load_tokens()
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    out = {}
    for name, make in OPTIONS.items():
        torch.manual_seed(seed)
        cfg = GPTConfig.preset("small", vocab_size=tok.vocab_size)
        model = GPT(cfg)
        tm = TieredModel(model, ZeroOffload(), optimizer=make(model.parameters(), lr), precision="bf16", grad_clip=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(tm.optimizer, lr_factor(min(50, steps // 10), steps, 0.1))
        gen = torch.Generator().manual_seed(seed)
        losses = []
        for _ in range(steps):
            x, y = get_batch(train_data, batch, cfg.block_size, gen)
            loss = lm_loss(tm(x), y)
            tm.backward(loss)
            tm.step()
            sched.step()
            losses.append(loss.item())
        tm.eval()
        vgen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            held = statistics.mean(
                lm_loss(tm(x), y).item()
                for x, y in (get_batch(val_data, batch, cfg.block_size, vgen) for _ in range(8))
            )
        tm.detach()
        out[name] = (statistics.mean(losses[-10:]), held)
        print(
            f"quality {name:26s} first {losses[0]:.4f} final (last 10) {out[name][0]:.4f} held-out {held:.4f}",
            flush=True,
        )
    return out


def _linears(n: int = 4, d: int = 1024) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False) for _ in range(n)])


def size() -> dict[str, tuple[float, float]]:
    out = {}
    for name, make in OPTIONS.items():
        m = _linears()
        n = sum(p.numel() for p in m.parameters())
        tm = TieredModel(m, ZeroOffload(), optimizer=make(m.parameters(), 1e-3), precision="bf16")
        peak = tm.report().class_peak_bytes
        host = peak.get((TensorClass.OPTIM_STATE, Tier.HOST), 0) + peak.get((TensorClass.GRAD, Tier.HOST), 0)
        tm.detach()
        with tempfile.TemporaryDirectory(dir=".") as d:
            m = _linears()
            tm = TieredModel(m, ZeroInfinity(), optimizer=make(m.parameters(), 1e-3), precision="bf16", nvme_dir=d)
            du = int(subprocess.run(["du", "-sb", d], capture_output=True, text=True, check=True).stdout.split()[0])
            tm.detach()
        out[name] = (host / n, du / n)
        print(
            f"size    {name:26s} host (ZeroOffload grads + state) {host / n:.2f} B/param; "
            f"NVMe (ZeroInfinity, du) {du / n:.2f} B/param",
            flush=True,
        )
    return out


def speed(rounds: int) -> dict[str, float]:
    models = {}
    for name, make in OPTIONS.items():
        m = _linears()
        models[name] = TieredModel(m, ZeroOffload(), optimizer=make(m.parameters(), 1e-3), precision="bf16")
    x = torch.randn(64, 1024)
    times: dict[str, list[float]] = {name: [] for name in OPTIONS}
    for r in range(rounds + 1):
        for name, tm in models.items():  # interleaved: load on the machine falls on every option alike
            tm.backward(tm(x).float().pow(2).mean())
            t0 = time.perf_counter()
            tm.step()
            if r:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
    for tm in models.values():
        tm.detach()
    out = {name: statistics.median(ts) for name, ts in times.items()}
    for name, t in out.items():
        print(f"speed   {name:26s} step {t * 1e3:.1f} ms (median of {rounds}, 4.2M params)", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150, help="training steps of the quality runs (500: issue 22's)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--rounds", type=int, default=15, help="timed steps per option")
    p.add_argument("--only", default="quality,size,speed")
    args = p.parse_args()
    which = set(args.only.split(","))
    q = quality(args.steps, args.batch_size, args.lr, args.seed) if "quality" in which else {}
    s = size() if "size" in which else {}
    v = speed(args.rounds) if "speed" in which else {}
    print(f"ratios against {ANCHOR!r} in this run:")
    for name in OPTIONS:
        cells = []
        if q:
            cells.append(f"final loss {q[name][0] / q[ANCHOR][0]:.4f}x, held-out {q[name][1] / q[ANCHOR][1]:.4f}x")
        if s:
            cells.append(
                f"host {s[name][0]:.2f} B/param ({s[name][0] / s[ANCHOR][0]:.2f}x), "
                f"NVMe {s[name][1]:.2f} B/param ({s[name][1] / s[ANCHOR][1]:.2f}x)"
            )
        if v:
            cells.append(f"step speed {v[ANCHOR] / v[name]:.2f}x")
        print(f"  {name:26s} " + "; ".join(cells))
    return 0 if all(math.isfinite(x[0]) for x in q.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
