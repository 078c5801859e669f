"""The measurements behind ``tiermem bench``, one function per tier, each returning :class:`Rate`.

NOTE [Stable figures]
A figure is the median over ``repeats`` samples; a sample times enough back-to-back calls to last
at least ``min_seconds`` (calibrated on a warm-up call), so timer resolution and one-off hiccups do
not decide it. The coefficient of variation over the samples says how much to trust it: above
``NOISY_CV`` the figure is flagged. Anything that must not be timed (dropping the page cache before
a buffered read) runs in ``prepare`` between calls, outside the clock.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from tiermem.memory.aligned import aligned_empty

logger = logging.getLogger(__name__)

NOISY_CV = 0.10


@dataclass(frozen=True)
class Rate:
    """Units per second, one sample per repeat (bytes/s for bandwidths, params/s for Adam)."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def cv(self) -> float:
        """Coefficient of variation (stdev / mean) of the samples; 0 for a single sample."""
        if len(self.samples) < 2:
            return 0.0
        return statistics.stdev(self.samples) / statistics.fmean(self.samples)

    @property
    def noisy(self) -> bool:
        return self.cv > NOISY_CV


def measure(
    fn: Callable[[], object],
    units: float,
    *,
    repeats: int,
    min_seconds: float,
    prepare: Optional[Callable[[], object]] = None,
) -> Rate:
    """Time ``fn`` (which moves ``units`` per call) as NOTE [Stable figures] says."""
    if prepare is not None:
        prepare()
    t0 = time.perf_counter()
    fn()  # warm-up: first-touch page faults, thread pools, lazy allocations
    first = time.perf_counter() - t0
    calls = max(1, math.ceil(min_seconds / max(first, 1e-6)))
    samples = []
    for _ in range(repeats):
        elapsed = 0.0
        for _ in range(calls):
            if prepare is not None:
                prepare()
            t0 = time.perf_counter()
            fn()
            elapsed += time.perf_counter() - t0
        samples.append(units * calls / elapsed)
    return Rate(tuple(samples))


def filled(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """Page-aligned bytes holding a random pattern, every page touched. First touch is slow on
    some machines (VMs back memory lazily), so bench allocates these once and passes them around."""
    buf = aligned_empty(nbytes, pin=pin)[:nbytes]
    block = torch.randint(
        0, 256, (min(nbytes, 2**20),), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes)
    )
    whole = nbytes // block.numel() * block.numel()
    buf[:whole].view(-1, block.numel()).copy_(block)  # random bytes: nothing on the way can compress them
    buf[whole:].copy_(block[: nbytes - whole])
    return buf


# -- HOST ---------------------------------------------------------------------------------------
def host_copy(src: torch.Tensor, dst: torch.Tensor, *, repeats: int, min_seconds: float) -> Rate:
    """Bytes per second that ``dst.copy_(src)`` moves between two host buffers."""
    return measure(lambda: dst.copy_(src), src.numel() * src.element_size(), repeats=repeats, min_seconds=min_seconds)


def host_copy_pair(a: torch.Tensor, b: torch.Tensor, *, repeats: int, min_seconds: float) -> Rate:
    """Two copies at once on two threads, first half of ``a`` into ``b`` and second half of ``b``
    into ``a`` (both directions at once, without an accelerator: what the engine's two CPU lanes
    do); bytes per second of both together."""
    half = a.numel() // 2
    with ThreadPoolExecutor(2, thread_name_prefix="tiermem-bench") as pool:

        def both() -> None:
            x = pool.submit(b[:half].copy_, a[:half])
            y = pool.submit(a[half : 2 * half].copy_, b[half : 2 * half])
            x.result(), y.result()

        return measure(both, 2 * half * a.element_size(), repeats=repeats, min_seconds=min_seconds)


# -- DEVICE <-> HOST (CUDA) -----------------------------------------------------------------------
def device_copies(host_a: torch.Tensor, host_b: torch.Tensor, *, repeats: int, min_seconds: float) -> dict[str, Rate]:
    """HOST->DEVICE, DEVICE->HOST and both at once (two streams) between two host buffers of one
    size (pinned or pageable: the caller's choice) and the first CUDA device."""
    assert torch.cuda.is_available()
    nbytes = host_a.numel()
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    up, down = torch.cuda.Stream(), torch.cuda.Stream()

    def h2d() -> None:
        dev_a.copy_(host_a, non_blocking=True)
        torch.cuda.synchronize()

    def d2h() -> None:
        host_a.copy_(dev_a, non_blocking=True)
        torch.cuda.synchronize()

    def both() -> None:
        with torch.cuda.stream(up):  # the two directions on their own streams, so they overlap
            dev_a.copy_(host_a, non_blocking=True)
        with torch.cuda.stream(down):
            host_b.copy_(dev_b, non_blocking=True)
        torch.cuda.synchronize()

    kw: dict[str, Any] = dict(repeats=repeats, min_seconds=min_seconds)
    return {
        "h2d": measure(h2d, nbytes, **kw),
        "d2h": measure(d2h, nbytes, **kw),
        "bidir": measure(both, 2 * nbytes, **kw),
    }


# -- NVME -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NvmePoint:
    block_size: int
    in_flight: int
    direct: bool  # what the store actually used (it falls back where O_DIRECT is refused)
    write: Rate  # overwrites of a key written before: the steady state of training
    read: Rate
    first_write: Optional[Rate] = None  # writes of a key new to the store (asked for by first_write=True)


def _drop_cached(directory: str) -> None:
    """Push a directory's files out of the page cache (written back first), so a buffered read
    comes from the disk. Needs no privileges: POSIX_FADV_DONTNEED on clean pages."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # a file the store just renamed away
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def nvme_point(
    directory: str,
    src: torch.Tensor,
    out: torch.Tensor,
    *,
    block_size: int,
    in_flight: int,
    direct: bool,
    repeats: int,
    min_seconds: float,
    first_write: bool = False,
) -> NvmePoint:
    """Write ``src`` then read it into ``out`` (page-aligned uint8 buffers of one size) through an
    NvmeStore with ``in_flight`` I/O threads and ``block_size`` chunks. A buffered read starts from
    a cold page cache each time.

    The write figure times overwrites of a key already written twice, so both of its slot files
    are on disk and every timed write goes over one in place (what a training step does to its
    optimizer state). ``first_write`` also times writes of a key new to the store (fresh files,
    allocated as they are written), its files removed outside the clock before each."""
    from tiermem.memory.nvme import NvmeStore  # imported late: `tiermem plan` does not need it

    nbytes = src.numel()
    out.zero_()
    store = NvmeStore(directory, io_threads=in_flight, block_size=block_size, direct=None if direct else False)
    try:
        kw: dict[str, Any] = dict(repeats=repeats, min_seconds=min_seconds)

        def write() -> None:
            store.write("bench", src).wait()

        first = measure(write, nbytes, prepare=lambda: store.delete("bench"), **kw) if first_write else None
        write()
        write()  # both slots laid out: the warm-up and every timed write below are overwrites
        over = measure(write, nbytes, **kw)
        drop = None if store.direct else (lambda: _drop_cached(directory))
        read = measure(lambda: store.read("bench", out).wait(), nbytes, prepare=drop, **kw)
        assert torch.equal(src, out), "NvmeStore returned different bytes"
        return NvmePoint(block_size, in_flight, bool(store.direct), over, read, first)
    finally:
        store.delete("bench")
        store.close()


# -- CPU Adam ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdamRates:
    tiermem: Rate  # params/s of tiermem.optim.adam_step, bf16 grad in, bf16 weights out
    torch_fused: Rate  # params/s of torch.optim.AdamW(fused=True), fp32
    compile_seconds: float  # building (or loading from the cache) tiermem's kernel, before timing
    implementation: str


def adam(n: int, *, repeats: int, min_seconds: float) -> AdamRates:
    """Gparam/s of tiermem's CPU Adam as TieredModel calls it (bf16 grad in, bf16 weights out; the
    finite check is left to the grad norm TieredModel computes anyway) next to torch's fused AdamW."""
    from tiermem import optim  # imported late: it may compile kernels

    t0 = time.perf_counter()
    optim.warm_up()  # compile now, so the timed calls measure the kernel, not the compiler
    compile_seconds = time.perf_counter() - t0
    impl = optim.implementation()
    hp: dict[str, Any] = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    ours = _tiermem_adam(n, gen, hp, repeats=repeats, min_seconds=min_seconds)  # its buffers go on return

    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    p.grad = torch.randn(n, generator=gen) * 1e-3
    opt = torch.optim.AdamW(
        [p], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"], weight_decay=hp["weight_decay"], fused=True
    )
    theirs = measure(opt.step, n, repeats=repeats, min_seconds=min_seconds)
    return AdamRates(ours, theirs, compile_seconds, impl)


def _tiermem_adam(n: int, gen: torch.Generator, hp: dict[str, Any], *, repeats: int, min_seconds: float) -> Rate:
    """Parameters/s of ``adam_step`` with bf16 grads in and bf16 weights out (its buffers are this call's)."""
    from tiermem import optim

    master = torch.randn(n, generator=gen)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    grad = (torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    step = [0]

    def tiermem_step() -> None:
        step[0] += 1
        optim.adam_step(master, exp_avg, exp_avg_sq, grad, step=step[0], adamw=True, out=out, check_finite=False, **hp)

    return measure(tiermem_step, n, repeats=repeats, min_seconds=min_seconds)


def device_adam(n: int, *, repeats: int, min_seconds: float) -> Rate:
    """Parameters/s of ``adam_step`` on the accelerator as the split step calls it (fp32 state and grads
    there, bf16 weights out), synchronised after each call; the same call the machine profile's
    quick measurement times (:func:`tiermem.model.machine.adam_steps`)."""
    from tiermem.model.machine import adam_steps  # imported late: it may compile kernels

    dev = torch.device("cuda")
    step = adam_steps(dev, n)

    def one() -> None:
        step()
        torch.cuda.synchronize(dev)

    return measure(one, n, repeats=repeats, min_seconds=min_seconds)
