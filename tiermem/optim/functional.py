"""``adam_step``: one fused Adam/AdamW update of fp32 master weights and moments, and the choice of
implementation behind it.

NOTE [found_inf: nothing changes]
A step with an inf/NaN gradient must change nothing, yet the single pass commits each element as it
goes: an inf near the end would be found after the rest was written. Undo copies of what was
written would cost 24 bytes per parameter written and read back; instead the gradient alone is read
once ahead of the update, by a compiled ``isfinite().all()`` reduction (no temporary; 2 bytes per
parameter for bf16 against the update's 28, but one stream reads slower than the update's seven:
bench/cpu_adam.py measures it at 14-16% of the bf16 step). Callers that already know the gradients
are finite (TieredModel learns it from the global gradient norm it computes anyway) pass
``check_finite=False`` and pay nothing.

The implementation choice behind it is :mod:`tiermem.optim.adam_impl`; the argument checks every
functional entry shares are :mod:`tiermem.optim.arg_checks`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from tiermem.config.argdocs import shares_args
from tiermem.optim.adam_hyper import AdamHyper
from tiermem.optim.adam_impl import choose, compiled_step, default_impl, eager_step, native_step
from tiermem.optim.arg_checks import check_impl, check_tensors, make_hyper
from tiermem.optim.kernels import dispatch as _run

if TYPE_CHECKING:
    from tiermem.optim.kernels.sr import StochasticRound

#: the arguments every functional entry (adam_step, sgd_step, ..., adafactor_step) takes alike,
#: documented once: joined to each entry's own Args (config/argdocs.py)
ENTRY_ARGS = """
    master: fp32 master weights (or bf16 ones with ``stochastic_round``), updated in place.
    grad: the gradient, fp32, bf16 or fp16, of master's shape.
    step: 1-based count of this tensor's updates including this one.
    grad_scale: the loss scale the gradient carries; it is divided out first.
    clip_coef: the clip coefficient the (unscaled) gradient is multiplied by.
    out: receives the master's new value in its own dtype (fp32, bf16 or fp16), when given.
    stochastic_round: with bf16 ``master``, the :class:`StochasticRound` of this parameter.
    check_finite: False skips the read of ``grad`` for inf/NaN when the caller knows it is finite.

Returns:
    ``found_inf``: True when ``grad`` holds an inf or NaN, in which case nothing was written.
"""


@shares_args(ENTRY_ARGS)
def adam_step(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool = True,
    grad_scale: float = 1.0,
    clip_coef: float = 1.0,
    out: Optional[torch.Tensor] = None,
    check_finite: bool = True,
    impl: Optional[str] = None,
    stochastic_round: Optional["StochasticRound"] = None,
) -> bool:
    """One Adam (``adamw=False``) or AdamW update, in place, in one pass over the optimizer state
    (plus one read of ``grad`` for the finite check, see NOTE [found_inf: nothing changes]).

    ``master``, ``exp_avg`` and ``exp_avg_sq`` are fp32 CPU tensors of one shape (typically 1-D
    views into a flat bucket); ``grad`` has that shape and is fp32, bf16 or fp16; the gradient used
    is ``grad / grad_scale * clip_coef``, unscaled as torch.amp.GradScaler does (a multiplication by
    the fp32 reciprocal: exact for the powers of two that loss scaling uses) and then clipped as
    ``clip_grad_norm_`` does (a multiplication). ``step`` counts updates including this one (torch's
    ``state["step"]`` after its increment). When ``out`` (fp32/bf16/fp16) is given, it receives
    ``master.to(out.dtype)`` after the update. The math is torch.optim.Adam/AdamW's for-loop
    (``foreach=False``) op for op, except that the square root is correctly rounded.

    Returns ``found_inf``: True when some gradient element is inf or NaN, in which case nothing was
    written. ``check_finite=False`` skips that check (the caller knows the gradients are finite)
    and always returns False. ``impl`` picks an implementation ("native", "compiled", "fallback",
    "reference") instead of the default, for tests and benchmarks.

    bf16 master weights (no fp32 copy) take ``stochastic_round=StochasticRound(...)``: the update is
    computed in fp32, as above, and rounded stochastically into ``master`` (NOTE [Stochastic rounding
    bits] in tiermem/optim/kernels/sr.py); that path runs the native kernel ("native" and "compiled" pick it,
    "fallback" and "reference" the torch-ops reference).

    Args:
        exp_avg: fp32 first moment, updated in place.
        exp_avg_sq: fp32 second moment, updated in place.
        lr: learning rate.
        beta1: coefficient of the running average of the gradient.
        beta2: coefficient of the running average of its square.
        eps: term added to the denominator.
        weight_decay: decoupled (``adamw=True``) or L2 (``adamw=False``) weight decay.
        adamw: AdamW (decoupled weight decay) when True, Adam when False.
        impl: ``"native"``, ``"compiled"``, ``"fallback"`` or ``"reference"`` instead of the default.
    """
    hyper = make_hyper(
        AdamHyper,
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        adamw=adamw,
        grad_scale=grad_scale,
        clip_coef=clip_coef,
    )
    return adam_update(
        master,
        exp_avg,
        exp_avg_sq,
        grad,
        out,
        hyper,
        stochastic_round=stochastic_round,
        check_finite=check_finite,
        impl=impl,
    )


def adam_update(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    out: Optional[torch.Tensor],
    hyper: AdamHyper,
    *,
    stochastic_round: Optional["StochasticRound"],
    check_finite: bool,
    impl: Optional[str],
) -> bool:
    """:func:`adam_step` once its hyperparameters are checked (``hyper``): what the drop-ins call with
    the hyperparameters they made once for the step."""
    check_impl(impl)
    if stochastic_round is not None or (isinstance(master, torch.Tensor) and master.dtype == torch.bfloat16):
        return _run.run(
            _run.ADAM,
            master,
            (exp_avg, exp_avg_sq),
            grad,
            out,
            hyper,
            stochastic_round=stochastic_round,
            check_finite=check_finite,
            impl=None if impl is None else "native" if impl in ("native", "compiled") else "reference",
        )
    check_tensors(master, exp_avg, exp_avg_sq, grad, out)
    if master.numel() == 0:
        return False
    # detached views: the same memory, without autograd's view of it (dynamo guards on requires_grad)
    detached = (
        master.detach(),
        exp_avg.detach(),
        exp_avg_sq.detach(),
        grad.detach(),
        out if out is None else out.detach(),
    )
    name, tensors = choose(impl, detached)
    if name == "native":
        found_inf = native_step(tensors, hyper, check_finite=check_finite, impl=impl)
        if found_inf is not None:
            return found_inf
        name = default_impl()  # it cannot be built here, and impl=None lets it fall back
    if name == "compiled":
        found_inf = compiled_step(tensors, hyper, check_finite=check_finite, impl=impl)
        if found_inf is not None:
            return found_inf
        name = "fallback"  # it cannot be compiled here, and impl=None lets it fall back
    return eager_step(name, tensors, hyper, check_finite=check_finite, impl=impl)
