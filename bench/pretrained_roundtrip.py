"""A Hugging Face checkpoint in and out, as a user fine-tunes it: load, train, save, reload.

    python bench/pretrained_roundtrip.py [--hidden 2048 --layers 22 --intermediate 5632 --heads 32
                                          --kv-heads 4 --vocab 32000] [--steps 20] [--seq 64]
                                          [--dir DIR] [--fio-size 2GiB]

The defaults are TinyLlama's shape (1.1B parameters). transformers builds the Llama in memory (bf16)
and saves it with its own ``save_pretrained`` (safetensors); its pages are dropped from the page
cache (``posix_fadvise(DONTNEED)`` after ``fsync``), so tiermem reads them from the disk.
``tiermem.from_pretrained`` then builds the model on the meta device and streams each tensor to its
home (ZeroInfinity, ``AdamW8bit(bf16_stochastic_round=True)``, ``update_in_backward=True``:
weights and state on NVMe); ``--steps`` steps on one repeated batch (the loss must fall);
``tm.save_pretrained`` writes bf16 shards, flushed to the disk (``fsync``, timed apart); transformers
loads them back in fp32 and its logits are compared with those of ``tm.detach()``'s fp32 masters
rounded to bf16 as the shards hold them (the same input): they must be equal. Peak RSS is sampled
(``/proc/self/statm`` every 20 ms) per phase.

Anchor: fio's sequential read and write bandwidth on the same directory (8 MiB, O_DIRECT), measured
first. The load's floor is the checkpoint's bytes at fio's read speed plus the bytes tiermem wrote
to NVMe at fio's write speed; the save's, the shards' bytes read at fio's read speed (the weights it reads are those
bytes) plus written at fio's write speed. Printed last: floor / time for the load and the save (1.0x is fio's speed; target
>= 0.8x). Needs fio and transformers.
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

from bench._common import RssSampler, llama_config, nvme_bytes
from bench._fio import faster_after, read_write
from tiermem import AdamW8bit, Budgets, from_pretrained
from tiermem.policies import ZeroInfinity

GB = 1e9


def dir_bytes(d: str) -> int:
    return sum(p.stat().st_size for p in Path(d).rglob("*") if p.is_file())


def flush_and_drop(d: str) -> float:
    """fsync every file under ``d`` and drop its pages from the page cache; the seconds the fsyncs took."""
    t0 = time.perf_counter()
    for p in sorted(Path(d).rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--fio-size", default="2GiB")
    p.add_argument("--dir", default=None, help="where to work (default: the current directory)")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    where = args.dir or os.getcwd()
    bw = read_write(where, args.fio_size, name="roundtrip")
    root = tempfile.mkdtemp(prefix="tiermem-roundtrip-", dir=where)
    src, nvme, out = (os.path.join(root, s) for s in ("from-hf", "nvme", "from-tiermem"))
    os.makedirs(nvme)
    rss = RssSampler().__enter__()
    try:
        config = llama_config(
            hidden=args.hidden,
            layers=args.layers,
            intermediate=args.intermediate,
            heads=args.heads,
            kv_heads=args.kv_heads,
            vocab=args.vocab,
        )
        torch.manual_seed(0)
        hf = LlamaForCausalLM(config).to(torch.bfloat16)
        n = sum(q.numel() for q in hf.parameters())
        hf.save_pretrained(src)
        del hf
        flush_and_drop(src)
        ckpt = dir_bytes(src)
        print(f"transformers saved {n:,} parameters ({n / 1e9:.2f}B) in bf16: {ckpt / GB:.2f} GB", flush=True)
        rss.reset()

        t0 = time.perf_counter()
        tm = from_pretrained(
            src,
            ZeroInfinity(),
            precision="bf16",
            nvme_dir=nvme,
            optimizer=AdamW8bit(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, bf16_stochastic_round=True),
            budgets=Budgets(device="2GiB", nvme=shutil.disk_usage(where).free // 2),
            update_in_backward=True,
            device="cpu",
        )
        load = time.perf_counter() - t0
        _, written = nvme_bytes(tm.report())
        load_floor = ckpt / bw["read"] + written / bw["write"]
        print(
            f"from_pretrained: {load:.1f} s; read {ckpt / GB:.2f} GB, wrote {written / GB:.2f} GB to NVMe: floor "
            f"{load_floor:.1f} s; peak RSS {rss.reset() / GB:.1f} GB (sampled)",
            flush=True,
        )

        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, args.vocab, (1, args.seq), generator=g)
        losses = []
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = tm(ids, labels=ids).loss
            tm.backward(loss)
            tm.step()
            losses.append(loss.item())
        print(
            f"{args.steps} steps in {time.perf_counter() - t0:.0f} s: loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
            f"peak RSS {rss.reset() / GB:.1f} GB",
            flush=True,
        )
        assert losses[-1] < losses[0], losses

        r0 = tm.report()
        t0 = time.perf_counter()
        tm.save_pretrained(out, dtype=torch.bfloat16)
        save = time.perf_counter() - t0
        sync = flush_and_drop(out)
        (read0, _), (read1, _) = nvme_bytes(r0), nvme_bytes(tm.report())
        shards = dir_bytes(out)
        save_floor = shards / bw["read"] + shards / bw["write"]
        print(
            f"save_pretrained: {save:.1f} s + fsync {sync:.1f} s; NVMe reads meanwhile {(read1 - read0) / GB:.2f} GB (the "
            f"weights, and the next step's reads ahead), "
            f"wrote {shards / GB:.2f} GB: floor {save_floor:.1f} s; peak RSS {rss.reset() / GB:.1f} GB",
            flush=True,
        )

        ours = tm.detach().eval()
        # the fp32 masters as the bf16 shards hold them (the buffers, rotary's inv_freq, stay fp32)
        with torch.no_grad():
            for q in ours.parameters():
                q.data = q.data.to(torch.bfloat16).float()
        theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            a, b = ours(ids).logits, theirs(ids).logits
        same = torch.equal(a, b)
        print(f"transformers' reload: logits {'equal' if same else 'DIFFER'} (max |diff| {(a - b).abs().max():.3g})")
    finally:
        rss.__exit__(None, None, None)
        shutil.rmtree(root, ignore_errors=True)
    # the disk's speed drifts (a shared machine): fio again, and the floors at the faster of the two
    fast = faster_after(where, args.fio_size, bw, name="roundtrip")
    load_floor = ckpt / fast["read"] + written / fast["write"]
    save_floor = shards / fast["read"] + shards / fast["write"]  # the weights it must read are the shards' bytes
    print(
        f"speed / fio's (the faster) for the same bytes: load {load_floor / load:.2f}x, save "
        f"{save_floor / (save + sync):.2f}x (without the fsync {save_floor / save:.2f}x)"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
