"""Does `tiermem bench` measure what independent tools measure? One run, side by side:

- its NVMe figures (the bench's own measurement: NvmeStore, O_DIRECT) against fio at the same
  block size, requests in flight (libaio iodepth), bytes and access pattern, on the same directory.
  The bench's write figure is an overwrite: NvmeStore keeps a key's two slot files and writes over
  the older in place, so fio overwrites two files laid out beforehand, in turn, with no truncate or
  allocation in the timed pass. A key's first write (fresh files) is compared too, labelled apart;
- its host copy figure against a plain torch ``copy_`` timing loop on the same size.

A third NVMe column, the store's syscalls made bare from a thread pool, tells a bench that
measures wrong apart from a store that is slower than the disk allows.

Disks (virtual ones above all) drift by tens of percent within a minute, so the three sides are
interleaved point by point, in alternating order, over several rounds, and their medians compared.
Target: every ratio within 10% of 1.

    python bench/cli_check.py            # the sizes and sweep of `tiermem bench --quick`
    python bench/cli_check.py --full     # the full bench's (several minutes)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for bench._fio

from bench._fio import fio_job
from tiermem.cli import measure
from tiermem.cli.bench import FULL, QUICK
from tiermem.memory import nvme_layout as layout

MiB = 2**20


HEADER = layout.HEADER  # NvmeStore puts the tensor's bytes after a header block: so do the anchors
PATTERNS = ("overwrite", "first write", "read")  # overwrite: the steady state a training step sees


def fio(paths: list[str], rw: str, *, size: int, block: int, depth: int, fresh: bool = False) -> float:
    """Bytes/s of one fio pass per path (run in turn, so each is one store write or read):
    sequential O_DIRECT libaio ``rw`` of ``size`` bytes at offset ``HEADER``, ``depth`` requests in
    flight. Rather than ``fresh`` files (allocated as written, as the store's first write of a key
    does), a write overwrites files laid out before the clock starts (``--overwrite=1``) and
    allocates nothing (``--fallocate=none``), as the store's overwrite of a key does."""
    rates = []
    for path in paths:
        extra = [f"--offset={HEADER}"]
        if rw == "write":
            extra += ["--fallocate=native"] if fresh else ["--overwrite=1", "--fallocate=none"]
        job = fio_job(path, rw, size=size, block=block, name="cli-check", iodepth=depth, extra=extra)
        rates.append(float(job[rw]["bw_bytes"]))
    return statistics.median(rates)


def slot_paths(directory: str, tag: str) -> list[str]:
    return [os.path.join(directory, f"{tag}.{slot}.dat") for slot in (0, 1)]


def remove(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def fio_point(directory: str, *, size: int, block: int, depth: int, repeats: int) -> dict[str, float]:
    """fio in the bench's access pattern, bytes/s per pattern (medians, after a warm-up pass):
    overwrite: two files laid out once, overwritten in turn in place (the store's two slots);
    first write: a fresh file each pass, the previous one removed outside the clock;
    read: the last file written, read again and again."""
    slots = slot_paths(directory, "fio")
    passes = [slots[i % 2] for i in range(2 * repeats + 1)]
    fio(slots, "write", size=size, block=block, depth=depth)  # lays both out: the warm-up
    over = fio(passes[1:], "write", size=size, block=block, depth=depth)
    remove(slots)
    firsts = []
    for i in range(repeats + 1):
        remove(slots[:1])
        rate = fio(slots[:1], "write", size=size, block=block, depth=depth, fresh=True)
        firsts += [rate] if i else []
    reads = [fio(slots[:1], "read", size=size, block=block, depth=depth) for _ in range(repeats + 1)][1:]
    remove(slots)
    return {"overwrite": over, "first write": statistics.median(firsts), "read": statistics.median(reads)}


def raw_point(
    directory: str, src: torch.Tensor, out: torch.Tensor, *, block: int, depth: int, repeats: int
) -> dict[str, float]:
    """A third opinion: the syscalls NvmeStore makes, bare (a pool of ``depth`` threads, O_DIRECT
    pwritev/preadv of ``block`` bytes at ``HEADER`` on, the file opened and closed in each pass),
    in fio_point's patterns. Tells "the bench measures wrong" apart from "the store is slower"."""
    nbytes, view_src, view_out = src.numel(), memoryview(src.numpy()), memoryview(out.numpy())
    offsets = range(0, nbytes, block)
    slots = slot_paths(directory, "raw")

    def write(path: str, fresh: bool) -> float:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        if fresh:
            os.posix_fallocate(fd, 0, HEADER + nbytes)
        list(pool.map(lambda o: os.pwritev(fd, [view_src[o : o + block]], HEADER + o), offsets))
        os.close(fd)
        return nbytes / (time.perf_counter() - t0)

    def read(path: str) -> float:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        list(pool.map(lambda o: os.preadv(fd, [view_out[o : o + block]], HEADER + o), offsets))
        os.close(fd)
        return nbytes / (time.perf_counter() - t0)

    with ThreadPoolExecutor(depth) as pool:
        for path in slots:  # laid out once, outside the clock
            write(path, fresh=True)
        over = [write(slots[i % 2], fresh=False) for i in range(2 * repeats + 1)][1:]
        firsts = []
        for i in range(repeats + 1):
            remove(slots[:1])
            rate = write(slots[0], fresh=True)
            firsts += [rate] if i else []
        reads = [read(slots[0]) for _ in range(repeats + 1)][1:]
    remove(slots)
    med = statistics.median
    return {"overwrite": med(over), "first write": med(firsts), "read": med(reads)}


def torch_copy(src: torch.Tensor, dst: torch.Tensor, *, repeats: int, seconds: float) -> float:
    """Bytes/s of a bare ``dst.copy_(src)`` loop: the anchor for the bench's host copy."""
    nbytes = src.numel()
    dst.copy_(src)
    t0 = time.perf_counter()
    dst.copy_(src)
    calls = max(1, int(seconds / (time.perf_counter() - t0)))
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            dst.copy_(src)
        rates.append(nbytes * calls / (time.perf_counter() - t0))
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="the full bench's sizes and sweep instead of --quick's")
    ap.add_argument("--dir", default=".", help="directory on the disk to measure (default: .)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per point (default: 3)")
    args = ap.parse_args()
    if shutil.which("fio") is None:
        sys.exit("cli_check: fio is not installed (apt-get install fio); it is the NVMe anchor")
    s = FULL if args.full else QUICK
    points = [(b, q) for b in s.block_sizes for q in s.in_flight]
    kw = dict(repeats=s.repeats, min_seconds=s.min_seconds)
    # side -> (block, depth) -> pattern -> one figure per round
    figs: dict = {side: {p: {pat: [] for pat in PATTERNS} for p in points} for side in ("bench", "fio", "bare")}
    direct = set()
    load = os.getloadavg()
    work = tempfile.mkdtemp(prefix=".cli-check-", dir=args.dir)
    try:
        size = max(s.copy_bytes, s.nvme_bytes)
        a, b = measure.filled(size), measure.filled(size)  # the bench shares two buffers the same way
        src, out = a[: s.nvme_bytes], b[: s.nvme_bytes]
        for rnd in range(args.rounds):
            print(f"round {rnd + 1}/{args.rounds} ...", file=sys.stderr)
            for block, depth in points:

                def bench() -> dict[str, float]:
                    pt = measure.nvme_point(
                        work, src, out, block_size=block, in_flight=depth, direct=True, first_write=True, **kw
                    )
                    direct.add(pt.direct)
                    return {"overwrite": pt.write.median, "first write": pt.first_write.median, "read": pt.read.median}

                sides = {
                    "bench": bench,
                    "fio": lambda: fio_point(work, size=s.nvme_bytes, block=block, depth=depth, repeats=s.repeats),
                    "bare": lambda: raw_point(work, src, out, block=block, depth=depth, repeats=s.repeats),
                }
                for side in list(sides) if rnd % 2 == 0 else list(sides)[::-1]:
                    for pat, rate in sides[side]().items():
                        figs[side][(block, depth)][pat].append(rate)
        host_ours, host_theirs = [], []
        for rnd in range(args.rounds * 2):
            x, y = a[: s.copy_bytes], b[: s.copy_bytes]
            copies = [
                lambda: host_ours.append(measure.host_copy(x, y, **kw).median),
                lambda: host_theirs.append(torch_copy(x, y, repeats=s.repeats, seconds=0.3)),
            ]
            for copy in copies if rnd % 2 == 0 else copies[::-1]:
                copy()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = statistics.median
    print(
        f"tiermem bench{'' if args.full else ' --quick'}'s measurements against independent tools, one run: "
        f"{args.rounds} interleaved rounds, medians; {s.nvme_bytes // MiB} MiB per NVMe pass at offset "
        f"{HEADER} (NvmeStore direct I/O: {sorted(direct)}; fio libaio O_DIRECT); load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start"
    )
    print(
        "  overwrite: a file laid out before the clock, written over in place, two files in turn (the "
        "bench's write figure); first write: a fresh file each time (the bench's first write of a key)"
    )
    ratios = []
    for block, depth in points:
        for pat in PATTERNS:
            o, t, raw = (med(figs[side][(block, depth)][pat]) / 1e9 for side in ("bench", "fio", "bare"))
            print(
                f"  nvme {pat:11s} {block // MiB:2d} MiB x {depth:2d} in flight   tiermem {o:5.2f} GB/s   "
                f"fio {t:5.2f} GB/s   bare syscalls {raw:5.2f} GB/s"
            )
            what = f"nvme {pat} {block // MiB} MiB x {depth} in flight: tiermem"
            ratios.append((f"{what} / fio", o / t))
            ratios.append((f"{what} / bare syscalls", o / raw))
    o, t = med(host_ours) / 1e9, med(host_theirs) / 1e9
    print(
        f"  host copy {s.copy_bytes // MiB} MiB                  tiermem bench {o:5.2f} GB/s   "
        f"torch copy_ {t:5.2f} GB/s"
    )
    ratios.append((f"host copy {s.copy_bytes // MiB} MiB: tiermem bench / torch copy_", o / t))
    print("ratios (target: within 10% of 1.00)")
    for label, r in ratios:
        print(f"  {label:62s} {r:5.2f}  {'ok' if abs(r - 1) <= 0.10 else 'OFF'}")


if __name__ == "__main__":
    main()
