"""How far two correct fp32 runs of the same optimizer may land apart: one rule, derived from the
arithmetic (NOTE [Arithmetic tolerances]), used by every test that compares tiermem with another
implementation (torch.optim's for-loop kernels, the paper's update written in a test).

NOTE [Arithmetic tolerances]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Two correct implementations of one update compute the same real numbers and differ in rounding
alone, by an amount that depends on the CPU (AVX2, AVX-512 and AMX contract different multiply-adds,
reduce in different orders), so the tolerance is a bound on rounding, never a spread measured on
the machine at hand (which is 0 where torch's variants happen to agree and would fail a correct
answer there). One fp32 optimizer step of a weight w is, for every optimizer here,

    w <- w * (1 - lr * wd) - lr * u        (u: the update direction, |lr * u| <= step_size)

Each implementation rounds the decayed weight and the sum once (half an ulp of |w| each, none where
a multiply-add fuses them): two runs part by at most ``WEIGHT_ULPS = 2`` ulps of |w| per step. The
direction u comes out of a handful of roundings of the moments, a square root and a division, each
within a relative 2**-24 (NOTE [sqrt rounding] in tiermem/optim/ allows one ulp of the root on top):
its two values part by a relative ``UPDATE_ULPS * 2**-23`` of |lr * u| <= step_size. UPDATE_ULPS = 16
covers those roundings with room for what a model's forward and backward add: the gradients of a
later step are computed from weights a few ulps apart, and the moments and u inherit their relative
difference (a relative 2**-19, which a wrong hyperparameter, a missed step or a missed weight decay
exceeds by orders of magnitude: tests check each one fails). The differences add up over the steps
(they enter the next step multiplied by 1 - lr * wd <= 1), and the ulp is taken at the largest
|w| the trajectory can have passed through, |w_T| + steps * step_size.

So element by element, after ``steps`` steps:

    |got - want| <= steps * (WEIGHT_ULPS * ulp(|want| + steps * step_size) + UPDATE_ULPS * 2**-23 * step_size)

Adam divides by the gradient's own size, so where a gradient is no larger than its rounding (a
key bias, whose gradient is 0 but for rounding: softmax ignores it; an element whose terms cancel)
the direction u is the rounding's sign and size, and two correct runs may part by up to 2 * |u|max
in it. The backward rounds each gradient element to within ``GRAD_ULPS`` ulps of the largest
gradient in the model, g_max (the terms summed are of that size), so an element whose gradient is
of size sqrt(v_hat) has its direction moved by at most 2 * GRAD_ULPS * 2**-23 * g_max /
(sqrt(v_hat) + eps) (d(m/sqrt(v)) <= 2 dg / sqrt(v)), capped at 2 * |u|max; ``adam_bound`` adds that
per element, from the reference optimizer's own second moment (the arithmetic of this run, not a
spread): elements with a gradient well above rounding keep the tight bound, and a wrong update
there (lr * 1.001, a missed weight decay, a missed step) is caught.

What this does not cover is named where it applies: a reference computed in bf16, 8-bit moments
(their quantization is exact arithmetic given the same inputs, and a rounding apart in the input
can flip a code: their bound is the quantization step, stated in those tests), and Adam's L2 decay
with eps = 0 (ill-conditioned: an update divides by a gradient plus decay that may cancel).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

EPS32 = torch.finfo(torch.float32).eps  # 2**-23: one ulp at 1.0
TINY32 = torch.finfo(torch.float32).tiny  # the smallest normal: below it the spacing is constant
WEIGHT_ULPS = 2  # per step: two roundings of w (decay, then the sum), half an ulp each, in each of two runs
UPDATE_ULPS = 16  # per step: the update's relative error in ulps (its roundings, and a gradient a few ulps apart)
GRAD_ULPS = 4  # the backward's rounding of a gradient element, in ulps of the model's largest gradient


def ulp(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Element by element, the spacing of ``dtype``'s numbers (fp32 unless ``x`` is another float type)
    at |x|: 2**floor(log2|x|) * eps, constant below the smallest normal."""
    info = torch.finfo(dtype or (x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32))
    mag = x.detach().double().abs().clamp_min(info.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * info.eps


def fp32_bound(want: torch.Tensor, *, steps: int, step_size: float) -> torch.Tensor:
    """NOTE [Arithmetic tolerances]: how far, element by element, a correct run of ``steps`` optimizer
    steps may be from ``want``, each step moving a value by at most ``step_size`` (ulps in fp32, or in
    ``want``'s dtype where that is bf16 or fp16: a value a rounding apart before its last rounding to
    that dtype, or before a stochastic rounding, may land on the neighbouring number)."""
    path = want.detach().double().abs() + steps * step_size
    return steps * (WEIGHT_ULPS * ulp(path, want.dtype) + UPDATE_ULPS * EPS32 * step_size)


def excess(got: torch.Tensor, want: torch.Tensor, *, steps: int, step_size: float) -> float:
    """The largest ratio |got - want| / bound over the elements: <= 1 within NOTE [Arithmetic tolerances]."""
    assert got.shape == want.shape, (got.shape, want.shape)
    if got.numel() == 0:
        return 0.0
    d = (got.detach().double() - want.detach().double()).abs()
    return (d / fp32_bound(want, steps=steps, step_size=step_size)).max().item()


def worst(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], *, steps: int, step_size: float):
    """(the largest ratio to the bound, the tensor it is in) over two state dicts with the same keys."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    ratios = {k: excess(got[k], want[k], steps=steps, step_size=step_size) for k in want}
    key = max(ratios, key=ratios.__getitem__)
    return ratios[key], key


def assert_within(got, want, *, steps: int, step_size: float) -> None:
    """``got`` is ``want`` to within NOTE [Arithmetic tolerances] (tensors or state dicts)."""
    if isinstance(want, torch.Tensor):
        ratio, key = excess(got, want, steps=steps, step_size=step_size), "tensor"
    else:
        ratio, key = worst(got, want, steps=steps, step_size=step_size)
    assert math.isfinite(ratio) and ratio <= 1.0, (
        f"{key} is {ratio:.3g} times the rounding bound of {steps} fp32 steps of at most {step_size:g} apart"
    )


def assert_beyond(got, want, *, steps: int, step_size: float) -> None:
    """The bound is no blanket: ``got`` (a wrong answer) is outside it."""
    with_bound = worst(got, want, steps=steps, step_size=step_size) if not isinstance(want, torch.Tensor) else None
    ratio = with_bound[0] if with_bound else excess(got, want, steps=steps, step_size=step_size)
    assert ratio > 1.0, f"a wrong answer is within the bound ({ratio:.3g} of it)"


def fma_parity() -> bool:
    """Whether torch's eager CPU kernels here fuse the multiply-adds that tiermem's native and compiled
    kernels fuse (NOTE [FMA parity] in tiermem/optim/kernels/compiled.py): ATen's AVX2 and AVX-512 kernels
    do; its scalar ones (ATEN_CPU_CAPABILITY=default, and other CPUs' builds) need not."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def assert_kernel_agrees(got: torch.Tensor, want: torch.Tensor, *, steps: int, step_size: float) -> None:
    """A tiermem kernel against its reference written with torch's eager ops: bit for bit where those
    ops fuse the same multiply-adds (``fma_parity``), else to NOTE [Arithmetic tolerances], each of
    the ``steps`` steps moving the value by at most ``step_size``."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    if fma_parity():
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
        assert torch.equal(got.view(ints), want.view(ints)), f"{(got != want).sum().item()} elements differ"
    else:
        assert_within(got, want, steps=steps, step_size=step_size)


def adam_direction_bound(steps: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """The largest |m_hat / sqrt(v_hat)| Adam's bias-corrected moments can reach in ``steps`` steps,
    whatever the gradients (Cauchy-Schwarz on sum_i b1**(t-i) g_i against sum_i b2**(t-i) g_i**2;
    eps only shrinks it): 1 at the first step, about 1 for the first few at the usual betas."""
    b1, b2 = betas
    if b2 == 0 and steps > 1:  # v is the latest g**2 alone: m / |g| has no bound once g may shrink
        return math.inf
    top = 0.0
    for t in range(1, steps + 1):
        ratio = (1 - b1) / (1 - b1**t) * math.sqrt((1 - b2**t) / (1 - b2))
        top = max(top, ratio * math.sqrt(sum((b1 * b1 / b2) ** k for k in range(t))))
    return top


def adamw_step_size(lr: float, steps: int, *, betas=(0.9, 0.999), weight_decay: float = 0.0, wmax: float = 0.0):
    """The most one AdamW (or Adam, with L2 decay folded into the direction) step moves a weight of
    magnitude at most ``wmax``: lr times the direction bound, plus the decay lr * wd * |w|."""
    return lr * (adam_direction_bound(steps, betas) + weight_decay * wmax)


def largest(state: Mapping[str, torch.Tensor]) -> float:
    """The largest magnitude in a state dict (for the decay's share of a step)."""
    return max(v.detach().float().abs().max().item() for v in state.values() if v.numel())


def second_moments(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """torch Adam(W)'s ``exp_avg_sq`` by parameter name (the parameters it stepped; a tied one under
    each of its names)."""
    named = model.named_parameters(remove_duplicate=False)
    return {n: opt.state[p]["exp_avg_sq"].detach().clone() for n, p in named if p in opt.state}


def adam_bound(
    want: Mapping[str, torch.Tensor],
    exp_avg_sq: Mapping[str, torch.Tensor],
    *,
    lr: float,
    steps: int,
    betas=(0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> dict[str, torch.Tensor]:
    """NOTE [Arithmetic tolerances] for ``steps`` fp32 Adam(W) steps, element by element: the
    rounding bound, plus where a gradient is near its rounding (from the reference's second moment
    ``exp_avg_sq``, by name; a name without one did not train) the direction's undetermined part."""
    top = adam_direction_bound(steps, betas)
    size = lr * (top + weight_decay * largest(want))
    correction = 1 - betas[1] ** steps
    rms = {k: (v.detach().double() / correction).sqrt() for k, v in exp_avg_sq.items()}
    g_max = max((r.max().item() for r in rms.values() if r.numel()), default=0.0)
    noise = GRAD_ULPS * EPS32 * g_max
    out = {}
    for k, w in want.items():
        out[k] = fp32_bound(w, steps=steps, step_size=size)
        if k in rms:
            moved = (2 * noise / (rms[k].reshape(w.shape) + eps)).clamp_max(2 * top)
            out[k] = out[k] + steps * lr * moved
    return out


def assert_adam_within(got, want, exp_avg_sq, **hp) -> None:
    """``got`` is ``want`` (torch's Adam(W), whose second moments are ``exp_avg_sq``) to rounding;
    ``hp``: lr, steps, betas, eps, weight_decay as ``adam_bound`` takes them."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    bound = adam_bound(want, exp_avg_sq, **hp)
    ratios = {k: _ratio(got[k], want[k], bound[k]) for k in want}
    key = max(ratios, key=ratios.__getitem__)
    assert math.isfinite(ratios[key]) and ratios[key] <= 1.0, (
        f"{key} is {ratios[key]:.3g} times the rounding bound of {hp['steps']} fp32 Adam steps apart"
    )


def adam_ratio(got, want, exp_avg_sq, **hp) -> float:
    """The largest |got - want| / ``adam_bound`` over the elements (> 1: outside; for checking that
    a wrong answer is caught)."""
    bound = adam_bound(want, exp_avg_sq, **hp)
    return max(_ratio(got[k], want[k], bound[k]) for k in want)


def _ratio(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    if got.numel() == 0:
        return 0.0
    return ((got.detach().double() - want.detach().double()).abs() / bound).max().item()
