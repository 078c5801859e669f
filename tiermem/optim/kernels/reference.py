"""The reference kernels of SGD, Adagrad, Lion, bf16-master Adam and 8-bit Adam: torch ops, one
operation at a time, as torch.optim's for-loop (``foreach=False``) kernels write them. They are the
test oracles the native kernels equal bit for bit, and what runs where no native kernel does (an
accelerator's tensors, non-contiguous ones, no C++ compiler).

One signature: ``kernel(master, state, grad, out, hyper, sr)``: ``state`` is the tuple of state tensors
in the functional entry's order, ``sr`` the stochastic rounding keys (or None for fp32 masters). The
update is computed on ``p``, the master weights in fp32 (the master itself, or a copy of a bf16
master that :func:`_write` rounds back stochastically); ``out`` receives the master's new value.
Deviation from torch, as in tiermem/optim/kernels/eager.py: square roots are correctly rounded (NOTE
[sqrt rounding]).
"""

from __future__ import annotations

from typing import Optional

import torch

from tiermem.optim.adam_hyper import AdamHyper
from tiermem.optim.hypers import AdagradHyper, LionHyper, SGDHyper
from tiermem.optim.kernels import quant as _quant, sr as _sr
from tiermem.optim.kernels.eager import _single_tensor_adam

Keys = Optional[tuple[int, int, int]]


def _working(master: torch.Tensor) -> torch.Tensor:
    return master if master.dtype == torch.float32 else master.float()


def _write(master: torch.Tensor, p: torch.Tensor, out: Optional[torch.Tensor], sr: Keys) -> None:
    if sr is not None:
        master.copy_(_sr.round_bf16(p.reshape(-1), sr).view(master.shape))
    if out is not None:
        out.copy_(master)


def _gradient(grad: torch.Tensor, hyper) -> torch.Tensor:
    """Unscaled, then clipped (a new fp32 tensor), then negated for ``maximize`` as torch does."""
    g = grad.float() * (1.0 / hyper.grad_scale) * hyper.clip_coef
    return -g if getattr(hyper, "maximize", False) else g


def _l2_gradient(p: torch.Tensor, grad: torch.Tensor, hyper) -> torch.Tensor:
    """:func:`_gradient` plus the L2 penalty torch's SGD and Adagrad add (``weight_decay * p``)."""
    g = _gradient(grad, hyper)
    return g.add(p, alpha=hyper.weight_decay) if hyper.weight_decay != 0 else g


def sgd(
    master: torch.Tensor, state: tuple, grad: torch.Tensor, out: Optional[torch.Tensor], h: SGDHyper, sr: Keys
) -> None:
    (buf,) = state
    p = _working(master)
    g = _l2_gradient(p, grad, h)
    if h.momentum != 0:
        if h.first:  # torch: the buffer starts as a copy of the gradient
            buf.copy_(g)
        else:
            buf.mul_(h.momentum).add_(g, alpha=1 - h.dampening)
        g = g.add(buf, alpha=h.momentum) if h.nesterov else buf
    p.add_(g, alpha=-h.lr)
    _write(master, p, out, sr)


def adagrad(
    master: torch.Tensor, state: tuple, grad: torch.Tensor, out: Optional[torch.Tensor], h: AdagradHyper, sr: Keys
) -> None:
    (state_sum,) = state
    p = _working(master)
    g = _l2_gradient(p, grad, h)
    state_sum.addcmul_(g, g, value=1)
    std = state_sum.double().sqrt().float().add_(h.eps)  # NOTE [sqrt rounding]
    p.addcdiv_(g, std, value=-h.clr)
    _write(master, p, out, sr)


def lion(
    master: torch.Tensor, state: tuple, grad: torch.Tensor, out: Optional[torch.Tensor], h: LionHyper, sr: Keys
) -> None:
    """Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2 (decoupled decay)."""
    (exp_avg,) = state
    p = _working(master)
    g = _gradient(grad, h)
    if h.weight_decay != 0:
        p.mul_(1 - h.lr * h.weight_decay)
    update = exp_avg.mul(h.lion_beta1).add(g, alpha=1 - h.lion_beta1).sign_()
    p.add_(update, alpha=-h.lr)
    exp_avg.mul_(h.lion_beta2).add_(g, alpha=1 - h.lion_beta2)
    _write(master, p, out, sr)


def adam(
    master: torch.Tensor, state: tuple, grad: torch.Tensor, out: Optional[torch.Tensor], h: AdamHyper, sr: Keys
) -> None:
    exp_avg, exp_avg_sq = state
    p = _working(master)
    _single_tensor_adam((p, exp_avg, exp_avg_sq, grad, None), h)
    _write(master, p, out, sr)


def adam8bit(
    master: torch.Tensor, state: tuple, grad: torch.Tensor, out: Optional[torch.Tensor], h: AdamHyper, sr: Keys
) -> None:
    """Dequantize both moments, take an Adam step, quantize back (NOTE [8-bit state]). The step is the
    fp32 reference's but for ``sqrt(v) * (1 / bias_correction2_sqrt)`` where it divides."""
    m_codes, m_absmax, v_codes, v_absmax = state
    p = _working(master)
    m = _quant.reference_dequantize(m_codes, m_absmax, signed=True)
    v = _quant.reference_dequantize(v_codes, v_absmax, signed=False)
    g = grad.float() * h.inv_grad_scale * h.clip_coef
    if h.weight_decay != 0:
        if h.adamw:
            p.mul_(1 - h.lr * h.weight_decay)
        else:
            g = g.add(p, alpha=h.weight_decay)
    m.lerp_(g, 1 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
    denom = v.double().sqrt().float().mul_(1.0 / h.bias_correction2_sqrt).add_(h.eps)  # NOTE [sqrt rounding]
    p.addcdiv_(m, denom, value=-h.step_size)
    for codes, absmax, x, signed in ((m_codes, m_absmax, m, True), (v_codes, v_absmax, v, False)):
        c, a = _quant.reference_quantize(x, signed)
        codes.copy_(c)
        absmax.copy_(a)
    _quant.reference_bound(m, v, m_codes, m_absmax, v_codes, v_absmax, *h.moment_bound)
    _write(master, p, out, sr)
