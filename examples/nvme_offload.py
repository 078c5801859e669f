"""Train a GPT whose optimizer state does not fit the host budget: the state lives on NVMe.

    python examples/nvme_offload.py                          # preset 'small', state on NVMe, 40 steps
    python examples/nvme_offload.py --policy zero-infinity   # weights on NVMe too
    python examples/nvme_offload.py --nvme-dir /mnt/nvme/scratch --host-budget 6MiB

Mixed-precision Adam keeps 12 bytes of optimizer state per parameter (fp32 master weights,
exp_avg, exp_avg_sq), more than the model's working weights and gradients together. The host
budget here is set below those 12 bytes per parameter (by default to 90% of them), as
when a model's optimizer state is larger than the machine's memory:

1. ``ZeroOffload()`` keeps the state on the host, so ``TieredModel`` refuses the model up front
   and says what it would need; the error is printed.
2. A policy with ``OPTIM_STATE`` on NVMe trains within the same budget: each step streams the
   state through three bucket-sized host buffers (read ahead, Adam, write behind), so the host
   holds the fp32 gradients and those buffers, not the state. ``--policy zero-infinity`` puts
   the working weights on NVMe as well, fetched ahead of each module by the scheduler.

The loss is printed as it trains, then the report (bytes per tier and class, bytes moved, stalls).
Buckets are small (by default each as large as the largest parameter, ``--bucket-size``) because
the pipeline's three buffer sets are as large as the largest bucket: with a tight host budget,
smaller buckets leave more of it to the gradients.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python examples/nvme_offload.py` from anywhere

from examples.gpt import GPT, PRESETS, GPTConfig, lm_loss, load_tokens
from examples.train_gpt import get_batch
from tiermem import (
    AdamW,
    Budgets,
    OutOfTierMemory,
    Policy,
    TensorClass,
    TensorInfo,
    Tier,
    TieredModel,
    TierMemError,
    parse_bytes,
)
from tiermem.errors import fmt_bytes
from tiermem.policies import ZeroInfinity, ZeroOffload


class OptimStateOnNvme(Policy):
    """ZeRO-Offload with the optimizer state on NVMe instead of the host."""

    def place(self, info: TensorInfo) -> Tier:
        if info.kind is TensorClass.OPTIM_STATE:
            return Tier.NVME
        return ZeroOffload().place(info)


POLICIES = {"optim-state-on-nvme": OptimStateOnNvme, "zero-infinity": ZeroInfinity}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="small", help="model size (examples/gpt.py)")
    p.add_argument("--policy", choices=sorted(POLICIES), default="optim-state-on-nvme")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--host-budget",
        default=None,
        help="Budgets(host=...), e.g. 6MiB; must be below the optimizer state's 12 bytes per "
        "parameter (default: 90%% of them)",
    )
    p.add_argument(
        "--bucket-size",
        default=None,
        help="TieredModel bucket_size, fp32 bytes of grads (default: the largest parameter's, the "
        "smallest the pipeline's buffers can be)",
    )
    p.add_argument(
        "--nvme-dir",
        default=None,
        help="directory for the NVMe tier (default: a temporary one under the current directory, removed afterwards)",
    )
    p.add_argument("--log-every", type=int, default=10, help="print the loss every this many steps")
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be at least 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    tok, data = load_tokens()
    cfg = GPTConfig.preset(args.preset, vocab_size=tok.vocab_size, block_size=args.seq_len)
    model = GPT(cfg)
    n = model.num_params()
    state_bytes = 12 * n
    host_budget = (
        state_bytes * 9 // 10 if args.host_budget is None else parse_bytes(args.host_budget, what="--host-budget")
    )
    if host_budget >= state_bytes:
        print(
            f"--host-budget {fmt_bytes(host_budget)} holds the whole optimizer state ({fmt_bytes(state_bytes)}): "
            f"pass a budget below it to see the state go to NVMe",
            file=sys.stderr,
        )
        return 2
    budgets = Budgets(host=host_budget)
    bucket_size = args.bucket_size or 4 * max(p.numel() for p in model.parameters())
    print(
        f"model: preset {args.preset!r}, {n:,} parameters; optimizer state 12 B/param = {fmt_bytes(state_bytes)}; "
        f"host budget {fmt_bytes(host_budget)} ({host_budget / n:.2f} B/param)"
    )

    # 1. ZeRO-Offload keeps the state on the host: refused before anything is allocated.
    try:
        TieredModel(model, ZeroOffload(), budgets=budgets, bucket_size=bucket_size)
    except OutOfTierMemory as e:
        print(f"\nZeroOffload() is refused, as it should be:\n  {e}")
    else:
        print(
            "\nZeroOffload() was accepted: the host budget is not below what it needs; lower --host-budget",
            file=sys.stderr,
        )
        return 1

    # 2. The same budget with the state on NVMe. The refused attempt changed nothing in `model`.
    policy = POLICIES[args.policy]()
    nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="tiermem-nvme-offload-", dir=".")
    try:
        try:
            tm = TieredModel(
                model,
                policy,
                optimizer=AdamW(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1),
                precision="bf16",
                grad_clip=1.0,
                budgets=budgets,
                nvme_dir=nvme_dir,
                bucket_size=bucket_size,
            )
        except TierMemError as e:
            print(f"\n{policy!r} does not fit either:\n  {e}", file=sys.stderr)
            return 1
        print(f"\n{tm!r}, NVMe directory {nvme_dir}")
        gen = torch.Generator().manual_seed(args.seed)
        t0, window = time.perf_counter(), []
        for step in range(1, args.steps + 1):
            x, y = get_batch(data, args.batch_size, args.seq_len, gen)
            loss = lm_loss(tm(x), y)
            tm.backward(loss)
            tm.step()
            window.append(loss.item())
            if step % args.log_every == 0 or step == args.steps:
                elapsed = time.perf_counter() - t0
                print(
                    f"step {step:4d}/{args.steps} | loss {sum(window) / len(window):.4f} "
                    f"| {1e3 * elapsed / len(window):7.1f} ms/step",
                    flush=True,
                )
                t0, window = time.perf_counter(), []
        rep = tm.report()
        print(f"\n{rep}")
        host_peak = rep.peak_bytes[Tier.HOST]
        on_disk = rep.class_peak_bytes.get((TensorClass.OPTIM_STATE, Tier.NVME), 0)
        print(
            f"\nhost peak {fmt_bytes(host_peak)} within the budget of {fmt_bytes(host_budget)}, below the optimizer "
            f"state's {fmt_bytes(state_bytes)}; on NVMe: optimizer state {fmt_bytes(on_disk)} at its peak (each "
            f"value once, and the writes in flight beside it)"
        )
        tm.detach()  # removes its files from the NVMe directory
    finally:
        if args.nvme_dir is None:
            shutil.rmtree(nvme_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
