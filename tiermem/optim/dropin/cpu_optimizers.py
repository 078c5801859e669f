"""Drop-in ``torch.optim`` optimizers on tiermem's fused CPU kernels: ``CPUSGD``, ``CPUAdagrad``,
``CPULion``, ``CPUAdafactor`` and ``CPUAdam8bit`` (``CPUAdam`` is in cpu_adam.py).

Each takes torch's arguments and defaults (Lion: the paper's; the 8-bit Adam: CPUAdam's), keeps
torch's state keys (plus ``step`` where torch's has none), works with param groups, lr schedulers
and ``state_dict``/``load_state_dict``, and matches its torch optimizer (``foreach=False``) as the
tests state. All of them share tiermem/optim/dropin/shared.py: fp32 CPU parameters (bf16 ones with
``bf16_stochastic_round=True``), a step skipped whole when a gradient is not finite
(``check_finite=False`` turns the check off), sparse gradients refused.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch

from tiermem.config.rules import is_int
from tiermem.errors import ConfigError, checked_arguments
from tiermem.optim.adafactor import AdafactorHyper, adafactor_update, check_adafactor, factored_state
from tiermem.optim.adam_hyper import AdamHyper
from tiermem.optim.dropin.cpu_adam import adam_functional, adam_hyper, check_adam_group, fill_adamw, init_adam_state
from tiermem.optim.dropin.shared import CPUOptimizer, Params, Plan, number
from tiermem.optim.functional import make_hyper
from tiermem.optim.hypers import AdagradHyper, LionHyper, SGDHyper, check_hyper
from tiermem.optim.kernels import dispatch as _run, quant as _quant
from tiermem.optim.kernels.sr import StochasticRound
from tiermem.optim.steps import adam8bit_update

Number = Union[float, torch.Tensor]


@checked_arguments
class CPUSGD(CPUOptimizer):
    """torch.optim.SGD (momentum, dampening, Nesterov, weight decay, maximize), one fused pass per
    tensor. State: ``momentum_buffer`` (with momentum) and ``step``.

    Args:
        params: the parameters to optimize, or param groups (dicts), as ``torch.optim`` takes them;
            CPU tensors.
        lr: learning rate.
        momentum: momentum factor.
        dampening: dampening of the momentum.
        weight_decay: L2 penalty added to the gradient.
        nesterov: Nesterov momentum (needs momentum > 0 and no dampening).
        maximize: maximize the objective instead of minimizing it.
        check_finite: check every gradient for inf/NaN before any update; a step that finds one
            changes nothing and sets ``last_step_skipped``. False skips the check.
        bf16_stochastic_round: take bf16 parameters and keep no fp32 copy, rounding each update
            stochastically (NOTE [Stochastic rounding bits]).
        sr_seed: the seed of that rounding (default: ``torch.initial_seed()`` when built).
    """

    _state_keys = ("momentum_buffer",)

    def __init__(
        self,
        params: Params,
        lr: Number = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        check_finite: bool = True,
        bf16_stochastic_round: bool = False,
        sr_seed: Optional[int] = None,
    ):
        super().__init__(
            params,
            dict(
                lr=lr,
                momentum=momentum,
                dampening=dampening,
                weight_decay=weight_decay,
                nesterov=nesterov,
                maximize=maximize,
            ),
            check_finite=check_finite,
            bf16_stochastic_round=bf16_stochastic_round,
            sr_seed=sr_seed,
        )

    def _check_group(self, g: dict[str, Any]) -> None:
        check_hyper(
            "CPUSGD ",
            lr=number(g["lr"]),
            momentum=g["momentum"],
            dampening=g["dampening"],
            weight_decay=g["weight_decay"],
            nesterov=g["nesterov"],
            maximize=g["maximize"],
        )
        if g["nesterov"] and (g["momentum"] <= 0 or g["dampening"] != 0):
            raise ConfigError("tiermem: CPUSGD nesterov=True needs momentum > 0 and dampening = 0; as torch.optim.SGD")

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], g: dict[str, Any]) -> None:
        pass  # the buffer is made on the first step with momentum

    def _plan(self, p: torch.Tensor, state: dict[str, Any], g: dict[str, Any]) -> Plan:
        if g["momentum"] == 0:
            return Plan(_run.SGD, (None,), (False,))
        buf = state.get("momentum_buffer")
        if buf is not None:
            return Plan(_run.SGD, (buf,), (False,))
        # torch: made from the gradient when first needed (the kernel sets it: init_buffer)
        buf = state["momentum_buffer"] = torch.empty_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        return Plan(_run.SGD, (buf,), (True,))

    def _hyper(self, g: dict[str, Any], step: int, variant: tuple) -> SGDHyper:
        return make_hyper(
            SGDHyper,
            step=step,
            lr=g["lr"],
            momentum=g["momentum"],
            dampening=g["dampening"],
            nesterov=g["nesterov"],
            weight_decay=g["weight_decay"],
            maximize=g["maximize"],
            init_buffer=variant[0],
        )


@checked_arguments
class CPUAdagrad(CPUOptimizer):
    """torch.optim.Adagrad (lr decay, weight decay, initial accumulator, maximize), one fused pass per
    tensor. State: ``sum`` and ``step``.

    Args:
        params: the parameters to optimize, or param groups (dicts), as ``torch.optim`` takes them;
            CPU tensors.
        lr: learning rate.
        lr_decay: learning rate decay.
        weight_decay: L2 penalty added to the gradient.
        initial_accumulator_value: the starting value of the sum of squared gradients.
        eps: term added to the denominator.
        maximize: maximize the objective instead of minimizing it.
        check_finite: check every gradient for inf/NaN before any update; a step that finds one
            changes nothing and sets ``last_step_skipped``. False skips the check.
        bf16_stochastic_round: take bf16 parameters and keep no fp32 copy, rounding each update
            stochastically (NOTE [Stochastic rounding bits]).
        sr_seed: the seed of that rounding (default: ``torch.initial_seed()`` when built).
    """

    _state_keys = ("sum",)

    def __init__(
        self,
        params: Params,
        lr: Number = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
        check_finite: bool = True,
        bf16_stochastic_round: bool = False,
        sr_seed: Optional[int] = None,
    ):
        super().__init__(
            params,
            dict(
                lr=lr,
                lr_decay=lr_decay,
                weight_decay=weight_decay,
                eps=eps,
                initial_accumulator_value=initial_accumulator_value,
                maximize=maximize,
            ),
            check_finite=check_finite,
            bf16_stochastic_round=bf16_stochastic_round,
            sr_seed=sr_seed,
        )

    def _check_group(self, g: dict[str, Any]) -> None:
        check_hyper(
            "CPUAdagrad ",
            lr=number(g["lr"]),
            lr_decay=g["lr_decay"],
            weight_decay=g["weight_decay"],
            eps=g["eps"],
            initial_accumulator_value=g["initial_accumulator_value"],
            maximize=g["maximize"],
        )

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], g: dict[str, Any]) -> None:
        state["sum"] = torch.full_like(
            p, g["initial_accumulator_value"], dtype=torch.float32, memory_format=torch.preserve_format
        )

    def _plan(self, p: torch.Tensor, state: dict[str, Any], g: dict[str, Any]) -> Plan:
        return Plan(_run.ADAGRAD, (state["sum"],))

    def _hyper(self, g: dict[str, Any], step: int, variant: tuple) -> AdagradHyper:
        return make_hyper(
            AdagradHyper,
            step=step,
            lr=g["lr"],
            lr_decay=g["lr_decay"],
            weight_decay=g["weight_decay"],
            eps=g["eps"],
            maximize=g["maximize"],
        )


@checked_arguments
class CPULion(CPUOptimizer):
    """Lion (Chen et al. 2023; torch has none): ``betas`` and decoupled ``weight_decay`` as the paper's
    reference implementation. State: ``exp_avg`` and ``step``.

    Args:
        params: the parameters to optimize, or param groups (dicts), as ``torch.optim`` takes them;
            CPU tensors.
        lr: learning rate.
        betas: the interpolation coefficient whose sign is the update, and the momentum's.
        weight_decay: decoupled weight decay.
        check_finite: check every gradient for inf/NaN before any update; a step that finds one
            changes nothing and sets ``last_step_skipped``. False skips the check.
        bf16_stochastic_round: take bf16 parameters and keep no fp32 copy, rounding each update
            stochastically (NOTE [Stochastic rounding bits]).
        sr_seed: the seed of that rounding (default: ``torch.initial_seed()`` when built).
    """

    _state_keys = ("exp_avg",)

    def __init__(
        self,
        params: Params,
        lr: Number = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        check_finite: bool = True,
        bf16_stochastic_round: bool = False,
        sr_seed: Optional[int] = None,
    ):
        super().__init__(
            params,
            dict(lr=lr, betas=betas, weight_decay=weight_decay),
            check_finite=check_finite,
            bf16_stochastic_round=bf16_stochastic_round,
            sr_seed=sr_seed,
        )

    def _check_group(self, g: dict[str, Any]) -> None:
        betas = g["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ConfigError(f"tiermem: CPULion betas={betas!r} is invalid: it must be two numbers, each in [0, 1]")
        check_hyper(
            "CPULion ", lr=number(g["lr"]), lion_beta1=betas[0], lion_beta2=betas[1], weight_decay=g["weight_decay"]
        )

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], g: dict[str, Any]) -> None:
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)

    def _plan(self, p: torch.Tensor, state: dict[str, Any], g: dict[str, Any]) -> Plan:
        return Plan(_run.LION, (state["exp_avg"],))

    def _hyper(self, g: dict[str, Any], step: int, variant: tuple) -> LionHyper:
        b1, b2 = g["betas"]
        return make_hyper(
            LionHyper, step=step, lr=g["lr"], lion_beta1=b1, lion_beta2=b2, weight_decay=g["weight_decay"]
        )


@checked_arguments
class CPUAdafactor(CPUOptimizer):
    """torch.optim.Adafactor (factored second moment of the last two dimensions, relative step size,
    update clipping), in the fewest passes its reductions allow. State as torch's: ``row_var`` and
    ``col_var`` (two or more dimensions) or ``variance``, and ``step``.

    Args:
        params: the parameters to optimize, or param groups (dicts), as ``torch.optim`` takes them;
            CPU tensors.
        lr: learning rate (relative step size).
        beta2_decay: the exponent of the second moment's decay.
        eps: ``(eps1, eps2)``: the term added to the squared gradient (None: the dtype's smallest
            normal number) and the floor of the parameter's RMS.
        d: clipping threshold of the update's RMS.
        weight_decay: decoupled weight decay.
        maximize: maximize the objective instead of minimizing it.
        check_finite: check every gradient for inf/NaN before any update; a step that finds one
            changes nothing and sets ``last_step_skipped``. False skips the check.
        bf16_stochastic_round: take bf16 parameters and keep no fp32 copy, rounding each update
            stochastically (NOTE [Stochastic rounding bits]).
        sr_seed: the seed of that rounding (default: ``torch.initial_seed()`` when built).
    """

    def __init__(
        self,
        params: Params,
        lr: Number = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[Optional[float], float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        check_finite: bool = True,
        bf16_stochastic_round: bool = False,
        sr_seed: Optional[int] = None,
    ):
        super().__init__(
            params,
            dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay, maximize=maximize),
            check_finite=check_finite,
            bf16_stochastic_round=bf16_stochastic_round,
            sr_seed=sr_seed,
        )

    def _check_group(self, g: dict[str, Any]) -> None:
        eps = g["eps"]
        if not (isinstance(eps, (tuple, list)) and len(eps) == 2):
            raise ConfigError(f"tiermem: CPUAdafactor eps={eps!r} is invalid: it must be (eps1 or None, eps2)")
        check_adafactor(
            "CPUAdafactor ",
            lr=number(g["lr"]),
            beta2_decay=g["beta2_decay"],
            eps1=eps[0],
            eps2=eps[1],
            d=g["d"],
            weight_decay=g["weight_decay"],
            maximize=g["maximize"],
        )

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], g: dict[str, Any]) -> None:
        if p.dim() > 1:
            state["row_var"] = p.new_zeros((*p.shape[:-1], 1), dtype=torch.float32)
            state["col_var"] = p.new_zeros((*p.shape[:-2], 1, p.shape[-1]), dtype=torch.float32)
        else:
            state["variance"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)

    def _state_spec(self, p: torch.Tensor, key: str, state: dict[str, Any]) -> Optional[tuple[torch.dtype, int]]:
        shape = tuple(p.shape)
        numel = {
            "row_var": math.prod(shape[:-1]),
            "col_var": math.prod(shape[:-2]) * shape[-1] if len(shape) > 1 else 0,
            "variance": p.numel(),
        }.get(key)
        return None if numel is None else (torch.float32, numel)

    def _plan(self, p: torch.Tensor, state: dict[str, Any], g: dict[str, Any]) -> Plan:
        shape = tuple(p.shape)
        _, tensors = factored_state(p, shape, state.get("row_var"), state.get("col_var"), state.get("variance"))
        return Plan(None, tensors, (shape,))

    def _hyper(self, g: dict[str, Any], step: int, variant: tuple) -> AdafactorHyper:
        return make_hyper(
            AdafactorHyper,
            step=step,
            lr=g["lr"],
            beta2_decay=g["beta2_decay"],
            eps1=g["eps"][0],
            eps2=g["eps"][1],
            d=g["d"],
            weight_decay=g["weight_decay"],
            maximize=g["maximize"],
        )

    def _functional(
        self, plan: Plan, p: torch.Tensor, grad: torch.Tensor, hyper: Any, sr: Optional[StochasticRound]
    ) -> None:
        """adafactor_step's passes (no single native pass: its reductions come between)."""
        (shape,) = plan.variant
        state = tuple(t for t in plan.state if t is not None)
        adafactor_update(p, grad, state, shape, None, hyper, stochastic_round=sr, check_finite=False, impl=None)


@checked_arguments
class CPUAdam8bit(CPUOptimizer):
    """Adam or AdamW (``adamw=True``) with 8-bit block-wise moments (NOTE [8-bit state] in
    tiermem/optim/kernels/quant.py), as bitsandbytes' and torchao's 8-bit AdamW: tensors of at least
    ``min_8bit_size`` elements keep ``exp_avg``/``exp_avg_sq`` as uint8 codes (flat) with fp32
    ``exp_avg_absmax``/``exp_avg_sq_absmax``; smaller ones keep fp32 moments and step as CPUAdam.

    Args:
        params: the parameters to optimize, or param groups (dicts), as ``torch.optim`` takes them;
            CPU tensors.
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and of its square.
        eps: term added to the denominator.
        weight_decay: decoupled (``adamw=True``) or L2 weight decay.
        adamw: AdamW when True (the default), Adam when False.
        min_8bit_size: the fewest elements a tensor needs for 8-bit moments.
        check_finite: check every gradient for inf/NaN before any update; a step that finds one
            changes nothing and sets ``last_step_skipped``. False skips the check.
        bf16_stochastic_round: take bf16 parameters and keep no fp32 copy, rounding each update
            stochastically (NOTE [Stochastic rounding bits]).
        sr_seed: the seed of that rounding (default: ``torch.initial_seed()`` when built).
    """

    _settings = (*CPUOptimizer._settings, "min_8bit_size")

    def __init__(
        self,
        params: Params,
        lr: Number = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw: bool = True,
        *,
        min_8bit_size: int = _quant.MIN_8BIT_NUMEL,
        check_finite: bool = True,
        bf16_stochastic_round: bool = False,
        sr_seed: Optional[int] = None,
    ):
        if not is_int(min_8bit_size) or min_8bit_size < 1:
            raise ConfigError(
                f"tiermem: CPUAdam8bit min_8bit_size={min_8bit_size!r} is invalid: it must be an int >= 1"
            )
        self.min_8bit_size = min_8bit_size
        super().__init__(
            params,
            dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw=adamw),
            check_finite=check_finite,
            bf16_stochastic_round=bf16_stochastic_round,
            sr_seed=sr_seed,
        )

    def _check_group(self, g: dict[str, Any]) -> None:
        check_adam_group("CPUAdam8bit ", g)

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], g: dict[str, Any]) -> None:
        if p.numel() < self.min_8bit_size:
            init_adam_state(p, state)
            return
        n, blocks = p.numel(), _quant.num_blocks(p.numel())
        state["exp_avg"] = torch.zeros(n, dtype=torch.uint8)
        state["exp_avg_absmax"] = torch.zeros(blocks, dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros(n, dtype=torch.uint8)
        state["exp_avg_sq_absmax"] = torch.zeros(blocks, dtype=torch.float32)

    def _fill_group(self, group: dict[str, Any], defaults: dict[str, Any]) -> None:
        fill_adamw(group, defaults)
        super()._fill_group(group, defaults)

    def _state_spec(self, p: torch.Tensor, key: str, state: dict[str, Any]) -> Optional[tuple[torch.dtype, int]]:
        n = p.numel()
        if "exp_avg_absmax" not in state:  # fp32 moments, as CPUAdam
            return (torch.float32, n) if key in ("exp_avg", "exp_avg_sq") else None
        blocks = _quant.num_blocks(n)
        specs = {"exp_avg": (torch.uint8, n), "exp_avg_sq": (torch.uint8, n)}
        specs.update({"exp_avg_absmax": (torch.float32, blocks), "exp_avg_sq_absmax": (torch.float32, blocks)})
        return specs.get(key)

    def _check_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        super()._check_state(p, state)
        eight_bit = "exp_avg_absmax" in state if state else p.numel() >= self.min_8bit_size
        if eight_bit and not p.is_contiguous():
            raise ConfigError(
                f"tiermem: CPUAdam8bit got a non-contiguous parameter of shape {tuple(p.shape)}: its 8-bit "
                f"state is blocked along the flat tensor; pass contiguous parameters (or raise "
                f"min_8bit_size above its {p.numel()} elements)"
            )

    def _plan(self, p: torch.Tensor, state: dict[str, Any], g: dict[str, Any]) -> Plan:
        if "exp_avg_absmax" not in state:  # a small tensor: fp32 moments, as CPUAdam
            return Plan(_run.ADAM, (state["exp_avg"], state["exp_avg_sq"]))
        return Plan(
            _run.ADAM8BIT, (state["exp_avg"], state["exp_avg_absmax"], state["exp_avg_sq"], state["exp_avg_sq_absmax"])
        )

    def _hyper(self, g: dict[str, Any], step: int, variant: tuple) -> AdamHyper:
        return adam_hyper(g, step)

    def _functional(
        self, plan: Plan, p: torch.Tensor, grad: torch.Tensor, hyper: Any, sr: Optional[StochasticRound]
    ) -> None:
        if plan.kernel is _run.ADAM:
            adam_functional(plan, p, grad, hyper, sr)
        else:
            adam8bit_update(
                p.view(-1) if p.is_contiguous() else p,
                plan.state,
                grad.reshape(-1),
                None,
                hyper,
                stochastic_round=sr,
                check_finite=False,
                impl=None,
            )
