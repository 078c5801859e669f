"""The eager implementations behind :func:`tiermem.optim.adam_step`.

Every kernel has one signature, ``kernel(tensors, hyper) -> None`` with ``tensors`` the
:data:`AdamTensors` ``(master, exp_avg, exp_avg_sq, grad, out)``: it updates ``master``/``exp_avg``/``exp_avg_sq`` (fp32) in place from ``grad`` (fp32/bf16/fp16, never
written) and, when ``out`` is not None, writes ``master.to(out.dtype)`` into it. Finite gradients are
checked by the caller before any kernel runs (see NOTE [found_inf: nothing changes] in
functional.py); kernels do not look.

* ``_single_tensor_adam``: the for-loop reference and test oracle. It is torch.optim's
  ``_single_tensor_adam`` op for op (lerp, mul/addcmul, addcdiv) except for one documented
  deviation: the square root is correctly rounded (NOTE [sqrt rounding]).
* ``_fused_fallback_adam``: used when torch.compile is unavailable: torch's fused CPU AdamW/Adam on
  cache-sized chunks, with the gradient converted into a per-thread fp32 scratch chunk first.

NOTE [sqrt rounding]
torch's eager CPU ``sqrt`` for fp32 (MKL's vector math in this build) is not correctly rounded:
about one element in five differs from the true square root by one ulp, and which ones depends on
the library and the CPU. A compiled kernel's ``sqrt`` is the correctly rounded instruction. The
reference therefore takes the square root in fp64 and rounds once to fp32 (the fp64 root of an fp32
number rounds to the correctly rounded fp32 root), so reference and compiled kernel can agree bit
for bit, and both differ from torch.optim only through ``denom`` by at most one ulp.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from tiermem.optim.adam_hyper import AdamHyper

FALLBACK_CHUNK = 1 << 18  # elements per fused call: the fp32 grad scratch (1 MiB) stays in cache
CHECK_CHUNK = 1 << 20  # elements per eager isfinite() call: bounds its temporary bool tensor

#: what every kernel updates and reads, in this order: master, exp_avg, exp_avg_sq, grad, out (None: no out)
AdamTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]

_scratch = threading.local()  # per-thread fp32 scratch: kernels may run on several threads at once


def _single_tensor_adam(tensors: AdamTensors, hyper: AdamHyper) -> None:
    master, exp_avg, exp_avg_sq, grad, out = tensors
    g = grad.float() * hyper.inv_grad_scale * hyper.clip_coef  # unscale, then clip: a new tensor
    if hyper.weight_decay != 0:
        if hyper.adamw:
            master.mul_(1 - hyper.lr * hyper.weight_decay)
        else:
            g = g.add(master, alpha=hyper.weight_decay)
    exp_avg.lerp_(g, 1 - hyper.beta1)
    exp_avg_sq.mul_(hyper.beta2).addcmul_(g, g, value=1 - hyper.beta2)
    root = exp_avg_sq.double().sqrt().float()  # NOTE [sqrt rounding]
    denom = (root / hyper.bias_correction2_sqrt).add_(hyper.eps)
    master.addcdiv_(exp_avg, denom, value=-hyper.step_size)
    if out is not None:
        out.copy_(master)


def _grad_scratch(n: int) -> torch.Tensor:
    buf = getattr(_scratch, "grad", None)
    if buf is None or buf.numel() < n:
        buf = torch.empty(max(n, FALLBACK_CHUNK), dtype=torch.float32)
        _scratch.grad = buf
    return buf[:n]


def _fused_fallback_adam(tensors: AdamTensors, hyper: AdamHyper) -> None:
    """Flat 1-D contiguous tensors only (adam_step flattens). Not bit-identical to the reference:
    torch's fused kernel orders the moment updates differently (tested to a tolerance)."""
    master, exp_avg, exp_avg_sq, grad, out = tensors
    step = [torch.tensor(float(hyper.step), dtype=torch.float32)]
    convert = grad.dtype != torch.float32 or hyper.grad_scale != 1.0 or hyper.clip_coef != 1.0
    n = master.numel()
    for a in range(0, n, FALLBACK_CHUNK):
        b = min(a + FALLBACK_CHUNK, n)
        g = grad[a:b]
        if convert:  # into cache-resident scratch, so the fused kernel reads it from cache
            g = _grad_scratch(b - a).copy_(g)
            if hyper.grad_scale != 1.0:
                g.mul_(hyper.inv_grad_scale)
            if hyper.clip_coef != 1.0:
                g.mul_(hyper.clip_coef)
        p = master[a:b]
        _fused(p, g, exp_avg[a:b], exp_avg_sq[a:b], step, hyper)
        if out is not None:
            out[a:b].copy_(p)


def _device_adam(tensors: AdamTensors, hyper: AdamHyper) -> None:
    """Tensors on an accelerator (e.g. KeepOnDevice on a GPU): torch's fused Adam(W) there, one
    launch; unscale and clip as the CPU kernels do (two fp32 multiplications). Agrees with the
    CPU kernels to rounding, not bit for bit."""
    master, exp_avg, exp_avg_sq, grad, out = tensors
    g = grad.float() if grad.dtype != torch.float32 else grad
    if hyper.grad_scale != 1.0:
        g = g.mul(hyper.inv_grad_scale)
    if hyper.clip_coef != 1.0:
        g = g.mul(hyper.clip_coef)
    step = [_device_step(hyper.step, master.device)]
    _fused(master, g, exp_avg, exp_avg_sq, step, hyper)
    if out is not None:
        out.copy_(master)


def _fused(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: list[torch.Tensor], hyper: AdamHyper
) -> None:
    """torch's fused Adam(W) of one tensor (fp32 ``g``: unscaled and clipped already), ``step`` its
    fp32 step count on ``p``'s device."""
    fused = torch._fused_adamw_ if hyper.adamw else torch._fused_adam_
    fused(
        [p],
        [g],
        [m],
        [v],
        [],
        step,
        lr=hyper.lr,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        amsgrad=False,
        maximize=False,
    )


def _device_step(step: int, device: torch.device) -> torch.Tensor:
    """The step count as the fp32 device scalar the fused kernel reads (it never writes it), made
    once per step, device and stream: by a fill, not a copy from the CPU, which would wait for every
    kernel queued before it (NOTE [Split step]: the CPU's Adam runs while the device's is queued).
    Kept per thread and stream, so a tensor is only ever freed (replaced by the next step's) on
    the stream that made and read it."""
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    key = (device, getattr(stream, "cuda_stream", None))
    cache = getattr(_scratch, "steps", None)
    if cache is None:
        cache = _scratch.steps = {}
    held = cache.get(key)
    if held is None or held[0] != step:
        held = cache[key] = (step, torch.full((), float(step), dtype=torch.float32, device=device))
    return held[1]


def _eager_any_nonfinite(grad: torch.Tensor) -> bool:
    flat = grad.reshape(-1)
    return any(not bool(torch.isfinite(flat[a : a + CHECK_CHUNK]).all()) for a in range(0, flat.numel(), CHECK_CHUNK))
