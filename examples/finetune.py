"""Fine-tuning as it is usually written: layer-wise lr decay and gradual unfreezing, on tiermem.

    python examples/finetune.py             # ~30 s on a CPU; --steps, --unfreeze-every, --decay, --policy

A small GPT (examples/gpt.py) is "pre-trained" for a few steps, then fine-tuned the way transfer
learning recipes do it:

- layer-wise lr decay (LLRD): one param group per layer, the top one at the base lr and each layer
  below at ``--decay`` times the one above, given as a plain ``torch.optim.AdamW`` over those groups
  (tiermem reads its class, groups and hyperparameters and runs it where the state lives), with a
  per-group warmup built on ``tm.optimizer``;
- gradual unfreezing: only the top layer trains at first, and every ``--unfreeze-every`` steps the
  next one down is unfrozen with ``requires_grad_(True)``; tiermem gives it optimizer state at the
  next step.

It prints the loss, each group's lr and which layers train.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python examples/finetune.py` from anywhere

from examples.gpt import GPT, GPTConfig, lm_loss, load_tokens
from tiermem import AdamW, TieredModel
from tiermem.policies import KeepOnDevice, ZeroInfinity, ZeroOffload

POLICIES = {"zero-offload": ZeroOffload, "keep-on-device": KeepOnDevice, "zero-infinity": ZeroInfinity}


def layers(model: GPT) -> list[torch.nn.Module]:
    """Bottom to top: the embeddings, each block, the final norm (the head is tied to wte)."""
    embed = torch.nn.ModuleList([model.wte, model.wpe])
    return [embed, *model.blocks, model.ln_f]


def llrd_groups(model: GPT, lr: float, decay: float) -> list[dict]:
    """One param group per layer: the top at ``lr``, each layer below ``decay`` times the one above."""
    stack = layers(model)
    return [
        {"params": layer.parameters(), "lr": lr * decay ** (len(stack) - 1 - depth), "name": f"layer{depth}"}
        for depth, layer in enumerate(stack)
    ]


def batches(data: torch.Tensor, batch_size: int, seq_len: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=g).tolist()
        x = torch.stack([data[s : s + seq_len] for s in starts])
        y = torch.stack([data[s + 1 : s + seq_len + 1] for s in starts])
        yield x, y


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--pretrain-steps", type=int, default=40)
    p.add_argument("--steps", type=int, default=60, help="fine-tuning steps")
    p.add_argument("--unfreeze-every", type=int, default=10, help="steps between unfreezing the next layer down")
    p.add_argument("--lr", type=float, default=3e-3, help="the top layer's lr")
    p.add_argument("--decay", type=float, default=0.7, help="each layer's lr over the one above it")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--policy", choices=sorted(POLICIES), default="zero-offload")
    p.add_argument("--nvme-dir", default=None, help="needed by --policy zero-infinity")
    p.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "bf16", "fp16", "fp32"],
        help="auto: bf16 where the device computes it natively, else fp32 on a CPU (fp16 on an older GPU)",
    )
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.manual_seed(0)
    tok, data = load_tokens()
    model = GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size, block_size=64))
    split = int(0.8 * len(data))

    # "pre-training" on the first part of the text: every parameter in one group
    with TieredModel(model, optimizer=AdamW(lr=3e-3), precision=a.precision) as tm:
        for _, (x, y) in zip(range(a.pretrain_steps), batches(data[:split], 8, 64, seed=0)):
            tm.backward(lm_loss(tm(x), y))
            tm.step()
    print(f"pre-trained {a.pretrain_steps} steps; fine-tuning on the rest of the text")

    # fine-tuning: the top layer trains first, one group per layer, lr decaying downwards
    stack = layers(model)
    model.requires_grad_(False)
    stack[-1].requires_grad_(True)
    optimizer = torch.optim.AdamW(llrd_groups(model, a.lr, a.decay), lr=a.lr, weight_decay=0.01)
    tm = TieredModel(model, POLICIES[a.policy](), optimizer=optimizer, precision=a.precision, nvme_dir=a.nvme_dir)
    print("groups:", ", ".join(f"{g['name']} lr {g['lr']:.2e}" for g in tm.optimizer.param_groups))
    warmup = torch.optim.lr_scheduler.LambdaLR(tm.optimizer, lambda s: min(1.0, (s + 1) / a.warmup))
    trained, losses = 1, []
    for step, (x, y) in zip(range(1, a.steps + 1), batches(data[split:], 8, 64, seed=1)):
        if step % a.unfreeze_every == 0 and trained < len(stack):
            trained += 1
            stack[-trained].requires_grad_(True)  # gradual unfreezing: the next layer down, from this step
        loss = lm_loss(tm(x), y)
        tm.backward(loss)
        tm.step()
        warmup.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == a.steps:
            print(
                f"step {step:3d} | loss {sum(losses) / len(losses):.3f} (mean since the last line) | training "
                f"the top {trained} of {len(stack)} layers | lr top {tm.optimizer.param_groups[-1]['lr']:.2e} "
                f"bottom {tm.optimizer.param_groups[0]['lr']:.2e}"
            )
            losses.clear()
    steps = tm.stepper.param_steps()
    print(
        "updates per layer:",
        ", ".join(f"{g['name']} {max(steps.get(n, 0) for n in g['param_names'])}" for g in tm.optimizer.param_groups),
    )
    tm.detach()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
