"""The HF Trainer on tiermem: what ``TieredTrainer`` costs per optimizer step, in one run.

    python bench/trainer.py [--n-embd 256] [--n-layer 4] [--seq-len 128] [--batch-size 4]
                            [--accum 2] [--steps 12] [--warmup 3] [--rounds 2] [--ranks 1]

Three ways to train the same GPT-2 (built from a config) on the same batches, bf16, gradient
accumulation, clipping at 1.0, a linear lr schedule:

- ``trainer``: the plain ``transformers.Trainer`` (fp32 weights, bf16 autocast, fused torch AdamW),
  what an HF user runs without DeepSpeed;
- ``tiered-trainer``: ``TieredTrainer`` (ZeRO-Offload, bf16 weights, tiermem's CPU Adam);
- ``own-loop``: ``TieredModel``'s own loop with the same options (the integration's anchor: what
  ``TieredTrainer`` adds is the Trainer's loop around it).

``--ranks 2`` runs the three on 2 gloo ranks the script spawns (one intra-op thread each): the
plain Trainer under DDP (accelerate wraps it), ``TieredTrainer`` on tiermem's data parallelism,
and the own loop on the same (``tm.no_sync()`` on the micro-batches before a step's last); each
rank its share of the batches; rank 0's step times are reported (collectives keep the ranks in
step).

A Trainer step is timed from ``on_step_begin`` to ``on_step_end`` (forward, backward, optimizer
step and lr schedule of one optimizer step; logging and saving are outside). The three run in
turn, ``--rounds`` times, so load from other processes hits them alike; each figure is the median
(and the best) over the steps after ``--warmup`` of every round. Ratios come last.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from bench._common import free_port
from tiermem import AdamW, TieredModel
from tiermem.integrations.transformers import TieredTrainer


class StepTimer(TrainerCallback):
    def __init__(self):
        self.seconds: list[float] = []
        self._t0 = 0.0

    def on_step_begin(self, args, state, control, **kw):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.seconds.append(time.perf_counter() - self._t0)


def model_of(a) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=512,
            n_positions=a.seq_len,
            n_embd=a.n_embd,
            n_layer=a.n_layer,
            n_head=4,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def data_of(a) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    n = a.batch_size * a.accum * a.steps * a.ranks  # each rank gets its share through the Trainer's sampler
    return [{"input_ids": x, "labels": x} for x in torch.randint(0, 512, (n, a.seq_len), generator=g)]


def args_of(a, out: str, **kw) -> TrainingArguments:
    return TrainingArguments(
        out,
        per_device_train_batch_size=a.batch_size,
        gradient_accumulation_steps=a.accum,
        max_steps=a.steps,
        learning_rate=1e-3,
        weight_decay=0.1,
        max_grad_norm=1.0,
        lr_scheduler_type="linear",
        warmup_steps=1,
        logging_steps=a.steps,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        bf16=True,
        use_cpu=not torch.cuda.is_available(),
        dataloader_pin_memory=False,
        **kw,
    )


def run_trainer(a, cls, **kw) -> list[float]:
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        trainer = cls(model=model_of(a), args=args_of(a, out, **kw), train_dataset=data_of(a), callbacks=[timer])
        trainer.train()
    return timer.seconds


def run_own_loop(a) -> list[float]:
    model = model_of(a)
    decay = {n for n, p in model.named_parameters() if p.dim() >= 2}
    tm = TieredModel(
        model,
        optimizer=AdamW(
            lr=1e-3, weight_decay=0.1, no_decay=tuple(n for n, _ in model.named_parameters() if n not in decay)
        ),
        precision="bf16",
        grad_clip=1.0,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        tm.optimizer, lambda s: min(1.0, s) * max(0.0, (a.steps - s) / max(1, a.steps - 1))
    )
    data, seconds, rank = data_of(a), [], tm.group.rank
    for step in range(a.steps):
        t0 = time.perf_counter()
        for i in range(a.accum):
            at = ((step * a.accum + i) * a.ranks + rank) * a.batch_size
            x = torch.stack([d["input_ids"] for d in data[at : at + a.batch_size]])
            with tm.no_sync() if i < a.accum - 1 else contextlib.nullcontext():  # communicate once per step
                tm.backward(tm(input_ids=x, labels=x).loss / a.accum)
        tm.step()
        sched.step()
        seconds.append(time.perf_counter() - t0)
    return seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ranks", type=int, default=1, help="gloo ranks (processes); 1: this process alone")
    a = p.parse_args(argv)
    if a.ranks == 1:
        return measure(a)
    torch.multiprocessing.spawn(rank_main, args=(a, free_port()), nprocs=a.ranks)
    return 0


def rank_main(rank: int, a: argparse.Namespace, port: int) -> None:
    """One of ``--ranks`` processes, in the environment torchrun would give it."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(a.ranks),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(a.ranks),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=a.ranks)  # accelerate joins this group
    try:
        if rank == 0:
            measure(a)
        else:
            with contextlib.redirect_stdout(open(os.devnull, "w")):
                measure(a)
    finally:
        torch.distributed.destroy_process_group()


def measure(a: argparse.Namespace) -> int:
    n = sum(q.numel() for q in model_of(a).parameters())
    print(
        f"GPT-2 {n / 1e6:.1f}M params, batch {a.batch_size} x seq {a.seq_len} x accum {a.accum} per rank, "
        f"{a.ranks} rank(s), bf16, {a.steps} steps x {a.rounds} rounds (first {a.warmup} of each dropped); "
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores",
        flush=True,
    )
    runs = {
        "trainer": lambda: run_trainer(a, Trainer, optim="adamw_torch_fused"),
        "tiered-trainer": lambda: run_trainer(a, TieredTrainer),
        "own-loop": lambda: run_own_loop(a),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(a.rounds):
        for name, run in runs.items():
            times[name] += run()[a.warmup :]
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:16s} step median {med[k] * 1e3:8.1f} ms   best {min(v) * 1e3:8.1f} ms   ({len(v)} steps)")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    best = {k: min(v) for k, v in times.items()}
    print("ratios of bests (the least disturbed steps):")
    print(f"  tiered-trainer / own-loop = {best['tiered-trainer'] / best['own-loop']:.2f}x")
    print(f"  tiered-trainer / trainer  = {best['tiered-trainer'] / best['trainer']:.2f}x")
    print("ratios of medians:")
    print(
        f"  tiered-trainer / own-loop = {med['tiered-trainer'] / med['own-loop']:.2f}x  (the Trainer's loop around "
        f"tiermem)"
    )
    print(
        f"  tiered-trainer / trainer  = {med['tiered-trainer'] / med['trainer']:.2f}x  (tiermem's ZeRO-Offload "
        f"against the plain Trainer{' under DDP' if a.ranks > 1 else ''})",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
