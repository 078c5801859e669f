"""Train a small character-level GPT on the text in examples/data with tiermem.

    python examples/train_gpt.py                      # ~0.8M-parameter GPT, ZeRO-Offload, precision
                                                      # auto; 2-4 minutes on a 2-core CPU, loss ~4.4 -> ~1.3
    python examples/train_gpt.py --policy keep-on-device --steps 200
    python examples/train_gpt.py --trace /tmp/gpt.trace.json   # open in https://ui.perfetto.dev
    torchrun --nproc_per_node 2 examples/train_gpt.py --steps 100  # data parallel over 2 processes
    torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        examples/train_gpt.py --policy state-on-nvme --nvme-dir /mnt/nvme/gpt   # on each of 2 nodes

Weights in the working precision live on the device tier; gradients, fp32 master weights and
Adam's moments live on the host, where Adam runs. On a machine without an accelerator both tiers
are the CPU's memory, so the run shows the data flow and the report rather than a speed-up.
``--precision auto`` (the default) is bf16 where the device computes it natively (a GPU with bf16,
a CPU with AVX512-BF16 or AMX) and fp32 on other CPUs, where bf16 matmuls run several times slower
(NOTE [Choosing the precision] in tiermem/config/precision.py; `tiermem info` says which this machine gets).

Launched by torchrun (WORLD_SIZE > 1), the script joins the process group itself (gloo on the
CPU, NCCL on GPUs: LOCAL_RANK, the rank on its node, picks the GPU) and TieredModel shards
gradients and optimizer state over the ranks (NOTE [Data parallel] in
tiermem/transfer/collectives.py), and the weights too when they live off the device or with
--shard-weights (NOTE [Weights sharded over the ranks] in tiermem/train/weights/gathered.py). Each rank
draws its own batches (the seed offset by its global rank); global rank 0 prints, losses
averaged over the ranks, throughput counting every rank's tokens, and alone writes the trace.
Each rank keeps its NVMe files under ``--nvme-dir``/rank<global rank>; ``--save`` writes a
torch.distributed.checkpoint directory every rank writes its shards to (it must be on storage
every node sees).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python examples/train_gpt.py` from anywhere

from examples.gpt import GPT, PRESETS, GPTConfig, generate, lm_loss, load_tokens
from tiermem import AdamW, PerClass, TensorClass, Tier, TieredModel
from tiermem.policies import ActivationOffload, KeepOnDevice, ZeroInfinity, ZeroOffload


class StateOnNvme(PerClass):
    """ZeRO-Offload with the fp32 master weights and Adam's moments on NVMe."""

    homes = {
        TensorClass.PARAM: Tier.DEVICE,
        TensorClass.GRAD: Tier.HOST,
        TensorClass.OPTIM_STATE: Tier.NVME,
        TensorClass.ACTIVATION: Tier.DEVICE,
    }


POLICIES = {
    "zero-offload": ZeroOffload,
    "keep-on-device": KeepOnDevice,
    "zero-infinity": ZeroInfinity,  # weights and optimizer state on NVMe (needs --nvme-dir)
    "state-on-nvme": StateOnNvme,  # optimizer state on NVMe, weights on the device (needs --nvme-dir)
    "activation-offload": lambda: ActivationOffload(ZeroOffload(), min_bytes=64 * 1024),  # saved tensors to the host
}


def nvme_dir(args: argparse.Namespace) -> Optional[str]:
    if args.policy not in ("zero-infinity", "state-on-nvme"):
        return args.nvme_dir
    if args.nvme_dir is None:  # removed when the process exits
        args._nvme_tmp = tempfile.TemporaryDirectory(prefix="tiermem-nvme-", dir=".")
        return args._nvme_tmp.name
    return args.nvme_dir


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="small", help="model size (examples/gpt.py)")
    p.add_argument("--steps", type=int, default=500, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's block_size)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp16", "fp32"],
        default="auto",
        help="auto: bf16 where the device computes it natively, else fp32 on a CPU (fp16 on an older GPU)",
    )
    p.add_argument("--policy", choices=sorted(POLICIES), default="zero-offload")
    p.add_argument(
        "--nvme-dir",
        default=None,
        help="directory for tensors a policy places on NVMe (zero-infinity, "
        "state-on-nvme; default: a temporary one under .); each rank "
        "uses its rank<r> subdirectory",
    )
    p.add_argument(
        "--shard-weights",
        action="store_true",
        help="under torchrun, shard the weights on the device over the ranks too (ZeRO-3); weights "
        "off the device (--policy zero-infinity) always are",
    )
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of --lr")
    p.add_argument("--warmup", type=int, default=50, help="steps of linear warm-up before the cosine decay")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay (not applied to biases and norms)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="global grad-norm clip; 0 turns it off")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the weights live and compute runs (under torchrun: NCCL on cuda, gloo on cpu)",
    )
    p.add_argument("--log-every", type=int, default=10, help="print a progress line every this many steps")
    p.add_argument("--eval-batches", type=int, default=8, help="batches of held-out text for the final loss")
    p.add_argument("--sample-tokens", type=int, default=300, help="characters to generate at the end; 0: none")
    p.add_argument("--trace", metavar="PATH", default=None, help="write a Chrome trace of the run here (rank 0's)")
    p.add_argument("--save", metavar="PATH", default=None, help="write a tiermem checkpoint here at the end")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "grad_accum", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be at least 1")
    if args.seq_len is not None and args.seq_len < 1:
        p.error(f"--seq-len={args.seq_len}: must be at least 1")
    if args.warmup < 0 or not 0.0 <= args.min_lr_ratio <= 1.0:
        p.error("--warmup must be >= 0 and --min-lr-ratio in [0, 1]")
    return args


def lr_factor(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Multiplier of the peak lr at each step: linear warm-up, then cosine decay to ``min_ratio``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def get_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``seq_len`` tokens and the same windows shifted by one."""
    if len(data) <= seq_len:
        raise ValueError(f"text of {len(data)} tokens is too short for --seq-len {seq_len}; use a shorter one")
    starts = torch.randint(len(data) - seq_len, (batch_size,), generator=gen)
    windows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def init_distributed(device: str) -> tuple[int, int]:
    """(global rank, world size). Under torchrun (WORLD_SIZE > 1), join its process group first:
    NCCL with one GPU per process, the rank on its node (LOCAL_RANK) picking it; gloo on the CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # TieredModel's device="cuda" is this one
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return dist.get_rank(), world


def mean_over_ranks(value: float, world: int, device: str) -> float:
    """``value`` averaged over the ranks (for printing: every rank must call it at the same point)."""
    if world == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)  # NCCL reduces CUDA tensors only
    return t.item() / world


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    rank, world = init_distributed(args.device)
    try:
        return train(args, rank, world)
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def train(args: argparse.Namespace, rank: int, world: int) -> int:
    say = print if rank == 0 else (lambda *a, **k: None)  # one rank prints
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    tok, data = load_tokens()
    split = int(0.9 * len(data))  # the last 10% of the text is held out for the final loss
    train_data, val_data = data[:split], data[split:]

    preset = PRESETS[args.preset]
    seq_len = args.seq_len or preset.block_size
    cfg = GPTConfig.preset(args.preset, vocab_size=tok.vocab_size, block_size=seq_len)
    model = GPT(cfg)
    say(
        f"corpus: {len(data):,} characters, vocabulary {tok.vocab_size}; model: preset {args.preset!r}, "
        f"{model.num_params():,} parameters, {cfg.n_layer} layers x {cfg.n_embd} wide",
        flush=True,
    )

    tm = TieredModel(
        model,
        policy=POLICIES[args.policy](),
        optimizer=AdamW(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, no_decay_1d=True),
        precision=args.precision,
        grad_clip=args.grad_clip or None,
        trace_path=args.trace if rank == 0 else None,
        nvme_dir=nvme_dir(args),
        device=args.device,
        shard_weights=args.shard_weights,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(tm.optimizer, lr_factor(args.warmup, args.steps, args.min_lr_ratio))
    say(
        f"{tm!r}; {args.steps} steps of {args.grad_accum} x {args.batch_size} x {seq_len} tokens"
        + (f" on each of {world} ranks" if world > 1 else ""),
        flush=True,
    )

    gen = torch.Generator().manual_seed(args.seed + rank)  # each rank its own batches
    tokens_per_step = args.grad_accum * args.batch_size * seq_len * world
    tm.train()
    window_start, window_loss, window_steps, skipped = time.perf_counter(), 0.0, 0, 0
    for step in range(1, args.steps + 1):
        step_loss = 0.0
        for micro in range(args.grad_accum):
            x, y = get_batch(train_data, args.batch_size, seq_len, gen)
            loss = lm_loss(tm(x), y) / args.grad_accum  # mean over the micro-batches
            # ranks exchange gradients once per step, in the last micro-batch's backward
            with tm.no_sync() if micro < args.grad_accum - 1 else contextlib.nullcontext():
                tm.backward(loss)
            step_loss += loss.item()
        res = tm.step()
        sched.step()
        skipped += res.skipped
        window_loss += step_loss
        window_steps += 1
        if step % args.log_every == 0 or step == args.steps:
            window_loss = mean_over_ranks(window_loss, world, args.device)
            elapsed = time.perf_counter() - window_start
            note = f" | skipped (fp16 overflow), scale {res.loss_scale:g}" if res.skipped else ""
            say(
                f"step {step:5d}/{args.steps} | loss {window_loss / window_steps:.4f} "
                f"| grad norm {res.grad_norm:6.3f} | lr {sched.get_last_lr()[0]:.2e} "
                f"| {tokens_per_step * window_steps / elapsed:8,.0f} tok/s "
                f"| {1e3 * elapsed / window_steps:7.1f} ms/step{note}",
                flush=True,
            )
            window_start, window_loss, window_steps = time.perf_counter(), 0.0, 0

    tm.eval()
    with torch.no_grad():
        losses = [
            lm_loss(tm(x), y).item()
            for x, y in (get_batch(val_data, args.batch_size, seq_len, gen) for _ in range(args.eval_batches))
        ]
    held_out = mean_over_ranks(sum(losses) / len(losses), world, args.device)
    say(
        f"held-out loss {held_out:.4f} (last 10% of the text, {args.eval_batches} batches)"
        + (f"; {skipped} steps skipped" if skipped else ""),
        flush=True,
    )

    if args.sample_tokens:
        prompt = "This License"
        out = generate(
            tm,
            tok.encode(prompt).view(1, -1),
            args.sample_tokens,
            block_size=seq_len,
            temperature=0.8,
            generator=torch.Generator().manual_seed(args.seed),
        )
        say("---- sample ----\n" + tok.decode(out[0]) + "\n---- end of sample ----", flush=True)

    if args.save:
        tm.save(args.save)
        say(f"checkpoint written to {args.save}", flush=True)
    say(tm.report(), flush=True)
    if args.trace:
        say(f"trace written to {args.trace} (open it in https://ui.perfetto.dev)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
