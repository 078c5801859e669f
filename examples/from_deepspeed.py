"""Coming from DeepSpeed or the Hugging Face Trainer: the same model and DeepSpeed config, trained by tiermem.

    python examples/from_deepspeed.py                       # both migrations, a tiny GPT-2, ~1 min on a CPU
    python examples/from_deepspeed.py --steps 5 --out /tmp/run

1. A DeepSpeed loop (``deepspeed.initialize(model=..., config="ds.json")``, ``engine.backward``,
   ``engine.step``) becomes ``tiermem.from_deepspeed_config(model, "ds.json")``, ``tm.backward``,
   ``tm.step``, with ``examples/deepspeed/ds_zero_offload.json`` as it is.
2. A Trainer run with ``TrainingArguments(deepspeed="ds.json")`` becomes
   ``TieredTrainer(..., deepspeed="ds.json")``, with ``examples/deepspeed/ds_zero_offload_auto.json``
   (the "auto" values come from TrainingArguments): same loop, logs and checkpoint-N/ folders.

The model is a GPT-2 built from a config (nothing is downloaded), trained on the bytes of the
text in ``examples/data``; the keys of the DeepSpeed config tiermem does not honour are logged,
one line each. Needs the ``hf`` extra: ``pip install -e '.[hf]'``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # `python examples/from_deepspeed.py` from anywhere
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is built from a config: nothing to download

from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments  # noqa: E402

import tiermem  # noqa: E402
from tiermem.integrations.transformers import TieredTrainer  # noqa: E402

SEQ = 64


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    )


def byte_blocks() -> list[dict]:
    """The shipped text as bytes, in blocks of SEQ tokens (labels = inputs: causal LM)."""
    text = b"\n".join(p.read_bytes() for p in sorted((HERE / "data").glob("*.txt")))
    ids = torch.tensor(list(text[: len(text) // SEQ * SEQ]), dtype=torch.long).view(-1, SEQ)
    ids = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))]
    return [{"input_ids": x, "labels": x} for x in ids]


def deepspeed_loop(data: list[dict], steps: int) -> list[float]:
    """Migration 1: a DeepSpeed training loop."""
    model = tiny_gpt2()
    micro, accum = 8, 2  # the config's train_micro_batch_size_per_gpu and gradient_accumulation_steps
    # was: engine, _, _, _ = deepspeed.initialize(model=model, config="ds_zero_offload.json")
    tm = tiermem.from_deepspeed_config(model, HERE / "deepspeed" / "ds_zero_offload.json")
    losses = []
    for step in range(steps):
        for i in range(accum):
            at = (step * accum + i) * micro % (len(data) - micro)
            x = torch.stack([d["input_ids"] for d in data[at : at + micro]])
            loss = tm(input_ids=x, labels=x).loss / accum  # engine.backward divided by accum; here we do
            tm.backward(loss)  # was: engine.backward(loss)
            losses.append(loss.item() * accum)
        res = tm.step()  # was: engine.step()
        print(
            f"deepspeed loop  step {step + 1:3d} | loss {sum(losses[-accum:]) / accum:.3f} | "
            f"grad norm {res.grad_norm:.3f}",
            flush=True,
        )
    return losses


def hf_trainer(data: list[dict], steps: int, out: str) -> list[float]:
    """Migration 2: the Hugging Face Trainer with a DeepSpeed config."""
    model = tiny_gpt2()
    args = TrainingArguments(
        out,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=steps,
        learning_rate=1e-3,
        adam_beta2=0.95,
        weight_decay=0.1,
        max_grad_norm=1.0,
        bf16=True,
        lr_scheduler_type="constant",
        logging_steps=max(1, steps // 5),
        save_steps=steps,
        report_to=[],
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    # was: Trainer(model=model, args=args, ...) with TrainingArguments(..., deepspeed="ds_zero_offload_auto.json")
    trainer = TieredTrainer(
        model=model, args=args, train_dataset=data, deepspeed=str(HERE / "deepspeed" / "ds_zero_offload_auto.json")
    )
    trainer.train()
    print(f"trainer: {trainer.tiered!r}; checkpoints: {sorted(os.listdir(out))}")
    return [h["loss"] for h in trainer.state.log_history if "grad_norm" in h]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps of each run")
    p.add_argument("--out", default=None, help="the Trainer's output_dir (default: a temporary directory)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # tiermem's notes on the config
    data = byte_blocks()
    first = deepspeed_loop(data, a.steps)
    with tempfile.TemporaryDirectory() as tmp:
        logged = hf_trainer(data, a.steps, a.out or tmp)
    print(f"loss: DeepSpeed loop {first[0]:.3f} -> {first[-1]:.3f}; Trainer {logged[0]:.3f} -> {logged[-1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
