"""What tiermem's forward machinery costs, in one run: forward, and forward+backward, of a small GPT
under placements that need more or less of it.

    python bench/forward_hooks.py [--preset tiny] [--batch-size 8] [--steps 30] [--threads 1]

- ``zero-offload``: the built-in policy: no module hook in the forward, only the saved-tensor
  hooks (the anchor).
- ``zero-offload, module hooks``: the same placements from a policy that says its activations'
  homes depend on their module, so a pre and post hook run around every module's forward.
- ``zero-offload again``: the anchor twice, for the noise between two identical setups.
- ``weights on host`` and ``zero-infinity``: weights homed off the device (on the host; on NVMe):
  module hooks fetch them ahead, and every op that computes with one goes through its tensor
  subclass (NOTE [Weights off the device are a tensor subclass]).

The script uses public API only, so the same file times an older tree too (copy it there and run
it with that tree's environment): that is how a change to the mechanism is compared before/after.
Setups run round-robin, so load from other processes hits them alike; medians over ``--steps``.
Ratios come last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.gpt import GPT, GPTConfig, lm_loss
from tiermem import Policy, TensorClass, Tier, TieredModel
from tiermem.policies import ZeroInfinity, ZeroOffload


class ZeroOffloadByModule(Policy):
    """ZeroOffload's placements, asking for the module of every activation."""

    def place(self, info):
        return ZeroOffload().place(info)


class WeightsOnHost(Policy):
    """ZeroOffload with the weights homed on the host."""

    def place(self, info):
        return Tier.HOST if info.kind is TensorClass.PARAM else ZeroOffload().place(info)

    def places_activations_by_module(self) -> bool:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = GPTConfig.preset(args.preset, vocab_size=256, block_size=64)
    nvme = tempfile.TemporaryDirectory()  # one directory per run that places weights there
    setups = {
        "zero-offload": ZeroOffload(),
        "zero-offload, module hooks": ZeroOffloadByModule(),
        "zero-offload again": ZeroOffload(),  # A/A: the noise between two identical setups
        "weights on host": WeightsOnHost(),
        "zero-infinity": ZeroInfinity(),
    }
    models = {}
    for i, (name, policy) in enumerate(setups.items()):
        torch.manual_seed(0)
        where = Path(nvme.name) / str(i)
        where.mkdir()
        models[name] = TieredModel(GPT(cfg), policy, nvme_dir=str(where), precision="bf16")
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (args.batch_size, 65), generator=g)
    x, y = idx[:, :-1], idx[:, 1:]
    fwd = {name: [] for name in setups}
    both = {name: [] for name in setups}
    for step in range(args.steps + 2):
        order = list(setups)[step % len(setups) :] + list(setups)[: step % len(setups)]
        for name in order:
            tm = models[name]
            t0 = time.perf_counter()
            logits = tm(x)
            t1 = time.perf_counter()
            tm.backward(lm_loss(logits, y))
            t2 = time.perf_counter()
            tm.step()
            if step >= 2:  # the first steps record the weights' order and warm the pools
                fwd[name].append(t1 - t0)
                both[name].append(t2 - t0)
    for tm in models.values():
        tm.detach()
    nvme.cleanup()
    n = sum(p.numel() for p in GPT(cfg).parameters())
    print(
        f"GPT preset {args.preset!r}: {n / 1e6:.2f}M parameters, batch {args.batch_size}x64, "
        f"{args.threads} thread(s), {args.steps} steps per setup"
    )
    med_f = {name: statistics.median(v) for name, v in fwd.items()}
    med_b = {name: statistics.median(v) for name, v in both.items()}
    for name in setups:
        print(
            f"  {name:28s} forward median {med_f[name] * 1e3:7.2f} ms   forward+backward median "
            f"{med_b[name] * 1e3:7.2f} ms"
        )
    print("ratios of medians (forward / forward+backward):")
    for name in ("zero-offload again", "zero-offload, module hooks", "weights on host", "zero-infinity"):
        print(
            f"  {name} / zero-offload: {med_f[name] / med_f['zero-offload']:.3f}x / "
            f"{med_b[name] / med_b['zero-offload']:.3f}x"
        )


if __name__ == "__main__":
    main()
