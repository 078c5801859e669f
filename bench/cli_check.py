"""Does `tiermem bench` measure what independent tools measure? One run, side by side:

- its NVMe figures (the bench's own measurement: NvmeStore, O_DIRECT) against fio at the same
  block size, requests in flight (libaio iodepth), bytes and access pattern, on the same directory;
- its host copy figure against a plain torch ``copy_`` timing loop on the same size.

A third NVMe column, the store's syscalls made bare from a thread pool, tells a bench that
measures wrong apart from a store that is slower than the disk allows.

Disks (virtual ones above all) drift by tens of percent within a minute, so the two sides are
interleaved point by point, in alternating order, over several rounds, and their medians compared.
Target: every ratio within 10% of 1.

    python bench/cli_check.py            # the sizes and sweep of `tiermem bench --quick`
    python bench/cli_check.py --full     # the full bench's (several minutes)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from tiermem.cli import measure
from tiermem.cli.bench import FULL, QUICK

MiB = 2**20


def fio(path: str, rw: str, *, size: int, block: int, depth: int) -> float:
    """Bytes/s fio reaches for one sequential direct ``rw`` pass of ``size`` bytes over ``path``."""
    cmd = ["fio", "--name=cli-check", f"--filename={path}", f"--rw={rw}", f"--bs={block}", f"--size={size}",
           "--direct=1", "--ioengine=libaio", f"--iodepth={depth}", "--numjobs=1", "--output-format=json"]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return float(json.loads(res.stdout)["jobs"][0][rw]["bw_bytes"])


def fio_point(directory: str, *, size: int, block: int, depth: int, repeats: int) -> tuple[float, float]:
    """fio in the access pattern the bench gives NvmeStore: every write goes to a fresh file that
    replaces the previous one (the store writes a new file and renames it over the old), then the
    last file is read ``repeats`` times; a warm-up pass first, medians, as the bench does."""
    writes, reads, last = [], [], None
    for i in range(repeats + 1):
        path = os.path.join(directory, f"fio-{i}.dat")
        bw = fio(path, "write", size=size, block=block, depth=depth)
        writes += [bw] if i else []
        if last is not None:
            os.unlink(last)
        last = path
    for i in range(repeats + 1):
        bw = fio(last, "read", size=size, block=block, depth=depth)
        reads += [bw] if i else []
    os.unlink(last)
    return statistics.median(writes), statistics.median(reads)


def raw_point(directory: str, src: torch.Tensor, out: torch.Tensor, *, block: int, depth: int,
              repeats: int) -> tuple[float, float]:
    """A third opinion: the syscalls NvmeStore makes, bare (a pool of ``depth`` threads, O_DIRECT
    pwritev/preadv of ``block`` bytes, a fresh fallocated file renamed over the previous one), in
    the bench's pattern. Tells "the bench measures wrong" apart from "the store is slower"."""
    nbytes, view_src, view_out = src.numel(), memoryview(src.numpy()), memoryview(out.numpy())
    final, part = os.path.join(directory, "raw.dat"), os.path.join(directory, "raw.part")
    offsets = range(0, nbytes, block)
    writes, reads = [], []
    with ThreadPoolExecutor(depth) as pool:
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            os.posix_fallocate(fd, 0, nbytes)
            list(pool.map(lambda o: os.pwritev(fd, [view_src[o:o + block]], o), offsets))
            os.close(fd)
            os.replace(part, final)
            writes += [nbytes / (time.perf_counter() - t0)] if i else []
        fd = os.open(final, os.O_RDONLY | os.O_DIRECT)
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            list(pool.map(lambda o: os.preadv(fd, [view_out[o:o + block]], o), offsets))
            reads += [nbytes / (time.perf_counter() - t0)] if i else []
        os.close(fd)
    os.unlink(final)
    return statistics.median(writes), statistics.median(reads)


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
    ours: dict = {p: ([], []) for p in points}
    theirs: dict = {p: ([], []) for p in points}
    bare: dict = {p: ([], []) for p in points}
    direct = set()
    work = tempfile.mkdtemp(prefix=".cli-check-", dir=args.dir)
    try:
        size = max(s.copy_bytes, s.nvme_bytes)
        a, b = measure.filled(size), measure.filled(size)  # the bench shares two buffers the same way
        for rnd in range(args.rounds):
            print(f"round {rnd + 1}/{args.rounds} ...", file=sys.stderr)
            for (block, depth) in points:
                def bench() -> None:
                    pt = measure.nvme_point(work, a[:s.nvme_bytes], b[:s.nvme_bytes], block_size=block,
                                            in_flight=depth, direct=True, **kw)
                    direct.add(pt.direct)
                    ours[(block, depth)][0].append(pt.write.median)
                    ours[(block, depth)][1].append(pt.read.median)

                def anchor() -> None:
                    w, r = fio_point(work, size=s.nvme_bytes, block=block, depth=depth, repeats=s.repeats)
                    theirs[(block, depth)][0].append(w)
                    theirs[(block, depth)][1].append(r)
                def syscalls() -> None:
                    w, r = raw_point(work, a[:s.nvme_bytes], b[:s.nvme_bytes], block=block, depth=depth,
                                     repeats=s.repeats)
                    bare[(block, depth)][0].append(w)
                    bare[(block, depth)][1].append(r)
                for step in ((bench, anchor, syscalls) if rnd % 2 == 0 else (syscalls, anchor, bench)):
                    step()
        host_ours, host_theirs = [], []
        for rnd in range(args.rounds * 2):
            x, y = a[:s.copy_bytes], b[:s.copy_bytes]
            sides = [lambda: host_ours.append(measure.host_copy(x, y, **kw).median),
                     lambda: host_theirs.append(torch_copy(x, y, repeats=s.repeats, seconds=0.3))]
            for side in (sides if rnd % 2 == 0 else sides[::-1]):
                side()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = statistics.median
    print(f"tiermem bench{'' if args.full else ' --quick'}'s measurements against independent tools, one run: "
          f"{args.rounds} interleaved rounds, medians; {s.nvme_bytes // MiB} MiB per NVMe pass "
          f"(NvmeStore direct I/O: {sorted(direct)}; fio libaio O_DIRECT, fresh file per write)")
    ratios = []
    for (block, depth) in points:
        for i, op in enumerate(("write", "read")):
            o, t = med(ours[(block, depth)][i]) / 1e9, med(theirs[(block, depth)][i]) / 1e9
            raw = med(bare[(block, depth)][i]) / 1e9
            print(f"  nvme {op:5s} {block // MiB:2d} MiB x {depth:2d} in flight   tiermem bench {o:5.2f} GB/s   "
                  f"fio {t:5.2f} GB/s   bare syscalls {raw:5.2f} GB/s")
            ratios.append((f"nvme {op} {block // MiB} MiB x {depth} in flight: tiermem bench / fio", o / t))
            ratios.append((f"nvme {op} {block // MiB} MiB x {depth} in flight: tiermem bench / bare syscalls",
                           o / raw))
    o, t = med(host_ours) / 1e9, med(host_theirs) / 1e9
    print(f"  host copy {s.copy_bytes // MiB} MiB                tiermem bench {o:5.2f} GB/s   "
          f"torch copy_ {t:5.2f} GB/s")
    ratios.append((f"host copy {s.copy_bytes // MiB} MiB: tiermem bench / torch copy_", o / t))
    print("ratios (target: within 10% of 1.00)")
    for label, r in ratios:
        print(f"  {label:68s} {r:5.2f}  {'ok' if abs(r - 1) <= 0.10 else 'OFF'}")


if __name__ == "__main__":
    main()
