"""The largest model this machine trains: ZeroInfinity with one value per NVMe key, 2 steps.

A model no user builds (its layers share one buffer) and grads kept whole: the figure a user can
reproduce with their own model is ``bench/largest_llama.py`` (a transformers Llama built on the
meta device, no grads at rest).

    python bench/largest.py [--params 4.5e9] [--width 4096] [--keep-free 10GB] [--steps 2]
                            [--device-budget 1GiB] [--bucket-size 16MiB] [--dir DIR] [--dry-run]
                            [--8bit] [--bf16-master]

A stack of ``width`` x ``width`` bias-free Linear layers (bench/nvme_step.py's ``windowed_stack``:
the module itself takes one layer's memory; TieredModel copies each weight to its home), deep
enough for ``--params``, trained in bf16 on one batch of 8 rows seen every step, as ZeroInfinity
places it: weights (2 B/param) and optimizer state on NVMe, each value once (NOTE [A failed step
is rolled forward]); the fp32 grads (4 B/param) wherever they fit best: on the host for as many
layers as the memory available now allows (less ``--ram-margin`` and tiermem's buffers), on NVMe
for the others. The optimizer state is AdamW's fp32 master, exp_avg and exp_avg_sq (12 B/param);
``--8bit`` keeps the moments in 8 bits (``tiermem.AdamW8bit``: 1 + 1 B/param and a fp32 scale per
256), ``--bf16-master`` drops the fp32 master for a bf16 one updated with stochastic rounding
(``bf16_stochastic_round=True``: 2 B/param); both: 4.03 B/param of state. A bf16 master is the
weights themselves (NOTE [One copy of bf16 master weights]): on disk 4.03 B/param, not 2 + 4.03;
the disk's bytes per parameter come from the library's footprint (``tier_bytes``), the one rule
TieredModel checks its budgets with. Before building, it checks that the disk holds the weights and state, the NVMe grads, the
journal (a few buckets) and still leaves ``--keep-free``; if not, it shows the arithmetic and
trains the largest depth that fits instead.

The grads stay fp32 at their home whatever the state (DESIGN: accumulated in fp32). In bf16
precision with one micro-batch per step, as here, autograd's grads are bf16 and the fp32 home holds
them widened, exactly: a bf16 home would hold the same values in half the bytes (2 B/param), but
summing several micro-batches in bf16 would round at each one, and TieredModel has no such home.

Prints, per step, forward+backward and ``tm.step()`` time, peak RSS and the disk's free space; at
the end ``du`` of the directory (bytes/param on disk, measured, with the spare files counted),
bytes/param in RAM (peak RSS / params), the report, and removes the directory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import du_bytes, rss_gb
from bench.nvme_step import windowed_stack
from tiermem import (
    AdamW,
    AdamW8bit,
    Budgets,
    Policy,
    TensorClass,
    TensorInfo,
    Tier,
    TieredModel,
    parse_bytes,
)
from tiermem.optim.formats import (
    per_param_bytes,
    state_format,
)
from tiermem.plan.footprint import JOURNAL_BUCKETS
from tiermem.plan.sizing import state_option, tier_bytes
from tiermem.policies import ZeroInfinity

GB = 1e9
GRAD_PER_PARAM = 4  # fp32 grads at their home


def state_name(args: argparse.Namespace) -> str:
    """The option of tiermem.plan.sizing.STATE_OPTIONS that ``--8bit`` and ``--bf16-master`` name."""
    if args.bf16_master and not args.eight_bit:
        return "bf16 master"
    return {False: "fp32", True: "8-bit + bf16 master" if args.bf16_master else "8-bit"}[args.eight_bit]


def state_per_param(args: argparse.Namespace) -> float:
    """Bytes per parameter of the optimizer state (a 4096 x 4096 layer: the 8-bit scales counted)."""
    if args.bf16_master and not args.eight_bit:  # no plan option of its own: fp32 moments, bf16 master
        return 2 + 8
    fmt = state_option(state_name(args), args.width * args.width, "bf16")
    assert fmt is not None  # bf16 precision allows every option
    return per_param_bytes(fmt)


def disk_per_param(args: argparse.Namespace) -> float:
    """Bytes per parameter on NVMe of the weights and the optimizer state, each value once, as the
    footprint counts them (a bf16 master and the weights: one copy) for a 4096 x 4096 layer."""
    layer = args.width * args.width
    if args.bf16_master and not args.eight_bit:
        fmt = state_format("adamw", master_dtype=torch.bfloat16, numel=layer)
    else:
        fmt = state_option(state_name(args), layer, "bf16")
    assert fmt is not None  # bf16 precision allows every option
    placement = {
        TensorClass.PARAM: Tier.NVME,
        TensorClass.OPTIM_STATE: Tier.NVME,
        TensorClass.GRAD: Tier.HOST,
        TensorClass.ACTIVATION: Tier.DEVICE,
    }
    return tier_bytes(layer, "bf16", placement, state=fmt)[Tier.NVME] / layer


def available_ram() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def plan_depth(args: argparse.Namespace, free: int, ram: int) -> tuple[int, int, str]:
    """(layers, of them with grads on NVMe, the arithmetic in words): ``--params`` if disk and RAM
    hold it, else the most layers they hold; grads on the host as far as RAM allows."""
    layer = args.width * args.width
    bucket = parse_bytes(args.bucket_size, what="--bucket-size") // 4  # parameters per bucket (fp32 grads)
    st = state_per_param(args)
    per_disk = disk_per_param(args)  # each value once; a bf16 master is the weights
    journal = int(
        (JOURNAL_BUCKETS["state"] * st + JOURNAL_BUCKETS["weights"] * 2 + JOURNAL_BUCKETS["grads"] * 4) * bucket
    )
    spares = int(4 * st * bucket)  # the store's spare files, at most, each no larger than a bucket's state
    disk = free - args.keep_free - journal - spares
    # host: the state pipeline (3 x the state's bytes), weight staging (2 x 2 B; none when the bf16
    # master is the weights: the update writes it in place) and grads to NVMe (3 x 4 B) per bucket
    # parameter, the device budget (the CPU's RAM here), and what Python and torch hold
    staging = 0 if args.bf16_master else 2 * 2
    fixed = (
        int((3 * st + staging + 3 * 4) * bucket) + parse_bytes(args.device_budget, what="--device-budget") + 2 * 2**30
    )
    host = ram - args.ram_margin - fixed
    want = -(-int(args.params) // layer)
    on_host = max(0, host // (GRAD_PER_PARAM * layer))  # layers whose grads RAM holds
    fits = max(
        1,
        int(
            min(
                (disk + GRAD_PER_PARAM * layer * on_host) // ((per_disk + GRAD_PER_PARAM) * layer),  # all on disk
                disk // (per_disk * layer),  # but the host's grads
            )
        ),
    )
    depth = min(want, fits)
    nvme_grads = max(0, depth - on_host)
    said = (
        f"disk: {free / GB:.1f} GB free, keep {args.keep_free / GB:.0f} GB, journal {journal / GB:.2f} GB + "
        f"spares {spares / GB:.2f} GB -> {disk / GB:.1f} GB for {per_disk:.2f} B/param (weights 2 + "
        f"{state_name(args)} state {st:.2f}{', its bf16 master the weights' if args.bf16_master else ''}) + "
        f"NVMe grads 4 B/param; "
        f"RAM: {ram / GB:.1f} GB available, keep {args.ram_margin / GB:.0f} GB, tiermem's buffers and the "
        f"process {fixed / GB:.1f} GB -> {host / GB:.1f} GB for host grads 4 B/param ({on_host} layers); "
        f"room for {fits} layers of {args.width} x {args.width} ({fits * layer / 1e9:.2f}B parameters)"
    )
    return depth, nvme_grads, said


class GradsSplit(Policy):
    """ZeroInfinity, but the grads of the first ``nvme_layers`` layers on NVMe."""

    def __init__(self, nvme_layers: int):
        self.nvme_layers = nvme_layers

    def place(self, info: TensorInfo) -> Tier:
        if info.kind is TensorClass.GRAD and int(info.name.split(".")[1]) < self.nvme_layers:
            return Tier.NVME
        return ZeroInfinity().place(info)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=4.5e9)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--keep-free", default="10GB", help="free space to leave on the disk")
    p.add_argument("--ram-margin", default="1GB", help="available memory to leave to other processes")
    p.add_argument(
        "--nvme-grad-layers",
        type=int,
        default=None,
        help="grads of this many layers on NVMe (default: as many as RAM cannot hold)",
    )
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--device-budget", default="1GiB")
    p.add_argument("--bucket-size", default="32MiB", help="TieredModel bucket_size (fp32 grad bytes per bucket)")
    p.add_argument("--dir", default=None, help="where to make the NVMe directory (default: the current one)")
    p.add_argument("--dry-run", action="store_true", help="print the arithmetic only")
    p.add_argument(
        "--8bit", dest="eight_bit", action="store_true", help="8-bit moments (tiermem.AdamW8bit) instead of fp32"
    )
    p.add_argument(
        "--bf16-master",
        action="store_true",
        help="bf16 master weights with stochastic rounding (bf16_stochastic_round=True) instead of fp32",
    )
    args = p.parse_args()
    args.keep_free = parse_bytes(args.keep_free, what="--keep-free")
    args.ram_margin = parse_bytes(args.ram_margin, what="--ram-margin")
    where = args.dir or os.getcwd()
    free = shutil.disk_usage(where).free
    depth, nvme_grads, said = plan_depth(args, free, available_ram())
    if args.nvme_grad_layers is not None:
        nvme_grads = min(depth, args.nvme_grad_layers)
    layer = args.width * args.width
    n = depth * layer
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(said)
    fewer = "" if n >= args.params else ", fewer than asked"
    print(
        f"training {depth} layers: {n:,} parameters ({n / 1e9:.2f}B{fewer});"
        f" {(disk_per_param(args) * n + 4 * layer * nvme_grads) / GB:.1f} GB on disk "
        f"({state_name(args)} state; grads of {nvme_grads} layers "
        f"there); fp32 grads on the host {4 * layer * (depth - nvme_grads) / GB:.1f} GB of {ram / GB:.1f} GB RAM; "
        f"mixed-precision Adam in memory would need {16 * n / GB:.0f} GB",
        flush=True,
    )
    if args.dry_run:
        return 0
    d = tempfile.mkdtemp(prefix="tiermem-largest-", dir=where)
    try:
        t0 = time.perf_counter()
        tm = TieredModel(
            windowed_stack(args.width, depth),
            GradsSplit(nvme_grads),
            precision="bf16",
            nvme_dir=d,
            optimizer=(AdamW8bit if args.eight_bit else AdamW)(
                lr=1e-6, betas=(0.9, 0.95), weight_decay=0.1, bf16_stochastic_round=args.bf16_master
            ),
            bucket_size=args.bucket_size,
            budgets=Budgets(device=args.device_budget),
        )
        print(
            f"built in {time.perf_counter() - t0:.0f} s (initial weights and state written to NVMe); "
            f"peak RSS {rss_gb():.1f} GB; du {du_bytes(d) / n:.2f} B/param",
            flush=True,
        )
        x = torch.randn(args.rows, args.width, generator=torch.Generator().manual_seed(0))
        low = shutil.disk_usage(d).free
        for i in range(1, args.steps + 1):
            t0 = time.perf_counter()
            loss = tm(x).float().square().mean()
            tm.backward(loss)
            t1 = time.perf_counter()
            res = tm.step()
            t2 = time.perf_counter()
            low = min(low, shutil.disk_usage(d).free)
            print(
                f"step {i}: loss {loss.item():.6f}, grad norm {res.grad_norm:.4f}; fwd+bwd {t1 - t0:.1f} s, "
                f"tm.step() {t2 - t1:.1f} s; peak RSS {rss_gb():.1f} GB; du {du_bytes(d) / n:.2f} B/param; "
                f"disk free {low / GB:.1f} GB",
                flush=True,
            )
        on_disk = du_bytes(d)
        rep = tm.report()
        spares = [f for f in os.listdir(d) if f.startswith("spare-")]
        print(
            f"{rep}\nparameters {n:,}; on disk (du) {on_disk / GB:.1f} GB = {on_disk / n:.2f} B/param "
            f"({len(spares)} spare files); NVMe peak held {rep.peak_bytes[Tier.NVME] / n:.2f} B/param; "
            f"peak RSS {rss_gb():.1f} GB = {rss_gb() * GB / n:.2f} B/param in RAM; "
            f"lowest free disk {low / GB:.1f} GB"
        )
        # not tm.detach(): it hands back the module with fp32 weights, 4 B/param in RAM (18 GB at 4.5B,
        # which got the first 4.5B run OOM-killed after its last line); the directory goes below
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
