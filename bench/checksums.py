"""What checksums cost: the state-on-NVMe step with and without its data checksums, in one run.

    python bench/checksums.py [--width 2048] [--depth 12] [--rows 128] [--rounds 8] [--aa] [--dir DIR]

One model (examples/nvme_offload.py's policy: weights on the device tier, grads on the host, the
optimizer state streamed from NVMe through the three-stage pipeline) trains with its NVMe
store's data checksums (NOTE [Data checksums]) switched on and off between steps, a benchmark's
lever on the store (``store.checksums``; users have only ``TIERMEM_NVME_CHECKSUMS=0``). A step
reads what the step before it wrote, so steps come in pairs with one setting and only the second
of a pair is measured: with checksums on, it verifies every byte it reads and hashes every byte
it writes; off, neither. One model, not two: on this machine two identical models in one process
step at different speeds (four in a row, built one after the other: 428, 334, 304 and 275 ms a
step), which no order of stepping them cancels. The pairs go on, off, off, on, ... so both settings
take every place in time; a round's figure is its on-step over its off-step, the result the
median over rounds. ``--aa`` keeps checksums off throughout: the spread the design leaves.
Beside the wall times: the CPU time of the process during each step (``time.process_time``,
every thread), whose difference is the hashing itself.

Also measured in the same run, for the same bytes: xxh3_64 over the state's bytes in memory (what
hashing alone costs on one core) and a checkpoint ``tm.save`` + load of the model. Ratios come last.
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

from bench.nvme_step import LinearStack
from examples.nvme_offload import OptimStateOnNvme
from tiermem import AdamW, Tier, TieredModel
from tiermem.memory.nvme import NvmeStore

GB = 1e9


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
            xxhash.xxh3_64_intdigest(memoryview(buf[o : o + piece]))
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--rounds", type=int, default=8, help="measured rounds (an on pair and an off pair each)")
    p.add_argument(
        "--dir",
        default=None,
        help="directory on the disk to test (default: a temporary one under the current directory, removed afterwards)",
    )
    p.add_argument("--aa", action="store_true", help="A/A: checksums off in both halves (the design's spread)")
    args = p.parse_args()
    n = args.width * args.width * args.depth
    root = tempfile.mkdtemp(prefix="tiermem-checksums-", dir=args.dir or os.getcwd())
    print(
        f"{args.depth} Linear layers of {args.width} x {args.width}: {n / 1e6:.1f}M parameters; a step reads and "
        f"writes {12 * n / GB:.2f} GB of optimizer state each way; {torch.get_num_threads()} CPU threads; load "
        f"average at start {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    label = "off (A/A)" if args.aa else "on"
    wall: dict[str, list[float]] = {label: [], "off": []}
    cpu: dict[str, list[float]] = {label: [], "off": []}
    try:
        torch.manual_seed(0)
        tm = TieredModel(
            LinearStack(args.width, args.depth),
            OptimStateOnNvme(),
            precision="bf16",
            nvme_dir=root,
            optimizer=AdamW(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1),
        )
        store = tm.stores[Tier.NVME]
        assert isinstance(store, NvmeStore) and store.checksums
        gen = torch.Generator().manual_seed(0)
        for _ in range(2):  # warm-up: the trace, the compiled Adam
            step(tm, torch.randn(args.rows, args.width, generator=gen))
        for r in range(args.rounds):
            order = [label, "off"] if r % 2 == 0 else ["off", label]
            for setting in order:
                store.checksums = setting == "on"
                step(tm, torch.randn(args.rows, args.width, generator=gen))  # writes with the setting
                w, c = step(tm, torch.randn(args.rows, args.width, generator=gen))  # reads and writes with it
                wall[setting].append(w)
                cpu[setting].append(c)
            print(
                f"round {r + 1}: "
                + ", ".join(f"{s} {1e3 * wall[s][-1]:.0f} ms (CPU {1e3 * cpu[s][-1]:.0f} ms)" for s in order)
                + f"; load average {os.getloadavg()[0]:.2f}",
                flush=True,
            )
        store.checksums = True
        step(tm, torch.randn(args.rows, args.width, generator=gen))
        path = os.path.join(root, "ck.tm")
        t0 = time.perf_counter()
        tm.save(path)
        t1 = time.perf_counter()
        tm.load(path)
        t2 = time.perf_counter()
        ck_bytes = os.path.getsize(path)
        tm.detach()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    hashed = 24 * n  # every state byte hashed once written, once read
    h = hash_seconds(12 * n) * 2
    med = statistics.median
    ratios = [a / b for a, b in zip(wall[label], wall["off"])]
    print(
        f"\nmedian tm.step(): checksums {label} {1e3 * med(wall[label]):.0f} ms (CPU {1e3 * med(cpu[label]):.0f} ms), "
        f"off {1e3 * med(wall['off']):.0f} ms (CPU {1e3 * med(cpu['off']):.0f} ms); per-round ratios "
        + " ".join(f"{r:.2f}" for r in ratios)
    )
    print(
        f"xxh3_64 over the {hashed / GB:.2f} GB a step hashes, in memory on one core: {1e3 * h:.0f} ms "
        f"({hashed / h / GB:.1f} GB/s); the step's CPU time grew by {1e3 * (med(cpu[label]) - med(cpu['off'])):.0f} ms"
    )
    print(
        f"checkpoint of {ck_bytes / GB:.2f} GB: save {t1 - t0:.2f} s, load (every checksum checked first) "
        f"{t2 - t1:.2f} s"
    )
    print(
        f"\nchecksums {label + ':':<11} tm.step() / checksums off, median of rounds  {med(ratios):.2f}x"
        + ("  (the A/A spread)" if args.aa else "  (target <= 1.05x)")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
