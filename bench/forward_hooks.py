"""What tiermem's forward hooks cost, in one run: the training step's forward and backward of a
small GPT with and without them.

    python bench/forward_hooks.py [--preset tiny] [--batch-size 8] [--steps 30] [--threads 1]

- ``zero-offload``: the built-in policy: no module hook in the forward, only the saved-tensor
  hooks (the anchor).
- ``zero-offload, module hooks``: the same placements from a policy that says its activations'
  homes depend on their module, so a pre and post hook run around every module's forward (what
  every policy got before ``Policy.places_activations_by_module()``).
- ``zero-offload again``: the anchor twice, for the noise between two identical setups.
- ``zero-infinity`` and ``zero-infinity, watch traced``: weights on NVMe; the watch on the forward's
  ops for weights read outside their module runs through ``torch.compiler.disable`` (as shipped)
  or as a plain method (a contrast: what the ``eager`` wrapper costs when nothing is compiled).

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

from examples.gpt import GPT, GPTConfig, lm_loss  # noqa: E402
from tiermem import Policy, TieredModel  # noqa: E402
from tiermem.policies import ZeroInfinity, ZeroOffload  # noqa: E402
from tiermem.train import param_offload  # noqa: E402


class ZeroOffloadByModule(Policy):
    """ZeroOffload's placements, asking for the module of every activation."""

    def place(self, info):
        return ZeroOffload().place(info)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = GPTConfig.preset(args.preset, vocab_size=256, block_size=64)
    watch = param_offload._Borrowing.__torch_function__
    traced_watch = watch.__wrapped__  # the method without torch.compiler.disable around it
    nvme = tempfile.TemporaryDirectory()  # one directory per run that places weights there
    setups = {
        "zero-offload": (ZeroOffload(), watch),
        "zero-offload, module hooks": (ZeroOffloadByModule(), watch),
        "zero-offload again": (ZeroOffload(), watch),  # A/A: the noise between two identical setups
        "zero-infinity": (ZeroInfinity(), watch),
        "zero-infinity, watch traced": (ZeroInfinity(), traced_watch),
    }
    models = {}
    for i, (name, (policy, _)) in enumerate(setups.items()):
        torch.manual_seed(0)
        where = Path(nvme.name) / str(i)
        where.mkdir()
        models[name] = TieredModel(GPT(cfg), policy, nvme_dir=str(where), precision="bf16")
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (args.batch_size, 65), generator=g)
    x, y = idx[:, :-1], idx[:, 1:]
    times = {name: [] for name in setups}
    for step in range(args.steps + 2):
        order = list(setups)[step % len(setups):] + list(setups)[:step % len(setups)]
        for name in order:
            param_offload._Borrowing.__torch_function__ = setups[name][1]
            tm = models[name]
            t0 = time.perf_counter()
            tm.backward(lm_loss(tm(x), y))
            elapsed = time.perf_counter() - t0
            tm.step()
            if step >= 2:  # the first steps record the weights' order and warm the pools
                times[name].append(elapsed)
    param_offload._Borrowing.__torch_function__ = watch
    for tm in models.values():
        tm.detach()
    nvme.cleanup()
    n = sum(p.numel() for p in GPT(cfg).parameters())
    print(f"GPT preset {args.preset!r}: {n / 1e6:.2f}M parameters, batch {args.batch_size}x64, "
          f"{args.threads} thread(s), {args.steps} steps per setup")
    med = {name: statistics.median(v) for name, v in times.items()}
    for name, m in med.items():
        print(f"  {name:30s} forward+backward median {m * 1e3:7.2f} ms  best {min(times[name]) * 1e3:7.2f} ms")
    print("ratios of medians:")
    print(f"  zero-offload again / zero-offload (A/A, the noise): {med['zero-offload again'] / med['zero-offload']:.3f}x")
    print(f"  zero-offload with module hooks / without: {med['zero-offload, module hooks'] / med['zero-offload']:.3f}x, "
          f"/ the A/A twin: {med['zero-offload, module hooks'] / med['zero-offload again']:.3f}x")
    print(f"  zero-infinity watch through compiler.disable / plain: "
          f"{med['zero-infinity'] / med['zero-infinity, watch traced']:.3f}x")
    best = {name: min(v) for name, v in times.items()}
    print("ratios of bests:")
    print(f"  zero-offload again / zero-offload (A/A, the noise): {best['zero-offload again'] / best['zero-offload']:.3f}x")
    print(f"  zero-offload with module hooks / without: {best['zero-offload, module hooks'] / best['zero-offload']:.3f}x, "
          f"/ the A/A twin: {best['zero-offload, module hooks'] / best['zero-offload again']:.3f}x")
    print(f"  zero-infinity watch through compiler.disable / plain: "
          f"{best['zero-infinity'] / best['zero-infinity, watch traced']:.3f}x")


if __name__ == "__main__":
    main()
