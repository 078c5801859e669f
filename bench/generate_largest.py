"""Greedy generation with a Llama bigger than the machine: built on the meta device for inference
only, its weights initialized at their homes, the host keeping what its budget holds.

    python bench/generate_largest.py [--hidden 5120 --layers 40 --intermediate 13824 --heads 40
                                      --vocab 32000] [--host 12GB] [--device-budget 2GiB]
                                      [--batches 1,16] [--prompt 16] [--new-tokens 4] [--dir DIR]

The defaults are Llama-2-13B's shape (13.0B parameters, 26 GB of bf16 weights on this 24 GiB
machine), the model of bench/largest_llama.py. ``transformers.LlamaForCausalLM`` is built under
``torch.device("meta")`` and wrapped with ``TieredModel(model, ZeroInfinity(), optimizer=None,
budgets=Budgets(host=--host, device=--device-budget))``: each module initialized by transformers'
own ``_init_weights`` and written to its home, the host keeping the weights its budget holds (the
smallest first) and NVMe the rest (NOTE [Resident weights for inference]). There is no checkpoint
and no anchor in memory: neither fits. At each batch, one ``generate`` of one token records the
weights' order; the timed one makes ``--new-tokens``.

Printed: the build's time and peak RSS; per batch the tokens/s, the NVMe bytes read per token, and
the floor: those bytes at fio's sequential read bandwidth on the same directory (8 MiB O_DIRECT,
measured first), with the ratio tokens/s / floor's tokens/s last. Needs fio and transformers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RssSampler, add_llama_shape, counts, du_bytes, meta_llama, nvme_bytes, token_prompts
from bench._fio import read_write
from tiermem import Budgets, TieredModel
from tiermem.policies import ZeroInfinity

GB = 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_llama_shape(p)
    p.add_argument("--host", default="12GB", help="the host's budget: the weights it holds stay resident")
    p.add_argument("--device-budget", default="2GiB", help="the device tier's budget (the CPU's RAM here)")
    p.add_argument("--batches", type=counts, default=[1, 16])
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--fio-size", default="4GiB", help="bytes of fio's passes (O_DIRECT, 8 MiB blocks)")
    p.add_argument("--dir", default=None, help="where to make the NVMe directory (default: the current one)")
    args = p.parse_args()
    where = args.dir or os.getcwd()
    model = meta_llama(args, args.prompt + args.new_tokens + 16)
    n = sum(q.numel() for q in model.parameters())
    print(f"LlamaForCausalLM {n / 1e9:.2f}B parameters on the meta device, {2 * n / GB:.1f} GB in bf16", flush=True)
    read_bw = read_write(where, args.fio_size, name="generate-largest")["read"]
    d = tempfile.mkdtemp(prefix="tiermem-generate-", dir=where)
    with RssSampler() as rss:
        try:
            t0 = time.perf_counter()
            torch.manual_seed(0)
            tm = TieredModel(
                model,
                ZeroInfinity(),
                optimizer=None,
                precision="bf16",
                nvme_dir=d,
                budgets=Budgets(host=args.host, device=args.device_budget),
                device="cpu",
            )
            resident = sum(model.get_parameter(name).numel() * 2 for name in tm.model_plan.placement.on_host)
            print(
                f"built in {time.perf_counter() - t0:.0f} s; peak RSS {rss.reset() / GB:.1f} GB sampled; "
                f"{resident / GB:.1f} GB of weights resident on the host, {du_bytes(d) / GB:.1f} GB on NVMe",
                flush=True,
            )
            ratios = []
            for batch in args.batches:
                kw = dict(**token_prompts(args.vocab, batch, args.prompt), do_sample=False, pad_token_id=0)
                tm.generate(**kw, max_new_tokens=1)  # records the weights' order
                read0, t0 = nvme_bytes(tm.report())[0], time.perf_counter()
                out = tm.generate(**kw, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
                sec, read = time.perf_counter() - t0, nvme_bytes(tm.report())[0] - read0
                assert out.shape == (batch, args.prompt + args.new_tokens)
                if not read:
                    raise SystemExit(
                        "nothing was read from NVMe: lower --host or --device-budget so that weights stream"
                    )
                tok_s, floor = batch * args.new_tokens / sec, batch * args.new_tokens / (read / read_bw)
                ratios.append((batch, tok_s / floor))
                print(
                    f"batch {batch:2d}: {tok_s:.3f} tokens/s ({sec:.0f} s for {args.new_tokens} tokens each), NVMe read "
                    f"{read / args.new_tokens / GB:.1f} GB per token; floor {floor:.3f} tokens/s at fio's "
                    f"{read_bw / GB:.2f} GB/s; peak RSS {rss.reset() / GB:.1f} GB sampled",
                    flush=True,
                )
        finally:
            shutil.rmtree(d, ignore_errors=True)
    for batch, ratio in ratios:
        print(f"batch {batch:2d}: tiermem tokens/s / NVMe floor {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
