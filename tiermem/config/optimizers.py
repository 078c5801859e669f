"""The optimizer specs beyond Adam (NOTE [Optimizer specs] in tiermem/config/specs.py): ``SGD``,
``Adagrad``, ``Lion`` and the 8-bit Adams, each with torch's names and defaults (bitsandbytes' and
torchao's for the 8-bit ones, the paper's for Lion), the same param groups as ``AdamW``, and
``bf16_stochastic_round``; and ``Adafactor`` (torch's, factored state). TieredModel runs each with its fused CPU kernel (tiermem.optim) where the
optimizer state lives.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Mapping, Optional

from tiermem.config.argdocs import shares_args
from tiermem.config.kinds import Kind
from tiermem.config.rules import check_hyper
from tiermem.config.specs import SPEC_ARGS, Adam, AdamW, _Spec
from tiermem.errors import ConfigError, checked_arguments


@shares_args(SPEC_ARGS)
@checked_arguments
@dataclass(frozen=True, kw_only=True, repr=False)
class SGD(_Spec):
    """SGD with momentum, dampening, Nesterov and weight decay, like ``torch.optim.SGD``. The
    momentum buffer exists when some group's momentum is not 0 (then every group's must be).

    Args:
        lr: learning rate.
        weight_decay: weight decay (an L2 penalty added to the gradient, as torch's).
        momentum: momentum factor (0: plain SGD, no buffer).
        dampening: dampening of the momentum.
        nesterov: Nesterov momentum.
        maximize: maximize the objective instead of minimizing it.
    """

    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    maximize: bool = False

    kind: ClassVar[Kind] = Kind.SGD
    HYPER: ClassVar[tuple[str, ...]] = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")
    OFF: ClassVar[tuple[str, ...]] = ()
    WHAT: ClassVar[str] = "SGD"

    def __post_init__(self) -> None:
        super().__post_init__()
        momenta = self.group_values("momentum")
        if len({m != 0 for m in momenta}) > 1:
            raise ConfigError(
                f"tiermem: SGD: some param groups have momentum 0 and others not ({momenta}); tiermem "
                f"keeps a momentum buffer for all parameters or none: give every group momentum > 0 "
                f"(or all 0)"
            )
        for i, (m, d, n) in enumerate(zip(momenta, self.group_values("dampening"), self.group_values("nesterov"))):
            if n and (m <= 0 or d != 0):
                raise ConfigError(
                    f"tiermem: SGD group {i}: nesterov=True needs momentum > 0 and dampening = 0 (got "
                    f"momentum={m}, dampening={d}), as torch.optim.SGD"
                )

    def state_options(self) -> dict[str, Any]:
        return {"momentum": any(m != 0 for m in self.group_values("momentum"))}


@shares_args(SPEC_ARGS)
@checked_arguments
@dataclass(frozen=True, kw_only=True, repr=False)
class Adagrad(_Spec):
    """Adagrad, like ``torch.optim.Adagrad`` (``initial_accumulator_value`` one for all groups).

    Args:
        lr: learning rate.
        weight_decay: weight decay (an L2 penalty added to the gradient, as torch's).
        lr_decay: learning rate decay.
        eps: term added to the denominator for numerical stability.
        initial_accumulator_value: the starting value of the sum of squared gradients.
        maximize: maximize the objective instead of minimizing it.
    """

    lr: float = 1e-2
    lr_decay: float = 0.0
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0
    maximize: bool = False

    kind: ClassVar[Kind] = Kind.ADAGRAD
    HYPER: ClassVar[tuple[str, ...]] = (
        "lr",
        "lr_decay",
        "weight_decay",
        "initial_accumulator_value",
        "eps",
        "maximize",
    )
    OFF: ClassVar[tuple[str, ...]] = ()
    WHAT: ClassVar[str] = "Adagrad"

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(set(self.group_values("initial_accumulator_value"))) > 1:
            raise ConfigError(
                "tiermem: Adagrad: param groups set different initial_accumulator_value; tiermem "
                "starts every parameter's sum at one value: set it on the optimizer, not per group"
            )

    def state_options(self) -> dict[str, Any]:
        return {"initial_accumulator_value": float(self.initial_accumulator_value)}


@shares_args(SPEC_ARGS)
@checked_arguments
@dataclass(frozen=True, kw_only=True, repr=False)
class Lion(_Spec):
    """Lion (Chen et al. 2023, "Symbolic discovery of optimization algorithms"): the sign of an
    interpolated momentum, decoupled weight decay; defaults as the paper's (lr 1e-4, betas (0.9, 0.99)).

    Args:
        lr: learning rate.
        weight_decay: weight decay (decoupled).
        betas: the interpolation of the update's momentum and the momentum's decay.
    """

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.99)

    kind: ClassVar[Kind] = Kind.LION
    HYPER: ClassVar[tuple[str, ...]] = ("lr", "betas", "weight_decay")
    RULES: ClassVar[Mapping[str, str]] = MappingProxyType({"betas": "lion_betas"})
    OFF: ClassVar[tuple[str, ...]] = ()
    WHAT: ClassVar[str] = "Lion"


@shares_args(SPEC_ARGS)
@checked_arguments
@dataclass(frozen=True, kw_only=True, repr=False)
class Adafactor(_Spec):
    """Adafactor, like ``torch.optim.Adafactor`` (its names and defaults): the second moment of a
    parameter of two or more dimensions factored into one value per row and one per column of its
    last two dimensions (a vector keeps one per element), no first moment, the step size relative to
    the weights' RMS. Its state is a few bytes per row and column of each matrix beside the master
    weights (NOTE [State formats]); under data parallelism, pass ``process_group=False``.

    Args:
        lr: learning rate (the most the relative step size may be).
        weight_decay: weight decay (decoupled).
        beta2_decay: the exponent of the second moment's decay (``1 - step ** beta2_decay``).
        eps: ``(eps1, eps2)``: the term added to the squared gradient (None: fp32's machine
            epsilon) and the floor of the weights' RMS that scales the update.
        d: clipping threshold of the update's RMS.
        maximize: maximize the objective instead of minimizing it.
    """

    lr: float = 1e-2
    beta2_decay: float = -0.8
    eps: tuple[Optional[float], float] = (None, 1e-3)
    d: float = 1.0
    maximize: bool = False

    kind: ClassVar[Kind] = Kind.ADAFACTOR
    HYPER: ClassVar[tuple[str, ...]] = ("lr", "beta2_decay", "eps", "d", "weight_decay", "maximize")
    RULES: ClassVar[Mapping[str, str]] = MappingProxyType({"eps": "adafactor_eps"})
    OFF: ClassVar[tuple[str, ...]] = ()
    WHAT: ClassVar[str] = "Adafactor"


@dataclass(frozen=True, kw_only=True, repr=False)
class _EightBit:
    """Block-wise 8-bit moments (NOTE [8-bit state] in tiermem/optim/kernels/quant.py); parameters with
    fewer than ``min_8bit_size`` elements keep fp32 moments, as bitsandbytes and torchao do. Mixed in
    before an Adam spec: its field joins the spec's, its check follows the spec's."""

    min_8bit_size: int = 4096

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]  # the Adam spec's, next in the mixed class's MRO
        check_hyper(f"{type(self).__name__}.", min_8bit_size=self.min_8bit_size)

    def state_options(self) -> dict[str, Any]:
        return {"min_8bit_size": self.min_8bit_size}


@shares_args(SPEC_ARGS)
@checked_arguments
@dataclass(frozen=True, kw_only=True, repr=False)
class AdamW8bit(_EightBit, AdamW):
    """AdamW with 8-bit moments: bitsandbytes' ``AdamW8bit`` and torchao's ``AdamW8bit`` by name.

    Args:
        lr: learning rate.
        weight_decay: weight decay (decoupled).
        betas: coefficients of the running averages of the gradient and of its square.
        eps: term added to the denominator for numerical stability.
        min_8bit_size: parameters with fewer elements keep fp32 moments.
    """

    kind: ClassVar[Kind] = Kind.ADAMW8BIT


@shares_args(SPEC_ARGS)
@checked_arguments
@dataclass(frozen=True, kw_only=True, repr=False)
class Adam8bit(_EightBit, Adam):
    """Adam (L2 decay) with 8-bit moments: bitsandbytes' ``Adam8bit`` by name.

    Args:
        lr: learning rate.
        weight_decay: weight decay (an L2 penalty added to the gradient).
        betas: coefficients of the running averages of the gradient and of its square.
        eps: term added to the denominator for numerical stability.
        min_8bit_size: parameters with fewer elements keep fp32 moments.
    """

    kind: ClassVar[Kind] = Kind.ADAM8BIT


__all__ = ["Adafactor", "Adagrad", "Adam8bit", "AdamW8bit", "Lion", "SGD"]
