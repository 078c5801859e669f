"""A Hugging Face Llama bigger than the machine, trained as a user would: built on the meta device,
initialized at its homes, ZeroInfinity + 8-bit Adam with bf16 masters + update_in_backward.

    python bench/largest_llama.py [--hidden 5120 --layers 40 --intermediate 13824 --heads 40
                                   --vocab 32000] [--seq 32] [--rows 1] [--steps 3] [--dir DIR]
                                   [--keep-free 10GB] [--device-budget 2GiB] [--dry-run]

The defaults are Llama-2-13B's shape (13.0B parameters). ``transformers.LlamaForCausalLM`` is built
under ``torch.device("meta")`` (no memory) and wrapped with ``TieredModel(...,
update_in_backward=True)``: each module is initialized by transformers' own ``_init_weights`` in a
scratch buffer and written to NVMe (NOTE [Initialization on the meta device]); no gradient is kept
at rest (NOTE [Updates in backward]). Then ``--steps`` steps on one repeated batch of ``--rows`` x
``--seq`` random tokens (the loss must fall).

Printed: the disk arithmetic (before building: what the footprint says the disk must hold), the
build's time and peak RSS, per step the loss, the grad norm, forward+backward and ``tm.step()``
times (the step runs the second backward and the updates), the bytes the store read and wrote,
and the step's NVMe floor: those bytes at fio's sequential bandwidth on the same directory (8 MiB
O_DIRECT, measured first), serial (reads then writes) and overlapped (the larger of the two), and
the CPU time the process spent in the step (every thread: near cores x wall, the step is bound by
the CPU, not the disk). The ratio to the serial floor is printed last. Needs fio and transformers.
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

from bench._common import RssSampler, add_llama_shape, cpu_seconds, du_bytes, meta_llama, nvme_bytes, rss_gb
from bench._fio import faster_after, read_write
from tiermem import AdamW8bit, Budgets, TieredModel, parse_bytes
from tiermem.policies import ZeroInfinity

GB = 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_llama_shape(p)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--keep-free", default="10GB", help="free space to leave on the disk")
    p.add_argument("--device-budget", default="2GiB", help="the device tier's budget (the CPU's RAM here)")
    p.add_argument("--bucket-size", default="32MiB")
    p.add_argument("--fio-size", default="4GiB", help="bytes of fio's passes (O_DIRECT, 8 MiB blocks)")
    p.add_argument("--dir", default=None, help="where to make the NVMe directory (default: the current one)")
    p.add_argument("--dry-run", action="store_true", help="print the arithmetic only")
    args = p.parse_args()
    where = args.dir or os.getcwd()
    model = meta_llama(args, max(args.seq, 2048))
    n = sum(q.numel() for q in model.parameters())

    free = shutil.disk_usage(where).free
    print(
        f"LlamaForCausalLM hidden {args.hidden}, {args.layers} layers, intermediate {args.intermediate}, vocab "
        f"{args.vocab}: {n:,} parameters ({n / 1e9:.2f}B) on the meta device; disk {free / GB:.1f} GB free, "
        f"keep {parse_bytes(args.keep_free, what='--keep-free') / GB:.0f} GB; mixed-precision Adam in memory "
        f"would need {16 * n / GB:.0f} GB",
        flush=True,
    )
    if args.dry_run:
        return 0
    bw = read_write(where, args.fio_size, name="largest-llama")
    d = tempfile.mkdtemp(prefix="tiermem-llama-", dir=where)
    rss, worst = RssSampler().__enter__(), 0  # ru_maxrss misses peaks (RssSampler's docstring)
    try:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        tm = TieredModel(
            model,
            ZeroInfinity(),
            precision="bf16",
            nvme_dir=d,
            optimizer=AdamW8bit(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, bf16_stochastic_round=True),
            bucket_size=args.bucket_size,
            budgets=Budgets(device=args.device_budget, nvme=free - parse_bytes(args.keep_free, what="--keep-free")),
            update_in_backward=True,
            device="cpu",
        )
        worst = max(worst, built := rss.reset())
        print(
            f"built in {time.perf_counter() - t0:.0f} s (each module initialized by transformers, written to "
            f"NVMe); peak RSS {built / GB:.1f} GB sampled ({rss_gb():.1f} GB ru_maxrss); du {du_bytes(d) / n:.2f} "
            f"B/param",
            flush=True,
        )
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, args.vocab, (args.rows, args.seq), generator=g)
        moved = []  # per step: (NVMe bytes read, written, seconds)
        for i in range(1, args.steps + 1):
            r0 = tm.report()
            c0 = cpu_seconds()
            t0 = time.perf_counter()
            loss = tm(ids, labels=ids).loss
            tm.backward(loss)
            t1 = time.perf_counter()
            res = tm.step()
            t2 = time.perf_counter()
            (a0, w0), (a2, w2) = nvme_bytes(r0), nvme_bytes(tm.report())
            read, written = a2 - a0, w2 - w0
            serial = read / bw["read"] + written / bw["write"]
            overlapped = max(read / bw["read"], written / bw["write"])
            moved.append((read, written, t2 - t0))
            worst = max(worst, peak := rss.reset())
            print(
                f"step {i}: loss {loss.item():.4f}, grad norm {res.grad_norm:.3f}; fwd+bwd {t1 - t0:.1f} s, "
                f"tm.step() {t2 - t1:.1f} s (second backward + updates); NVMe read {read / GB:.1f} GB, written "
                f"{written / GB:.1f} GB: floor {serial:.1f} s serial, {overlapped:.1f} s overlapped; CPU busy "
                f"{cpu_seconds() - c0:.0f} s of {os.cpu_count()} cores x {t2 - t0:.0f} s; peak RSS {peak / GB:.1f} GB sampled; "
                f"du {du_bytes(d) / n:.2f} B/param",
                flush=True,
            )
        rep = tm.report()
        print(
            f"{rep}\nparameters {n:,}; on disk (du) {du_bytes(d) / GB:.1f} GB = {du_bytes(d) / n:.2f} B/param; "
            f"peak RSS {worst / GB:.1f} GB sampled = {worst / n:.2f} B/param in RAM ({rss_gb():.1f} GB ru_maxrss)"
        )
        # not tm.detach(): it would hand back the module with fp32 weights (4 B/param in RAM)
    finally:
        rss.__exit__(None, None, None)
        shutil.rmtree(d, ignore_errors=True)
    # the disk's speed drifts (a shared machine): fio again, and the floor at the faster of the two
    fast = faster_after(where, args.fio_size, bw, name="largest-llama")
    for name, b in (("fio before", bw), ("the faster fio", fast)):
        ratios = [t / (r / b["read"] + w / b["write"]) for r, w, t in moved]
        print(f"step time / NVMe serial floor at {name}, per step: " + ", ".join(f"{x:.2f}x" for x in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
