"""The torch.compile'd single-pass Adam kernel and its compile cache.

Inductor turns :func:`_make_update`'s function into one vectorised OpenMP C++ loop that reads grad,
master, exp_avg and exp_avg_sq once, and writes master, exp_avg, exp_avg_sq and ``out`` once: the
memory floor of Adam. What is specialised, and what is not:

* one compiled function per *variant* (grad dtype, out dtype or none, Adam-with-L2 or not, and
  which end torch's lerp computes from: beta1 <= 0.5 or not), each with its own code object, so
  dynamo's per-code-object recompile limit is never shared; a variant compiles on first use;
* the element count is a dynamic size, so any tensor size (and any 1-D view into a flat buffer, at
  any offset) runs the same compiled code, in one call; size 1, which dynamo would specialise, is
  padded to 2;
* every hyperparameter, step included, is data in one fp32 tensor: a new lr or step never
  recompiles;
* global state dynamo guards on (grad mode, autocast) is pinned around every call.

Compiling happens once per variant under a lock (the first call on any thread); inductor's FX graph
cache, forced on here, keeps the generated code across processes. The wrapper is generated as C++
(``cpp_wrapper``), which releases the GIL while the kernel runs, so Adam on a worker thread does not
stop the main thread.

NOTE [FMA parity]
torch's eager CPU kernels use fused multiply-add in three places of Adam: ``grad.add(p, alpha=wd)``
is fma(p, wd, g), ``lerp_`` is fma(w, end-start, start), and ``addcmul_`` is fma(value*t1, t2, self).
Inductor's C++ has no fma op, so the kernel is compiled with ``-ffp-contract=fast``, which lets the C
compiler fuse a multiply into the add that consumes it; every other product that feeds an add goes
through an identity the compiler cannot fuse across: a select (:func:`_keep`) where the add has two
products to choose from, else the cheaper exact ``x * 1.0`` (:func:`_keep_product`). The result is
bit-identical to the reference kernel; the tests check this on odd sizes, chunkings and variants.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from tiermem.optim import adam_hyper as H

log = logging.getLogger(__name__)

# Elements per kernel call. The kernel streams, so cache-sized calls would buy nothing, and every call
# is an OpenMP fork/join, which costs milliseconds when other processes hold the cores; one call per
# tensor up to this size. (Any size works: the compiled size is dynamic.)
CHUNK = 1 << 26
WARMUP_NUMEL = 1 << 16  # the size each kernel is first traced and run on
EAGER_CHECK_NUMEL = 1 << 15  # below this, eager isfinite() beats a compiled call's overhead

_OPTIONS: dict[str, Any] = {
    "cpp.enable_floating_point_contract_flag": "fast",  # NOTE [FMA parity]
    "cpp_wrapper": True,  # C++ wrapper: releases the GIL while the kernel runs
    "cpp.dynamic_threads": True,  # threads decided at run time, whatever size the kernel first saw
    "fx_graph_cache": True,  # generated code is reused across processes
}

Variant = tuple[torch.dtype, Optional[torch.dtype], bool, bool]  # grad, out dtype, l2, lerp_from_grad


def _keep(x: torch.Tensor) -> torch.Tensor:
    """The identity, as a select: the C compiler cannot fuse the product that made ``x`` into the
    add that uses it, whichever other operand that add has (NOTE [FMA parity])."""
    return torch.where(x == x, x, float("nan"))


def _keep_product(x: torch.Tensor, one: torch.Tensor) -> torch.Tensor:
    """The identity, as ``x * 1.0`` (a 1.0 read at run time): cheaper than :func:`_keep`. The add that
    uses it may fuse this exact product, but not the one that made ``x``; so it is only good for an
    add whose other operand is not a product."""
    return x * one


def _make_update(l2: bool, lerp_from_grad: bool, has_out: bool, name: str) -> Callable[..., None]:
    def update(master, exp_avg, exp_avg_sq, grad, out, s):
        g = grad.float() * s[H.INV_GRAD_SCALE] * s[H.CLIP_COEF]  # unscale, then clip
        # g is added to a product below when decay joins it (l2) or when lerp starts from it
        g = _keep(g) if l2 or lerp_from_grad else _keep_product(g, s[H.ONE])
        if l2:
            g = g + s[H.L2_DECAY] * master  # fma, as torch's grad.add(param, alpha=wd)
            p = master
        else:
            p = _keep_product(master * s[H.DECAY_MUL], s[H.ONE])  # AdamW decay (1.0 when off)
        start = g if lerp_from_grad else exp_avg
        m = start + s[H.LERP_COEFF] * (g - exp_avg)  # fma, as torch's lerp_
        v = _keep(exp_avg_sq * s[H.BETA2]) + s[H.ONE_MINUS_BETA2] * g * g  # fma, as addcmul_
        denom = v.sqrt() / s[H.BC2_SQRT] + s[H.EPS]
        p = p + s[H.NEG_STEP_SIZE] * m / denom  # as addcdiv_: (value * m) / denom, then add
        master.copy_(p)
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
        if has_out:
            out.copy_(p)

    # A fresh code object per variant: dynamo keeps its compiled graphs (and its recompile limit)
    # per code object, so variants must not share one.
    update.__code__ = update.__code__.replace(co_name=name)
    update.__name__ = update.__qualname__ = name
    return update


def _make_all_finite(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    def all_finite(grad):
        return torch.isfinite(grad).all()  # one vectorised reduction, no temporary

    all_finite.__code__ = all_finite.__code__.replace(co_name=name)
    return all_finite


@dataclass
class _Compiled:
    fn: Callable
    seconds: float  # wall time of the first call (trace + compile or cache load)


class CompileUnavailable(RuntimeError):
    """torch.compile could not build a kernel here (no C++ compiler, a compile error, ...)."""


class CompiledAdam:
    """The compiled kernels of this process, built lazily and shared by all threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kernels: dict[object, _Compiled] = {}
        self.failure: Optional[str] = None  # why compiling failed, once it has

    def seconds(self) -> dict[object, float]:
        return {k: c.seconds for k, c in self._kernels.items()}

    def _get(self, key: object, build: Callable[[], Callable], warm: Callable[[Callable], None]) -> Callable:
        c = self._kernels.get(key)
        if c is not None:
            return c.fn
        with self._lock:  # compile and warm up once per variant, whichever thread gets here first
            c = self._kernels.get(key)
            if c is not None:
                return c.fn
            if self.failure is not None:
                raise CompileUnavailable(self.failure)
            t0 = time.perf_counter()
            try:
                fn = torch.compile(build(), fullgraph=True, dynamic=True, options=_OPTIONS)
                with _pinned_global_state():
                    warm(fn)
            except Exception as e:
                self.failure = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
                log.debug("tiermem: compiling %s failed", key, exc_info=True)
                raise CompileUnavailable(self.failure) from e
            self._kernels[key] = _Compiled(fn, time.perf_counter() - t0)
            log.info("tiermem: compiled CPU Adam kernel %s in %.1f s", key, self._kernels[key].seconds)
            return fn

    def update_fn(self, variant: Variant) -> Callable:
        grad_dtype, out_dtype, l2, lerp_from_grad = variant
        name = (
            f"tiermem_adam_{str(grad_dtype)[6:]}_to_{str(out_dtype)[6:] if out_dtype else 'none'}"
            f"{'_l2' if l2 else ''}{'_lerp_from_grad' if lerp_from_grad else ''}"
        )

        def warm(fn: Callable) -> None:
            n = WARMUP_NUMEL
            z = [torch.zeros(n, dtype=torch.float32) for _ in range(3)]
            g = torch.zeros(n, dtype=grad_dtype)
            out = torch.empty(n, dtype=out_dtype) if out_dtype is not None else None
            hyper = H.AdamHyper(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
            fn(*z, g, out, hyper.kernel_scalars())

        return self._get(
            ("update", variant), lambda: _make_update(l2, lerp_from_grad, out_dtype is not None, name), warm
        )

    def all_finite_fn(self, grad_dtype: torch.dtype) -> Callable:
        name = f"tiermem_all_finite_{str(grad_dtype)[6:]}"
        return self._get(
            ("all_finite", grad_dtype),
            lambda: _make_all_finite(name),
            lambda fn: fn(torch.zeros(WARMUP_NUMEL, dtype=grad_dtype)),
        )

    # -- the kernels, in the shared signature (flat, contiguous, 1-D tensors) ----------------------
    def adam(
        self,
        master: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        grad: torch.Tensor,
        out: Optional[torch.Tensor],
        hyper: H.AdamHyper,
    ) -> None:
        fn = self.update_fn((grad.dtype, None if out is None else out.dtype, hyper.l2, hyper.lerp_from_grad))
        s = hyper.kernel_scalars()
        n = master.numel()
        if n == 1:  # a size-1 dimension would make dynamo compile a specialised copy: pad to 2
            _padded_call(fn, master, exp_avg, exp_avg_sq, grad, out, s)
            return
        with _pinned_global_state():
            for a, b in _chunks(n):
                fn(master[a:b], exp_avg[a:b], exp_avg_sq[a:b], grad[a:b], None if out is None else out[a:b], s)

    def any_nonfinite(self, grad: torch.Tensor) -> bool:
        if grad.numel() < EAGER_CHECK_NUMEL:  # cheaper than a compiled call; and dynamo would
            return not bool(torch.isfinite(grad).all())  # specialise size 1
        fn = self.all_finite_fn(grad.dtype)
        with _pinned_global_state():
            return not bool(fn(grad))


def _chunks(n: int) -> Iterator[tuple[int, int]]:
    """[a, b) ranges of at most CHUNK elements covering [0, n), none of size 1 (n >= 2)."""
    a = 0
    while a < n:
        b = min(a + CHUNK, n)
        if n - b == 1:  # the next chunk would hold one element: leave it two
            b -= 1
        yield a, b
        a = b


def _padded_call(fn: Callable, master, exp_avg, exp_avg_sq, grad, out, s) -> None:
    pad = [torch.zeros(2, dtype=t.dtype) for t in (master, exp_avg, exp_avg_sq, grad)]
    for p, t in zip(pad, (master, exp_avg, exp_avg_sq, grad)):
        p[:1].copy_(t)
    out_pad = torch.empty(2, dtype=out.dtype) if out is not None else None
    with _pinned_global_state():
        fn(*pad, out_pad, s)
    for p, t in zip(pad[:3], (master, exp_avg, exp_avg_sq)):
        t.copy_(p[:1])
    if out is not None and out_pad is not None:  # (made when out is)
        out.copy_(out_pad[:1])


def _pinned_global_state() -> contextlib.AbstractContextManager:
    """Grad mode and autocast as the kernels were compiled with: dynamo guards on both, and a
    caller's different setting would otherwise compile a second copy of the kernel."""
    autocast = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    if not autocast and not torch.is_grad_enabled():
        return contextlib.nullcontext()  # the common case, and the cheap one
    stack = contextlib.ExitStack()
    stack.enter_context(torch.no_grad())
    for device in autocast:
        stack.enter_context(torch.autocast(device, enabled=False))
    return stack


def disabled_by_env() -> bool:
    """``TIERMEM_NO_COMPILE`` set to anything but "" or "0" forces the fallback (the one reading of it)."""
    return os.environ.get("TIERMEM_NO_COMPILE", "") not in ("", "0")
