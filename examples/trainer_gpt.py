"""The Hugging Face Trainer on tiermem, in one process or under torchrun.

    python examples/trainer_gpt.py                               # one process; ~1 min on a CPU
    torchrun --nproc_per_node 2 examples/trainer_gpt.py          # data parallel over 2 processes
    python examples/trainer_gpt.py --steps 60 --resume           # continue from the newest checkpoint-N/

A tiny GPT-2 built from a config (nothing is downloaded) learns the bytes of the text in
``examples/data`` through :class:`tiermem.integrations.transformers.TieredTrainer`: ZeRO-Offload,
bf16 where the device computes it natively (else fp32), gradient accumulation, clipping, a cosine
schedule, a checkpoint every ``--save-steps``.
Under torchrun the Trainer joins the process group (gloo on the CPU, NCCL on GPUs), its sampler
gives each rank its share of the batches, and tiermem shards gradients and optimizer state over
the ranks (NOTE [Data parallel] in tiermem/transfer/collectives.py); rank 0 prints. Every rank
must see ``--out``. Needs the ``hf`` extra: ``pip install -e '.[hf]'``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python examples/trainer_gpt.py` from anywhere
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is built from a config: nothing to download

from transformers import TrainingArguments

from examples.from_deepspeed import byte_blocks, tiny_gpt2
from tiermem.config.specs import resolve_precision
from tiermem.integrations.transformers import TieredTrainer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=30, help="optimizer steps in all (a resumed run included)")
    p.add_argument("--out", default="trainer_gpt_out", help="the Trainer's output_dir, seen by every rank")
    p.add_argument("--save-steps", type=int, default=10, help="a checkpoint-N/ every this many steps")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint-N/")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # bf16 where the device computes it natively, else fp32 (tiermem's precision="auto": NOTE [Choosing the
    # precision] in tiermem/config/specs.py); TrainingArguments(bf16=True) is tiermem's bf16 either way
    bf16 = resolve_precision("auto", torch.device("cuda" if torch.cuda.is_available() else "cpu")) == "bf16"
    args = TrainingArguments(
        a.out,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=a.steps,
        learning_rate=1e-3,
        adam_beta2=0.95,
        weight_decay=0.1,
        max_grad_norm=1.0,
        bf16=bf16,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        logging_steps=max(1, a.steps // 10),
        save_steps=a.save_steps,
        report_to=[],
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = TieredTrainer(model=tiny_gpt2(), args=args, train_dataset=byte_blocks())
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    logged = [h["loss"] for h in trainer.state.log_history if "grad_norm" in h]
    if trainer.is_world_process_zero():
        print(
            f"world size {args.world_size}: loss {logged[0]:.3f} -> {logged[-1]:.3f} at step "
            f"{trainer.state.global_step}; checkpoints {sorted(os.listdir(a.out))}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
