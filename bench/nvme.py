"""NvmeStore against fio on the same directory, in one run: new 1 GiB files, interleaved rounds.

    python bench/nvme.py [--size 1GiB] [--rounds 5] [--dir DIR] [--buffers host|torch|scattered] [--overwrite]

Every round writes then reads ``--size`` bytes once with each contender, in alternating order
(forward on even rounds, backward on odd ones) so that drift of a shared disk and of a loaded
machine hits all of them alike:

- fio: libaio, O_DIRECT, 8 MiB blocks, iodepth 8, one job, a new file (fio lays it out with
  fallocate before it starts timing), removed after the round: the anchor;
- tiermem, checksums on: ``NvmeStore`` (O_DIRECT, ``--threads`` I/O threads, 8 MiB blocks), a new
  key written from and read into page-aligned host buffers (``host_buffer``, what the host pool
  hands the engine), deleted after the round; every byte hashed (xxh3_64) on the way out and
  checked on the way in;
- tiermem, checksums off: the same with ``TIERMEM_NVME_CHECKSUMS=0`` (a store of its own in a
  sibling directory, made with the switch set): what the checks cost;
- bare pwritev/preadv: the same bytes from the same buffers in the same 8 MiB blocks with the
  same number of threads, ``os.pwritev``/``os.preadv`` on a new fallocated O_DIRECT file and
  nothing else (no header, no hashing, no bookkeeping): the store's same-bytes floor.

The table gives each row's median and spread (min-max) in GB/s, and the requests the disk saw
per GiB (``/proc/diskstats``, the whole device: other processes' I/O counts too). On a virtual
disk that takes at most a few hundred memory segments per request, a buffer whose pages are
physically contiguous goes out in fewer, larger requests, and that alone moves its throughput by
tens of percent; fio's buffers are laid out by the kernel, not by fio. ``--buffers`` picks the
store's (and the bare loop's) buffers: tiermem's host pool's (``host_buffer``, the default: what
the engine hands the store), plain torch tensors, or 4 KiB pages faulted in a random order, as
memory fragmented by a long run would give them.

Then a second table that no disk disturbs: the store on an emulated device whose throughput
scales with the requests in flight (each data request sleeps ``--emulated-ms`` and moves no
bytes; headers and the file's allocation are real), against the bare loop on the same device and
against the ideal (8 requests always in flight): what the store's own machinery (hashing, the
per-chunk bookkeeping, its threads) costs where the disk would reward every request in flight.

``--overwrite`` adds a key written twice before timing starts (each timed write goes over blocks
its slot file already has, the steady state of optimizer state) and fio overwriting a file it
wrote once before. Ratios come last: the ratio of the medians, and the median of the per-round
ratios (each contender against its anchor in the same round) with their spread.
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for bench._fio

from bench._fio import fio_job
from tiermem.config.budgets import parse_bytes
from tiermem.memory.aligned import ALIGN, aligned_empty, host_buffer, round_up
from tiermem.memory.nvme import NvmeStore

GB = 1e9
FIO = "fio, libaio qd8"
ON, OFF, BARE = "tiermem, checksums on", "tiermem, checksums off", "bare pwritev/preadv"
ON_OVER, FIO_OVER = "tiermem, overwrite", "fio, overwrite"


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- buffers and the disk's request counts ------------------------------------------------------
def make_buffer(size: int, kind: str) -> torch.Tensor:
    """A page-aligned buffer of ``size`` random bytes: ``host``, as tiermem's host pool allocates
    them (``host_buffer``); ``torch``, a plain tensor (``aligned_empty``); ``scattered``, an
    anonymous mapping of 4 KiB pages faulted in a random order, as memory fragmented by a long
    run would give them."""
    if kind == "host":
        buf = host_buffer(size, pin=False)[:size]
    elif kind == "torch":
        buf = aligned_empty(size, pin=False)[:size]
    else:
        buf = torch.frombuffer(mmap.mmap(-1, round_up(size)), dtype=torch.uint8)[:size]  # shared: no huge pages
        pages = list(range(0, size, ALIGN))
        random.Random(0).shuffle(pages)
        for p in pages:
            buf[p] = 1
    buf[: size // 8 * 8].view(torch.int64).random_()
    return buf


class DiskRequests:
    """Reads and writes the disk under ``directory`` completed (``/proc/diskstats``), or None
    where that file or the device is not there."""

    def __init__(self, directory: str):
        st = os.stat(directory)
        self.dev = (os.major(st.st_dev), os.minor(st.st_dev))

    def counts(self) -> Optional[tuple[int, int]]:
        try:
            with open("/proc/diskstats") as f:
                for line in f:
                    x = line.split()
                    if (int(x[0]), int(x[1])) == self.dev:
                        return int(x[3]), int(x[7])
        except (OSError, ValueError, IndexError):
            return None
        return None


# -- the contenders ---------------------------------------------------------------------------
def bench_store(
    store: NvmeStore,
    src: torch.Tensor,
    out: torch.Tensor,
    key: str,
    *,
    keep: bool = False,
    device: Optional["Emulated"] = None,
) -> tuple:
    """Write ``src`` under ``key`` then read it into ``out``; delete the key unless ``keep``.
    On an emulated ``device`` (which moves no bytes, so ``out`` is given ``src``'s first), also
    the mean requests in flight of the write and of the read."""
    w, flight_w = _timed(lambda: store.write(key, src).wait()), _in_flight(device)
    out.copy_(src) if device is not None else out.zero_()
    r, flight_r = _timed(lambda: store.read(key, out).wait()), _in_flight(device)
    assert torch.equal(out, src), "NvmeStore returned different bytes"
    if not keep:
        store.delete(key)
    return (src.numel() / w, src.numel() / r) + ((flight_w, flight_r) if device is not None else ())


def fio(path: str, rw: str, size: int, block: int) -> float:
    return fio_job(path, rw, size=size, block=block, name="tiermem-bench")[rw]["bw_bytes"]


def bench_fio(path: str, size: int, block: int, *, keep: bool = False) -> tuple[float, float]:
    """fio writes then reads ``path``; a missing file is laid out (fallocate) before timing starts.
    The file is removed afterwards unless ``keep``."""
    bw = fio(path, "write", size, block), fio(path, "read", size, block)
    if not keep:
        os.unlink(path)
    return bw


def bench_bare(
    pool: ThreadPoolExecutor,
    path: str,
    src: torch.Tensor,
    out: torch.Tensor,
    block: int,
    device: Optional["Emulated"] = None,
) -> tuple:
    """The same bytes as the store moves, in ``block``-sized pwritev/preadv calls on ``pool``'s
    threads, on a new fallocated O_DIRECT file (the data at offset 4096, as in a slot file); on
    an emulated ``device`` when given, as :func:`bench_store`."""
    size = src.numel()
    src_mv, out_mv = memoryview(src.numpy()), memoryview(out.numpy())
    pwritev = device.pwritev if device is not None else os.pwritev
    preadv = device.preadv if device is not None else os.preadv
    blocks = range(0, size, block)

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        try:
            os.posix_fallocate(fd, 0, ALIGN + size)
            list(pool.map(lambda b: pwritev(fd, [src_mv[b : b + block]], ALIGN + b), blocks))
        finally:
            os.close(fd)

    def read() -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            list(pool.map(lambda b: preadv(fd, [out_mv[b : b + block]], ALIGN + b), blocks))
        finally:
            os.close(fd)

    w, flight_w = _timed(write), _in_flight(device)
    out.copy_(src) if device is not None else out.zero_()
    r, flight_r = _timed(read), _in_flight(device)
    assert torch.equal(out, src), "the bare loop read back different bytes"
    os.unlink(path)
    return (size / w, size / r) + ((flight_w, flight_r) if device is not None else ())


def _in_flight(device: Optional["Emulated"]) -> Optional[float]:
    return device.in_flight() if device is not None else None


# -- the emulated device ----------------------------------------------------------------------
class Emulated:
    """A device whose throughput scales with the requests in flight: a data request (any call
    past the 4096-byte header at offset 0) sleeps ``latency`` seconds and moves no bytes; header
    calls go to the real file, so the store's header checks run. Records each data request's
    start and end, for the mean number in flight."""

    def __init__(self, latency: float):
        self.latency = latency
        self.spans: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def pwritev(self, fd: int, bufs, offset: int) -> int:
        return os.pwritev(fd, bufs, offset) if offset == 0 else self._sleep(bufs)

    def preadv(self, fd: int, bufs, offset: int) -> int:
        if offset != 0:
            return self._sleep(bufs)
        got = os.preadv(fd, bufs[:1], 0)  # the header; a chunk 0 read with it moves no bytes
        return got + sum(memoryview(b).nbytes for b in bufs[1:])

    def _sleep(self, bufs) -> int:
        t0 = time.perf_counter()
        time.sleep(self.latency)
        with self._lock:
            self.spans.append((t0, time.perf_counter()))
        return sum(memoryview(b).nbytes for b in bufs)

    def in_flight(self) -> float:
        """Mean requests in flight between the first request's start and the last one's end."""
        spans, self.spans = self.spans, []
        return sum(b - a for a, b in spans) / (max(b for _, b in spans) - min(a for a, _ in spans))


class EmulatedStore(NvmeStore):
    """``NvmeStore`` whose data requests go to an :class:`Emulated` device (its I/O seams)."""

    device: Emulated

    def _pwritev(self, fd: int, bufs, offset: int) -> int:
        return self.device.pwritev(fd, bufs, offset)

    def _preadv(self, fd: int, bufs, offset: int) -> int:
        return self.device.preadv(fd, bufs, offset)


def make_store(
    directory: str, checksums: bool, threads: int, block: int, device: Optional[Emulated] = None
) -> NvmeStore:
    os.makedirs(directory, exist_ok=True)
    before = os.environ.get("TIERMEM_NVME_CHECKSUMS")
    os.environ["TIERMEM_NVME_CHECKSUMS"] = "1" if checksums else "0"  # read once, when the store is made
    try:
        if device is None:
            return NvmeStore(directory, io_threads=threads, block_size=block, direct=True)
        store = EmulatedStore(directory, io_threads=threads, block_size=block, direct=True)
        store.device = device
        return store
    finally:
        if before is None:
            del os.environ["TIERMEM_NVME_CHECKSUMS"]
        else:
            os.environ["TIERMEM_NVME_CHECKSUMS"] = before


# -- the runs ---------------------------------------------------------------------------------
def interleaved(runs: dict[str, Callable[[], tuple]], rounds: int) -> dict[str, list[tuple]]:
    rows: dict[str, list[tuple]] = {name: [] for name in runs}
    names = list(runs)
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            rows[name].append(runs[name]())
    return rows


def with_requests(disk: DiskRequests, size: int, run: Callable[[], tuple]) -> Callable[[], tuple]:
    """``run``, adding the disk's write and read requests per GiB (None where unknown)."""

    def counted() -> tuple:
        before = disk.counts()
        w, r = run()
        after = disk.counts()
        if before is None or after is None:
            return w, r, None, None
        per_gib = 2**30 / size
        return w, r, (after[1] - before[1]) * per_gib, (after[0] - before[0]) * per_gib

    return counted


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1GiB", help="bytes per transfer (default 1GiB)")
    p.add_argument(
        "--dir",
        default=None,
        help="directory to test (default: a temporary one under the current directory, removed afterwards)",
    )
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--block", default="8MiB", help="block size for NvmeStore, the bare loop and fio (default 8MiB)")
    p.add_argument("--threads", type=int, default=8, help="NvmeStore I/O threads and bare-loop threads (default 8)")
    p.add_argument(
        "--buffers",
        choices=["host", "torch", "scattered"],
        default="host",
        help="the store's and the bare loop's buffers: from tiermem's host pool (default), plain "
        "torch tensors, or 4 KiB pages faulted in a random order",
    )
    p.add_argument(
        "--emulated-ms",
        type=float,
        default=16.0,
        help="latency of one request on the emulated device (default 16: 4.2 GB/s at 8 in flight "
        "of 8 MiB); 0 skips the emulated device",
    )
    p.add_argument("--overwrite", action="store_true", help="also time overwrites (tiermem and fio)")
    args = p.parse_args(argv)
    size, block = parse_bytes(args.size, what="--size"), parse_bytes(args.block, what="--block")
    if shutil.which("fio") is None:
        sys.exit("bench/nvme.py: fio not found on PATH; install it (apt-get install fio): it is the anchor")
    top = args.dir or tempfile.mkdtemp(prefix="tiermem-bench-", dir=os.getcwd())
    directory = os.path.join(top, "nvme-bench")
    os.makedirs(directory, exist_ok=False)
    src, out = make_buffer(size, args.buffers), make_buffer(size, args.buffers)
    load = os.getloadavg()
    pool = ThreadPoolExecutor(args.threads, thread_name_prefix="bare")
    stores: list[NvmeStore] = []
    try:
        disk = DiskRequests(directory)
        on = make_store(os.path.join(directory, "on"), True, args.threads, block)
        off = make_store(os.path.join(directory, "off"), False, args.threads, block)
        stores += [on, off]
        fio_new, fio_old = os.path.join(directory, "fio-new.dat"), os.path.join(directory, "fio-old.dat")
        runs = {
            FIO: lambda: bench_fio(fio_new, size, block),
            ON: lambda: bench_store(on, src, out, "bench.new"),
            OFF: lambda: bench_store(off, src, out, "bench.new"),
            BARE: lambda: bench_bare(pool, os.path.join(directory, "bare.dat"), src, out, block),
        }
        if args.overwrite:
            for _ in range(2):  # both slots of the overwritten key exist before timing starts
                on.write("bench.overwrite", src).wait()
            fio(fio_old, "write", size, block)  # lay out and fill the file fio overwrites
            runs[ON_OVER] = lambda: bench_store(on, src, out, "bench.overwrite", keep=True)
            runs[FIO_OVER] = lambda: bench_fio(fio_old, size, block, keep=True)
        disk_rows = interleaved({k: with_requests(disk, size, run) for k, run in runs.items()}, args.rounds)
        emulated_rows = None
        if args.emulated_ms > 0:
            device = Emulated(args.emulated_ms / 1e3)
            e_on = make_store(os.path.join(directory, "emulated-on"), True, args.threads, block, device)
            e_off = make_store(os.path.join(directory, "emulated-off"), False, args.threads, block, device)
            stores += [e_on, e_off]
            e_runs = {
                ON: lambda: bench_store(e_on, src, out, "bench.new", device=device),
                OFF: lambda: bench_store(e_off, src, out, "bench.new", device=device),
                BARE: lambda: bench_bare(pool, os.path.join(directory, "bare.dat"), src, out, block, device),
            }
            emulated_rows = interleaved(e_runs, args.rounds)
    finally:
        for store in stores:
            store.close()
        pool.shutdown()
        shutil.rmtree(directory if args.dir else top, ignore_errors=True)
    report(disk_rows, emulated_rows, size, block, args, top, load)


# -- the report -------------------------------------------------------------------------------
def _spread(xs: list[float], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(xs) / scale)} [{fmt.format(min(xs) / scale)}-{fmt.format(max(xs) / scale)}]"


def _ratios(rows: dict[str, list[tuple]], pairs: list[tuple[str, str]], label: str) -> None:
    for a, b in pairs:
        for d, what in ((0, "write"), (1, "read")):
            med = statistics.median(x[d] for x in rows[a]) / statistics.median(x[d] for x in rows[b])
            per_round = [x[d] / y[d] for x, y in zip(rows[a], rows[b])]
            print(f"  {label}{what:5s} {a} / {b}: {med:.2f}x; per round {_spread(per_round, fmt='{:.2f}x')}")


def report(
    disk_rows: dict[str, list[tuple]],
    emulated_rows: Optional[dict[str, list[tuple]]],
    size: int,
    block: int,
    args,
    top: str,
    load: tuple,
) -> None:
    print(
        f"{size / 2**30:.2f} GiB per transfer, new files, {args.rounds} interleaved rounds, {args.threads} store "
        f"threads, {block / 2**20:g} MiB blocks, {args.buffers} buffers, directory {top}; load average "
        f"{load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end, on {os.cpu_count()} cores"
    )
    print(f"{'disk, GB/s median [min-max]':28s} {'write':>18s} {'read':>18s} {'requests/GiB w, r':>18s}")
    for name, runs in disk_rows.items():
        reqs = (
            "?"
            if runs[0][2] is None
            else f"{statistics.median(x[2] for x in runs):.0f}, {statistics.median(x[3] for x in runs):.0f}"
        )
        print(
            f"{name:28s} {_spread([x[0] for x in runs], GB):>18s} {_spread([x[1] for x in runs], GB):>18s} {reqs:>18s}"
        )
    print(
        "note: every contender uses O_DIRECT (no page cache); fio's figure excludes its file layout, the "
        "store's includes its own (open, fallocate, header, close)"
    )
    if emulated_rows is not None:
        ideal = args.threads * block / (args.emulated_ms / 1e3)
        print(
            f"{'emulated device, GB/s':28s} {'write':>18s} {'read':>18s} {'in flight w, r':>18s}"
            f"   ({args.emulated_ms:g} ms per request: {ideal / GB:.2f} GB/s with {args.threads} always in flight)"
        )
        for name, runs in emulated_rows.items():
            flights = f"{statistics.median(x[2] for x in runs):.2f}, {statistics.median(x[3] for x in runs):.2f}"
            print(
                f"{name:28s} {_spread([x[0] for x in runs], GB):>18s} {_spread([x[1] for x in runs], GB):>18s} "
                f"{flights:>18s}"
            )
    print("ratios (ratio of medians; median of the per-round ratios [min-max]):")
    pairs = [(BARE, FIO), (OFF, FIO), (ON, OFF), (ON, BARE)]
    if ON_OVER in disk_rows:
        pairs.append((ON_OVER, FIO_OVER))
    _ratios(disk_rows, pairs, "disk:     ")
    if emulated_rows is not None:
        _ratios(emulated_rows, [(ON, OFF), (OFF, BARE), (ON, BARE)], "emulated: ")
    _ratios(disk_rows, [(ON, FIO)], "disk:     ")


if __name__ == "__main__":
    sys.exit(main())
