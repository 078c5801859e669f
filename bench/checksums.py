"""What checksums cost: the state-on-NVMe step with and without its data checksums, in one run.

    python bench/checksums.py [--width 2048] [--depth 12] [--rows 128] [--pairs 8] [--dir DIR]

Two identical models (examples/nvme_offload.py's policy: weights on the device tier, grads on the
host, the optimizer state streamed from NVMe through the three-stage pipeline) train on the same
data, one with the NVMe store's data checksums (NOTE [Data checksums]) and one without
(``TIERMEM_NVME_CHECKSUMS=0``, the benchmarking switch). Each step of one is paired with the step
of the other that comes right next to it, in the order ABBA BAAB ...: the disk behind this
machine is a virtual one whose speed depends on what was written just before, so a fixed order
would hand one setup the other's write-back every time (an A/A run, both without checksums,
prints the spread that is left: ``--aa``). The figure is the median over pairs of the two steps'
ratio, and beside it the CPU time of the process during each step (``time.process_time``: every
thread), whose difference is the hashing itself.

Also measured in the same run, for the same bytes: xxh3_64 over the state's bytes in memory (what
hashing alone costs on one core) and a checkpoint ``tm.save`` + load of the model with checksums.
Ratios come last.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for examples and bench

from bench.nvme_step import LinearStack  # noqa: E402
from examples.nvme_offload import OptimStateOnNvme  # noqa: E402
from tiermem import AdamW, TieredModel  # noqa: E402

GB = 1e9


def make(root: str, name: str, width: int, depth: int, checksums: bool) -> TieredModel:
    d = os.path.join(root, name)
    os.makedirs(d)
    os.environ["TIERMEM_NVME_CHECKSUMS"] = "1" if checksums else "0"  # read when the store is made
    try:
        torch.manual_seed(0)
        return TieredModel(LinearStack(width, depth), OptimStateOnNvme(), precision="bf16", nvme_dir=d,
                           optimizer=AdamW(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1))
    finally:
        del os.environ["TIERMEM_NVME_CHECKSUMS"]


def step(tm: TieredModel, x: torch.Tensor) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process) of one ``tm.step()``."""
    tm.backward(tm(x).float().square().mean())
    w0, c0 = time.perf_counter(), time.process_time()
    tm.step()
    return time.perf_counter() - w0, time.process_time() - c0


def hash_seconds(nbytes: int) -> float:
    """Best time of xxh3_64 over ``nbytes`` in memory, in 8 MiB pieces as the I/O threads hash."""
    buf = torch.randn(nbytes // 4).view(torch.uint8).numpy()
    piece, best = 8 << 20, float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for o in range(0, buf.nbytes, piece):
            xxhash.xxh3_64_intdigest(memoryview(buf[o:o + piece]))
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--pairs", type=int, default=8, help="measured pairs of steps (after one warm-up pair)")
    p.add_argument("--dir", default=None, help="directory on the disk to test (default: a temporary one "
                                               "under the current directory, removed afterwards)")
    p.add_argument("--aa", action="store_true", help="A/A: both models without checksums (the spread)")
    args = p.parse_args()
    n = args.width * args.width * args.depth
    root = tempfile.mkdtemp(prefix="tiermem-checksums-", dir=args.dir or os.getcwd())
    print(f"{args.depth} Linear layers of {args.width} x {args.width}: {n / 1e6:.1f}M parameters; a step reads and "
          f"writes {12 * n / GB:.2f} GB of optimizer state each way; {torch.get_num_threads()} CPU threads; load "
          f"average at start {os.getloadavg()[0]:.2f}", flush=True)
    a_name = "no checksums (A/A)" if args.aa else "checksums"
    try:
        tms = {a_name: make(root, "a", args.width, args.depth, not args.aa),
               "no checksums": make(root, "b", args.width, args.depth, False)}
        names = list(tms)
        gen = torch.Generator().manual_seed(0)
        wall = {k: [] for k in tms}
        cpu = {k: [] for k in tms}
        for i in range(args.pairs + 1):
            x = torch.randn(args.rows, args.width, generator=gen)
            order = names if (i + i // 2) % 2 == 0 else names[::-1]  # ABBA BAAB: each goes first as often
            for k in order:
                w, c = step(tms[k], x)
                if i:
                    wall[k].append(w)
                    cpu[k].append(c)
            if i:
                print(f"pair {i}: " + ", ".join(f"{k} {1e3 * wall[k][-1]:.0f} ms (CPU {1e3 * cpu[k][-1]:.0f} ms)"
                                                for k in order) + f"; load average {os.getloadavg()[0]:.2f}",
                      flush=True)
        t0 = time.perf_counter()
        path = os.path.join(root, "ck.tm")
        tms[names[0]].save(path)
        t1 = time.perf_counter()
        tms[names[0]].load(path)
        t2 = time.perf_counter()
        ck_bytes = os.path.getsize(path)
        for tm in tms.values():
            tm.detach()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    hashed = 24 * n  # every state byte hashed once written, once read
    h = hash_seconds(12 * n) * 2
    ratios = [a / b for a, b in zip(wall[names[0]], wall[names[1]])]
    med = statistics.median
    print(f"\nmedian tm.step(): {names[0]} {1e3 * med(wall[names[0]]):.0f} ms (CPU {1e3 * med(cpu[names[0]]):.0f} ms), "
          f"{names[1]} {1e3 * med(wall[names[1]]):.0f} ms (CPU {1e3 * med(cpu[names[1]]):.0f} ms); per-pair ratios "
          + " ".join(f"{r:.2f}" for r in ratios))
    print(f"xxh3_64 over the {hashed / GB:.2f} GB a step hashes, in memory on one core: {1e3 * h:.0f} ms "
          f"({hashed / h / GB:.1f} GB/s)")
    print(f"checkpoint of {ck_bytes / GB:.2f} GB: save {t1 - t0:.2f} s, load (every checksum checked first) "
          f"{t2 - t1:.2f} s")
    print(f"\n{names[0] + ':':<22} tm.step() / no checksums, median of pairs  {med(ratios):.2f}x"
          + ("  (the A/A spread)" if args.aa else "  (target <= 1.05x)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
