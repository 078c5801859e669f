"""The functional entries of the optimizers beyond Adam: one fused update of one tensor, in place.

They share ``adam_step``'s style: ``kind_step(master, *state, grad, *, step, <hyperparameters>,
grad_scale=1.0, clip_coef=1.0, out=None, stochastic_round=None, check_finite=True, impl=None) ->
found_inf``. ``master`` is the fp32 master weights, or bf16 ones with ``stochastic_round`` (NOTE
[Stochastic rounding bits] in tiermem/optim/kernels/sr.py); the state tensors are fp32 (8-bit state:
uint8 codes and fp32 absmax, NOTE [8-bit state]); any of them may be a 1-D view into a flat buffer
at any offset, as TieredModel's buckets hand them. ``grad`` (fp32, bf16 or fp16) is used as
``grad / grad_scale * clip_coef`` (unscaled as torch.amp.GradScaler does, then clipped). ``out``
(fp32/bf16/fp16), when given, receives the master's new value. ``step`` counts this tensor's
updates including this one (torch's ``state["step"]`` after its increment). The result is
``found_inf``: True when ``grad`` holds an inf or NaN, in which case nothing was written
(``check_finite=False`` skips that read of the gradient when the caller knows it is finite). ``impl``
picks "native" or "reference" (tests and benchmarks). Each state layout is what
:func:`tiermem.optim.state_layout` returns.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from tiermem.config.argdocs import shares_args
from tiermem.errors import ConfigError
from tiermem.optim.adam_hyper import Adam8bitHyper, AdamHyper
from tiermem.optim.arg_checks import make_hyper
from tiermem.optim.functional import ENTRY_ARGS
from tiermem.optim.hypers import AdagradHyper, LionHyper, SGDHyper
from tiermem.optim.kernels import dispatch as _run, quant as _quant
from tiermem.optim.kernels.sr import StochasticRound


@shares_args(ENTRY_ARGS)
def sgd_step(
    master: torch.Tensor,
    momentum_buffer: Optional[torch.Tensor],
    grad: torch.Tensor,
    *,
    step: int,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    maximize: bool = False,
    grad_scale: float = 1.0,
    clip_coef: float = 1.0,
    out: Optional[torch.Tensor] = None,
    stochastic_round: Optional[StochasticRound] = None,
    check_finite: bool = True,
    impl: Optional[str] = None,
    init_buffer: Optional[bool] = None,
) -> bool:
    """torch.optim.SGD's update (``foreach=False``, op for op). ``momentum_buffer`` (fp32, like master)
    is needed when ``momentum`` is not 0 and is None otherwise; at ``step`` 1 it is set to the
    gradient, as torch creates it, so a new buffer need not be initialised (``init_buffer=True`` does
    that at another step, for momentum turned on mid-run).

    Args:
        momentum_buffer: fp32 buffer shaped like master when ``momentum`` is not 0, else None.
        lr: learning rate.
        momentum: momentum factor.
        dampening: dampening of the momentum.
        nesterov: Nesterov momentum.
        weight_decay: L2 penalty added to the gradient.
        maximize: maximize the objective instead of minimizing it.
        impl: ``"native"`` or ``"reference"`` instead of the default (tests and benchmarks).
        init_buffer: True sets the momentum buffer to the gradient at this step (momentum turned on
            mid-run); default: at step 1.
    """
    hyper = make_hyper(
        SGDHyper,
        step=step,
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        nesterov=nesterov,
        weight_decay=weight_decay,
        maximize=maximize,
        grad_scale=grad_scale,
        clip_coef=clip_coef,
        init_buffer=init_buffer,
    )
    if (hyper.momentum != 0) != (momentum_buffer is not None):
        raise ConfigError(
            f"tiermem: sgd_step momentum={hyper.momentum} "
            f"{'needs a momentum_buffer' if hyper.momentum else 'takes no momentum_buffer'}; "
            f"pass {'an fp32 buffer shaped like master' if hyper.momentum else 'None'}"
        )
    return _run.run(
        _run.SGD,
        master,
        (momentum_buffer,),
        grad,
        out,
        hyper,
        stochastic_round=stochastic_round,
        check_finite=check_finite,
        impl=impl,
    )


@shares_args(ENTRY_ARGS)
def adagrad_step(
    master: torch.Tensor,
    state_sum: torch.Tensor,
    grad: torch.Tensor,
    *,
    step: int,
    lr: float,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    eps: float = 1e-10,
    maximize: bool = False,
    grad_scale: float = 1.0,
    clip_coef: float = 1.0,
    out: Optional[torch.Tensor] = None,
    stochastic_round: Optional[StochasticRound] = None,
    check_finite: bool = True,
    impl: Optional[str] = None,
) -> bool:
    """torch.optim.Adagrad's update (``foreach=False``, op for op, the square root correctly rounded).
    ``state_sum`` starts at ``initial_accumulator_value`` (the caller fills it, as torch does).

    Args:
        state_sum: fp32 running sum of squared gradients, updated in place.
        lr: learning rate.
        lr_decay: learning rate decay.
        weight_decay: L2 penalty added to the gradient.
        eps: term added to the denominator.
        maximize: maximize the objective instead of minimizing it.
        impl: ``"native"`` or ``"reference"`` instead of the default (tests and benchmarks).
    """
    hyper = make_hyper(
        AdagradHyper,
        step=step,
        lr=lr,
        lr_decay=lr_decay,
        weight_decay=weight_decay,
        eps=eps,
        maximize=maximize,
        grad_scale=grad_scale,
        clip_coef=clip_coef,
    )
    return _run.run(
        _run.ADAGRAD,
        master,
        (state_sum,),
        grad,
        out,
        hyper,
        stochastic_round=stochastic_round,
        check_finite=check_finite,
        impl=impl,
    )


@shares_args(ENTRY_ARGS)
def lion_step(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    grad: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.99,
    weight_decay: float = 0.0,
    grad_scale: float = 1.0,
    clip_coef: float = 1.0,
    out: Optional[torch.Tensor] = None,
    stochastic_round: Optional[StochasticRound] = None,
    check_finite: bool = True,
    impl: Optional[str] = None,
) -> bool:
    """Lion (Chen et al. 2023): ``c = beta1*m + (1-beta1)*g``; ``p = p*(1 - lr*wd) - lr*sign(c)``;
    ``m = beta2*m + (1-beta2)*g``. ``step`` only keys the stochastic rounding (Lion has no bias
    correction) but is checked like every other.

    Args:
        exp_avg: fp32 momentum, updated in place.
        lr: learning rate.
        beta1: coefficient of the interpolation whose sign is the update.
        beta2: coefficient of the momentum's running average.
        weight_decay: decoupled weight decay.
        impl: ``"native"`` or ``"reference"`` instead of the default (tests and benchmarks).
    """
    hyper = make_hyper(
        LionHyper,
        step=step,
        lr=lr,
        lion_beta1=beta1,
        lion_beta2=beta2,
        weight_decay=weight_decay,
        grad_scale=grad_scale,
        clip_coef=clip_coef,
    )
    return _run.run(
        _run.LION,
        master,
        (exp_avg,),
        grad,
        out,
        hyper,
        stochastic_round=stochastic_round,
        check_finite=check_finite,
        impl=impl,
    )


@shares_args(ENTRY_ARGS)
def adam8bit_step(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_absmax: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_sq_absmax: torch.Tensor,
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
    stochastic_round: Optional[StochasticRound] = None,
    check_finite: bool = True,
    impl: Optional[str] = None,
) -> bool:
    """Adam/AdamW with block-wise 8-bit moments (NOTE [8-bit state]): ``exp_avg`` and ``exp_avg_sq`` are
    uint8 codes (one per element), ``*_absmax`` fp32 (one per block of 256 elements from the tensor's
    element 0). Each block is dequantized, updated with ``adam_step``'s arithmetic and requantized in
    one pass. New state is :func:`tiermem.optim.quantize_blockwise` of zeros (codes 0, absmax 0).
    Blocks start at master's element 0: cut a tensor into calls only at multiples of 256.

    Args:
        exp_avg: uint8 codes of the first moment, one per element.
        exp_avg_absmax: fp32 scale of each block of ``exp_avg``.
        exp_avg_sq: uint8 codes of the second moment, one per element.
        exp_avg_sq_absmax: fp32 scale of each block of ``exp_avg_sq``.
        lr: learning rate.
        beta1: coefficient of the running average of the gradient.
        beta2: coefficient of the running average of its square.
        eps: term added to the denominator.
        weight_decay: decoupled (``adamw=True``) or L2 weight decay.
        adamw: AdamW when True, Adam when False.
        impl: ``"native"`` or ``"reference"`` instead of the default (tests and benchmarks).
    """
    hyper = make_hyper(
        Adam8bitHyper,
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
    state = (exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax)
    return adam8bit_update(
        master, state, grad, out, hyper, stochastic_round=stochastic_round, check_finite=check_finite, impl=impl
    )


def adam8bit_update(
    master: torch.Tensor,
    state: Sequence[Optional[torch.Tensor]],
    grad: torch.Tensor,
    out: Optional[torch.Tensor],
    hyper: AdamHyper,
    *,
    stochastic_round: Optional[StochasticRound],
    check_finite: bool,
    impl: Optional[str],
) -> bool:
    """:func:`adam8bit_step` once its hyperparameters are checked (``hyper``), with ``state`` the four
    8-bit state tensors in its order (what CPUAdam8bit calls with the hyperparameters of its step)."""
    if isinstance(master, torch.Tensor) and not all(
        isinstance(t, torch.Tensor) and t.is_contiguous() for t in (master, grad, *state)
    ):
        raise ConfigError(
            "tiermem: adam8bit_step takes contiguous tensors (the 8-bit state is blocked along "
            "the flat tensor); pass contiguous ones"
        )
    return _run.run(
        _run.ADAM8BIT,
        master,
        state,
        grad,
        out,
        hyper,
        stochastic_round=stochastic_round,
        check_finite=check_finite,
        impl=impl,
    )


def quantize_blockwise(x: torch.Tensor, signed: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, absmax) of ``x`` (fp32, any shape, read flat) in the 8-bit state format of NOTE [8-bit
    state]: ``signed=True`` for ``exp_avg``, False for ``exp_avg_sq`` (non-negative values).

    Args:
        x: an fp32 tensor.
        signed: the signed map (for ``exp_avg``) or the unsigned one (``exp_avg_sq``).

    Returns:
        ``(codes, absmax)``: uint8 codes, one per element, and fp32 scales, one per block of 256.
    """
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise ConfigError(
            f"tiermem: quantize_blockwise takes an fp32 tensor, got {type(x).__name__}"
            f"{' of ' + str(x.dtype) if isinstance(x, torch.Tensor) else ''}"
        )
    flat = x.detach().reshape(-1)
    if flat.device.type == "cpu" and flat.numel():
        from tiermem.optim.kernels import native as _native

        try:
            lib = _native.library("adam8bit")
        except _native.NativeUnavailable:
            return _quant.reference_quantize(flat, signed)
        flat = flat.contiguous()
        codes = torch.empty(flat.numel(), dtype=torch.uint8)
        absmax = torch.empty(_quant.num_blocks(flat.numel()), dtype=torch.float32)
        lib.tm_quantize(
            flat.numel(),
            flat.data_ptr(),
            int(signed),
            codes.data_ptr(),
            absmax.data_ptr(),
            _quant.CONSTANTS.data_ptr(),
            _native.threads(),
        )
        return codes, absmax
    return _quant.reference_quantize(flat, signed)


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, signed: bool = True) -> torch.Tensor:
    """The fp32 values (1-D) of 8-bit state (NOTE [8-bit state]).

    Args:
        codes: uint8 codes, one per element.
        absmax: fp32 scales, one per block of 256 codes.
        signed: the map the codes were made with (True for ``exp_avg``).
    """
    if (
        not isinstance(codes, torch.Tensor)
        or codes.dtype != torch.uint8
        or not isinstance(absmax, torch.Tensor)
        or absmax.dtype != torch.float32
        or absmax.numel() != _quant.num_blocks(codes.numel())
    ):
        raise ConfigError(
            "tiermem: dequantize_blockwise takes uint8 codes and fp32 absmax with one value per block of 256 codes"
        )
    return _quant.reference_dequantize(codes.reshape(-1), absmax.reshape(-1), signed)
