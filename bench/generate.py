"""Greedy generation with weights streamed: tiermem against accelerate's disk offload and the model in memory.

    python bench/generate.py [--size 200M|tiny] [--new-tokens 16] [--prompt 32] [--batches 1,16]
                             [--budgets 1.0,0.5,0.1] [--dir DIR] [--fio-size 1GiB]

One checkpoint: a transformers ``LlamaForCausalLM`` from a config (``--size 200M``: hidden 1024,
12 layers, intermediate 2816, 16 heads, vocab 32000, untied: 220M parameters), random init (seed 0), bf16,
saved once with ``save_pretrained``. The same prompts (random token ids, seed 0, ``--prompt`` long)
go to every contender, greedy, ``--new-tokens`` new tokens each (``min_new_tokens`` too, so an
end-of-sequence token stops no one early), at each batch of ``--batches``:

- **in memory**: ``from_pretrained(..., torch_dtype=bfloat16)`` and its ``generate``;
- **accelerate**: the model built under ``init_empty_weights`` and loaded with
  ``load_checkpoint_and_dispatch(device_map={"": "disk"}, offload_folder=...)``, every weight
  offloaded to disk and read back per forward through numpy memmaps: through the page cache, so
  its RAM is not bounded (on a warm cache it reads from memory, not the disk);
- **tiermem**: ``tiermem.from_pretrained(..., ZeroInfinity(), optimizer=None, budgets=Budgets(host=...))``
  and ``tm.generate``, the host budget at each fraction of ``--budgets`` of the weights' bytes
  (ZeroInfinity keeps the weights that fit there, those under a MiB then the largest, and streams the
  rest from NVMe: NOTE [Resident weights for inference]), and a device budget of ``--device`` of the
  weights' bytes plus the largest batch's KV cache (here the device is the CPU: unbounded, it would
  keep every weight once fetched).

Figures: tokens/s (new tokens x batch / seconds of one ``generate``, after one untimed warm-up
``generate`` each), whether the tokens equal the in-memory ones, the process's peak resident set
sampled during the timed ``generate`` (the contenders run one after another in one process, so it
includes what the earlier ones left to the allocator), and tiermem's floor: max(the in-memory seconds, the bytes it read
from NVMe during the ``generate`` at fio's sequential read bandwidth on the same directory,
measured first). Printed last, against issue 34's targets: tiermem / accelerate and tiermem / in
memory at each budget and batch (weights in the host budget: >= 3x accelerate and >= 0.9x in
memory; half of them: >= accelerate and >= 0.8x of the floor), and tiermem's batch 16 / batch 1
(>= 8x). Needs transformers, accelerate and fio.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RssSampler, at_least, counts, llama_config, nvme_bytes, token_prompts
from bench._fio import read_write
from tiermem import Budgets, from_pretrained
from tiermem.plan.kv_cache import KvShape, kv_cache
from tiermem.policies import ZeroInfinity

SIZES: dict[str, dict[str, int]] = {
    "200M": dict(hidden=1024, layers=12, intermediate=2816, heads=16, vocab=32000),
    "tiny": dict(hidden=128, layers=2, intermediate=352, heads=4, vocab=1000),  # a smoke run
}


# What tiermem's host footprint adds to the weights kept there (each buffer rounded up to whole
# pages): the host budget is the fraction of the weights' bytes plus this.
HOST_SLACK = 1 << 20


class Run(NamedTuple):
    """One contender's timed ``generate`` at one batch."""

    seconds: float
    tokens: torch.Tensor
    rss: int  # peak resident bytes sampled during it
    nvme_read: int = 0  # bytes read from NVMe during it (tiermem only)


def timed(generate: Callable[[], torch.Tensor], rss: RssSampler, nvme: Callable[[], int] = lambda: 0) -> Run:
    """One untimed warm-up call of ``generate``, then one timed; ``nvme`` counts bytes read so far."""
    generate()
    rss.reset()
    read0 = nvme()
    t0 = time.perf_counter()
    out = generate()
    sec = time.perf_counter() - t0
    return Run(sec, out, rss.reset(), nvme() - read0)


def generate_with(model: Any, args: argparse.Namespace, batch: int, vocab: int) -> Callable[[], torch.Tensor]:
    kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    inputs = token_prompts(vocab, batch, args.prompt)
    return lambda: model.generate(**inputs, **kw)


def run_all(
    model: Any, args: argparse.Namespace, vocab: int, rss: RssSampler, nvme: Callable[[], int] = lambda: 0
) -> dict[int, Run]:
    return {b: timed(generate_with(model, args, b, vocab), rss, nvme) for b in args.batches}


def in_memory(ckpt: str, args: argparse.Namespace, vocab: int, rss: RssSampler) -> dict[int, Run]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(ckpt, torch_dtype=torch.bfloat16).eval()
    with torch.no_grad():
        return run_all(model, args, vocab, rss)


def accelerate_disk(ckpt: str, work: str, args: argparse.Namespace, vocab: int, rss: RssSampler) -> dict[int, Run]:
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import AutoConfig, LlamaForCausalLM

    with init_empty_weights():
        model = LlamaForCausalLM(AutoConfig.from_pretrained(ckpt))  # buffers stay real, in fp32
    offload = os.path.join(work, "accelerate")
    model = load_checkpoint_and_dispatch(
        model, ckpt, device_map={"": "disk"}, offload_folder=offload, dtype=torch.bfloat16
    ).eval()
    with torch.no_grad():
        return run_all(model, args, vocab, rss)


def tiermem_at(
    ckpt: str, work: str, host: int, device: int, args: argparse.Namespace, vocab: int, rss: RssSampler
) -> dict[int, Run]:
    nvme_dir = tempfile.mkdtemp(prefix=f"tiermem-{host}-", dir=work)
    # the weights the policy puts there, plus room for the host buffers' rounding to whole pages
    budgets = Budgets(host=host + HOST_SLACK, device=device)
    tm = from_pretrained(ckpt, ZeroInfinity(), optimizer=None, nvme_dir=nvme_dir, precision="bf16", budgets=budgets)
    return run_all(tm, args, vocab, rss, lambda: nvme_bytes(tm.report())[0])


def verdict(ratio: float, target: float) -> str:
    return f"{ratio:6.2f}x ({at_least(ratio, target)})"


def tok_s(run: Run, args: argparse.Namespace, batch: int) -> float:
    return args.new_tokens * batch / run.seconds


def report(
    args: argparse.Namespace,
    weights: int,
    read_bw: float,
    mem: dict[int, Run],
    acc: dict[int, Run],
    tms: dict[float, dict[int, Run]],
) -> None:
    print("\n== tokens/s ==")
    for b in args.batches:
        print(f"batch {b:2d}: in memory {tok_s(mem[b], args, b):7.1f} tok/s, peak RSS {mem[b].rss / 1e9:.2f} GB")
        same = "yes" if torch.equal(acc[b].tokens, mem[b].tokens) else "NO"
        print(
            f"batch {b:2d}: accelerate disk offload {tok_s(acc[b], args, b):7.1f} tok/s, peak RSS {acc[b].rss / 1e9:.2f} GB"
            f" (reads through the page cache: its RAM is not bounded), same tokens: {same}"
        )
        for frac, runs in tms.items():
            r = runs[b]
            same = "yes" if torch.equal(r.tokens, mem[b].tokens) else "NO"
            floor = max(mem[b].seconds, r.nvme_read / read_bw)
            print(
                f"batch {b:2d}: tiermem host {frac:4.0%} {tok_s(r, args, b):7.1f} tok/s, peak RSS {r.rss / 1e9:.2f} GB,"
                f" NVMe read {r.nvme_read / args.new_tokens / 1e6:.1f} MB/token, floor {args.new_tokens * b / floor:.1f} tok/s,"
                f" same tokens: {same}"
            )
    print(f"\n== ratios (weights {weights / 1e6:.0f} MB; fio read {read_bw / 1e9:.2f} GB/s) ==")
    for b in args.batches:
        for frac, runs in tms.items():
            r, what = runs[b], f"batch {b:2d}, host {frac:4.0%}"
            floor = max(mem[b].seconds, r.nvme_read / read_bw)
            vs_acc, vs_mem, vs_floor = acc[b].seconds / r.seconds, mem[b].seconds / r.seconds, floor / r.seconds
            if frac >= 1.0:
                print(f"{what}: tiermem / accelerate {verdict(vs_acc, 3)}, tiermem / in memory {verdict(vs_mem, 0.9)}")
            elif frac >= 0.5:
                print(f"{what}: tiermem / accelerate {verdict(vs_acc, 1)}, tiermem / floor {verdict(vs_floor, 0.8)}")
            else:
                print(f"{what}: tiermem / accelerate {vs_acc:6.2f}x, tiermem / floor {vs_floor:6.2f}x (no target)")
    lo, hi = min(args.batches), max(args.batches)
    if lo != hi:
        for frac, runs in tms.items():
            ratio = tok_s(runs[hi], args, hi) / tok_s(runs[lo], args, lo)
            print(f"tiermem host {frac:4.0%}: batch {hi} / batch {lo} tokens/s {verdict(ratio, 8)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="200M")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--batches", type=counts, default=[1, 16])
    p.add_argument("--budgets", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 0.5, 0.1])
    p.add_argument(
        "--device",
        type=float,
        default=0.25,
        help="tiermem's device budget, a fraction of the weights' bytes (the CPU is the device: unbounded, it "
        "would keep every weight fetched once, and nothing would stream)",
    )
    p.add_argument("--fio-size", default="1GiB")
    p.add_argument("--dir", default=None, help="where to work (default: the current directory)")
    args = p.parse_args()
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    shape = SIZES[args.size]
    with tempfile.TemporaryDirectory(prefix="tiermem-generate-", dir=args.dir or os.getcwd()) as work:
        ckpt = os.path.join(work, "ckpt")
        config = llama_config(**shape, max_position_embeddings=args.prompt + args.new_tokens + 16)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        n = sum(t.numel() for t in model.parameters())
        weights = sum(t.numel() * t.element_size() for t in model.parameters())
        model.save_pretrained(ckpt)
        del model
        gc.collect()
        print(f"checkpoint: Llama {n / 1e6:.0f}M parameters ({shape}), bf16, {weights / 1e6:.0f} MB", flush=True)
        # the device keeps room for the largest batch's KV cache beside its share of the weights
        kv = kv_cache(KvShape.of(config), max(args.batches), args.prompt + args.new_tokens, torch.bfloat16)  # type: ignore[arg-type]  # a Llama config has a shape
        read_bw = read_write(work, args.fio_size, name="generate")["read"]
        with RssSampler() as rss:
            mem = in_memory(ckpt, args, shape["vocab"], rss)
            gc.collect()
            print("in memory: done", flush=True)
            acc = accelerate_disk(ckpt, work, args, shape["vocab"], rss)
            gc.collect()
            print("accelerate: done", flush=True)
            tms = {}
            for frac in args.budgets:
                tms[frac] = tiermem_at(
                    ckpt, work, int(weights * frac), int(weights * args.device) + kv.nbytes, args, shape["vocab"], rss
                )
                gc.collect()
                print(f"tiermem host {frac:.0%}: done", flush=True)
        report(args, weights, read_bw, mem, acc, tms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
