"""Data-parallel training of a GPT on 2 CPU ranks: TieredModel against DDP + ZeroRedundancyOptimizer, in one run.

    python bench/ddp.py [--preset small] [--n-layer 6 --n-embd 384] [--batch-size 16] [--seq-len 128]
                        [--steps 20] [--warmup 2] [--bucket-size 32MiB]

The script spawns 2 gloo ranks itself (one intra-op thread each, so the two ranks share the
machine's cores instead of fighting over them). Both setups train the same model from the same
initial weights on the same global batches, each rank on its half (``--batch-size`` is the global
batch); each step = forward + backward + optimizer step, global-norm clipping at 1.0:

- ``DDP+ZeRO``: what a user would otherwise write: fp32 weights in ``DistributedDataParallel``,
  ``torch.autocast`` to bf16, ``clip_grad_norm_``, and
  ``torch.distributed.optim.ZeroRedundancyOptimizer(torch.optim.AdamW)`` (fused where this build
  has it, else foreach): each rank keeps the Adam moments of its share of the parameters.
- ``tiermem``: ``TieredModel(ZeroOffload(), precision="bf16", grad_clip=1.0)`` over the default
  process group: bf16 weights on the device tier, each rank's 1/2 of the fp32 grads, master
  weights and moments on the host tier (NOTE [Data parallel] in tiermem/transfer/collectives.py).

The setups are stepped in turn (round-robin), so load from other processes hits both alike. A
step's time is the slowest rank's, measured from a barrier; each figure is the median (and the
best) over ``--steps`` steps after ``--warmup`` (tiermem's first step compiles its Adam kernel).
Optimizer state per rank: tiermem's is ``tm.report()``'s peak of (OPTIM_STATE, host); ZeRO's the
tensors in its local optimizer's state; both against a full replica's 12 B/param (fp32 master
weights and two moments). Ratios come last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for examples.gpt

from bench._common import (
    BETAS,
    CLIP,
    DATA_PARALLEL_GPT,
    LR,
    WD,
    at_most,
    free_port,
    tiered as tiered_model,
    token_batches,
)
from examples.gpt import GPT, GPTConfig, add_model_args, config_from_args as build_config, lm_loss
from tiermem import TensorClass, Tier, TieredModel
from tiermem.errors import fmt_bytes
from tiermem.policies import ZeroOffload

WORLD = 2
FULL_REPLICA = 12  # B/param of mixed-precision Adam state: fp32 master weights, exp_avg, exp_avg_sq


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, **DATA_PARALLEL_GPT, batch_help=f"global batch, split over the {WORLD} ranks")
    p.add_argument("--steps", type=int, default=20, help="measured steps per setup")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per setup first")
    p.add_argument("--bucket-size", default="32MiB", help="TieredModel bucket_size")
    args = p.parse_args()
    if args.batch_size % WORLD:
        p.error(f"--batch-size={args.batch_size}: must be a multiple of {WORLD} (one half per rank)")
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be at least 1 (the first step compiles tiermem's Adam)")
    return args


def make_model(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)  # the same initial weights for both setups, on every rank
    return GPT(cfg)


def ddp_zero(cfg: GPTConfig) -> tuple[Callable, Callable[[], int], str]:
    """The loop a user writes without tiermem. Returns (step, bytes of local optimizer state, kernel)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(make_model(cfg))

    def zero(impl: str) -> ZeroRedundancyOptimizer:
        return ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, betas=BETAS, weight_decay=WD, **{impl: True}
        )

    try:
        impl, opt = "fused", zero("fused")
    except (RuntimeError, TypeError, ValueError):  # a build without the fused CPU kernel
        impl, opt = "foreach", zero("foreach")

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model(x), y)
        loss.backward()  # DDP averages the grads over ranks
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()  # each rank updates its share, then broadcasts it
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def state_bytes() -> int:
        return sum(t.nbytes for s in opt.optim.state.values() for t in s.values() if isinstance(t, torch.Tensor))

    return step, state_bytes, impl


def tiered(cfg: GPTConfig, bucket_size: str) -> tuple[Callable, TieredModel]:
    tm = tiered_model(make_model(cfg), ZeroOffload(), bucket_size=bucket_size)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(tm(x), y)
        tm.backward(loss)
        tm.step()
        return loss.detach()

    return step, tm


def timed(step: Callable, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(the slowest rank's seconds, the loss averaged over ranks)."""
    dist.barrier()
    t0 = time.perf_counter()
    loss = step(x, y)
    seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # outside the timed region
    mean_loss = loss.float().reshape(1).clone()
    dist.all_reduce(mean_loss)
    return seconds.item(), mean_loss.item() / WORLD


def per_param(n: int, n_params: int) -> str:
    return f"{n / n_params:5.2f} B/param ({fmt_bytes(n)})"


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        run(rank, args)
    finally:
        dist.destroy_process_group()


def run(rank: int, args: argparse.Namespace) -> None:
    say = print if rank == 0 else (lambda *a, **k: None)
    cfg = build_config(args)
    n_params = make_model(cfg).num_params()
    tokens, half = args.batch_size * args.seq_len, args.batch_size // WORLD
    # every rank draws the same global batches, then takes its half
    batches = token_batches(
        args.vocab_size, args.batch_size, args.seq_len, args.warmup + args.steps, rank=rank, world=WORLD
    )

    anchor_step, anchor_bytes, impl = ddp_zero(cfg)
    tm_step, tm = tiered(cfg, args.bucket_size)
    say(
        f"GPT {cfg.n_layer} layers x {cfg.n_embd} wide, {n_params / 1e6:.1f}M parameters; global batch "
        f"{args.batch_size} x {args.seq_len} = {tokens} tokens, {half} sequences per rank; {WORLD} gloo ranks, "
        f"{torch.get_num_threads()} intra-op thread each; torch {torch.__version__}\n"
        f"DDP+ZeRO: ZeroRedundancyOptimizer(AdamW, {impl}=True); tiermem: {tm!r}",
        flush=True,
    )
    variants = {"DDP+ZeRO": anchor_step, "tiermem": tm_step}
    times: dict[str, list[float]] = {name: [] for name in variants}
    losses: dict[str, list[float]] = {name: [] for name in variants}
    for i, b in enumerate(batches):
        x, y = b[:, :-1], b[:, 1:]
        row = {name: timed(step, x, y) for name, step in variants.items()}
        for name, (t, loss) in row.items():
            losses[name].append(loss)
            if i >= args.warmup:
                times[name].append(t)
        say(
            f"{'warm-up' if i < args.warmup else 'step':>7} {i + 1:2d}: "
            + "  ".join(f"{name} {1e3 * t:8.1f} ms (loss {loss:.4f})" for name, (t, loss) in row.items()),
            flush=True,
        )
    med = {name: statistics.median(ts) for name, ts in times.items()}
    best = {name: min(ts) for name, ts in times.items()}  # least disturbed by other processes

    rep = tm.report()
    state = {"DDP+ZeRO": [0] * WORLD, "tiermem": [0] * WORLD}
    dist.all_gather_object(state["DDP+ZeRO"], anchor_bytes())
    dist.all_gather_object(state["tiermem"], rep.class_peak_bytes.get((TensorClass.OPTIM_STATE, Tier.HOST), 0))
    if rank != 0:
        return
    full = FULL_REPLICA * n_params
    print(f"\n{rep}")
    print(f"\n| setup | step, median of {args.steps} | best | tok/s (median) | optimizer state, rank 0 | rank 1 |")
    print("|---|---|---|---|---|---|")
    for name in variants:
        print(
            f"| {name} | {1e3 * med[name]:.1f} ms | {1e3 * best[name]:.1f} ms | {tokens / med[name]:,.0f} | "
            + " | ".join(per_param(n, n_params) for n in state[name])
            + " |"
        )
    print(f"| full replica | | | | {per_param(full, n_params)} | {per_param(full, n_params)} |")
    shard, gather = full / WORLD, 4 * max(b.numel for b in tm.layout.buckets)
    print(
        f"\ntiermem's state per rank, peak: its 1/{WORLD} shard {shard / n_params:.2f} B/param + one whole "
        f"bucket's fp32 master while the model is built (4 B x the largest bucket) {gather / n_params:.2f} "
        f"B/param = {(shard + gather) / n_params:.2f} B/param; measured {max(state['tiermem']) / n_params:.2f}"
    )
    print(
        f"DDP+ZeRO's state is the moments only: its fp32 weights ({4 * n_params / n_params:.2f} B/param) are the "
        f"model's, whole on every rank"
    )
    print("loss at the last step, mean over ranks: " + ", ".join(f"{n} {ls[-1]:.4f}" for n, ls in losses.items()))

    ratio = med["tiermem"] / med["DDP+ZeRO"]
    print("\n== ratios ==")
    print(f"tiermem step / DDP+ZeRO step:                          {ratio:5.2f}x  ({at_most(ratio, 1.10)})")
    print(f"tiermem / DDP+ZeRO, best steps:                        {best['tiermem'] / best['DDP+ZeRO']:5.2f}x")
    for name in variants:
        print(f"optimizer state per rank / full replica, {name + ':':<9}     {max(state[name]) / full:5.2f}x")


def main() -> int:
    args = parse_args()
    try:
        import deepspeed

        print(
            f"deepspeed {deepspeed.__version__} imports here; it is not run by this script "
            f"(DDP + ZeroRedundancyOptimizer is the anchor)",
            flush=True,
        )
    except Exception as e:  # noqa: BLE001 - any failure to import means it is not an option here
        print(
            f"deepspeed: not importable here ({type(e).__name__}); DDP + ZeroRedundancyOptimizer is the anchor",
            flush=True,
        )
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the ranks inherit it
    mp.spawn(worker, args=(args, free_port()), nprocs=WORLD, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
