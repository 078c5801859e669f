"""The hyperparameters of one SGD, Adagrad or Lion update (Adam's are tiermem/optim/adam_hyper.py), each
checked once and turned into the fp32 scalars the native kernels read.

Each ``scalars()`` list is laid out as its kernel in tiermem/optim/kernels/csrc/elementwise.py reads it;
each value is rounded to fp32 there, as torch's CPU kernels round a Python scalar. ``maximize`` is
folded into the sign of the gradient's multiplier (negating is exact, so this equals torch's
``-grad``), and flags (decay on, first step, Nesterov) are data: one kernel serves every setting.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, fields
from typing import Any, Optional

from tiermem.config.rules import check_hyper as _check_hyper, is_number
from tiermem.errors import ConfigError

_real = is_number  # NOTE [Numbers are not bools]
check_hyper = _check_hyper  # the one rule table, in tiermem/config/specs.py (specs check the same names)


class _Hyper:
    """Shared: checked on construction (as given, then as Python floats)."""

    where = ""
    step: int
    grad_scale: float
    clip_coef: float

    def __post_init__(self, prechecked: bool = False) -> None:
        if not prechecked:  # (a drop-in checked its group by the same rules this step)
            self._check({f.name: getattr(self, f.name) for f in fields(self)})  # type: ignore[arg-type]
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if _real(v) and f.name != "step":
                object.__setattr__(self, f.name, float(v))

    def _check(self, values: dict) -> None:
        check_hyper(self.where, **values)

    @property
    def grad_multiplier(self) -> float:
        """1/grad_scale, negated for ``maximize``: the gradient is ``grad * this * clip_coef``."""
        inv = 1.0 / self.grad_scale
        return -inv if getattr(self, "maximize", False) else inv


@dataclass(frozen=True)
class SGDHyper(_Hyper):
    step: int
    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    maximize: bool = False
    grad_scale: float = 1.0
    clip_coef: float = 1.0
    init_buffer: Optional[bool] = None  # None: at step 1 (the buffer is new), as torch's "buffer is None"
    prechecked: InitVar[bool] = False  # checked already, by the same rules (NOTE [Checked once a step])
    where = "sgd_step "

    def __post_init__(self, prechecked: bool = False) -> None:
        super().__post_init__(prechecked)
        if not prechecked and self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigError(
                f"tiermem: {self.where}nesterov=True needs momentum > 0 and dampening = 0 (got "
                f"momentum={self.momentum}, dampening={self.dampening}); as torch.optim.SGD"
            )

    def scalars(self) -> list[float]:
        return [
            self.grad_multiplier,
            self.clip_coef,
            self.weight_decay,
            float(self.weight_decay != 0),
            self.momentum,
            1.0 - self.dampening,
            float(self.first),
            float(self.nesterov),
            -self.lr,
        ]

    @property
    def first(self) -> bool:
        """Whether the momentum buffer is set to the gradient (torch: made from it) this step."""
        return self.step == 1 if self.init_buffer is None else self.init_buffer


@dataclass(frozen=True)
class AdagradHyper(_Hyper):
    step: int
    lr: float
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    eps: float = 1e-10
    maximize: bool = False
    grad_scale: float = 1.0
    clip_coef: float = 1.0
    prechecked: InitVar[bool] = False  # checked already, by the same rules (NOTE [Checked once a step])
    where = "adagrad_step "

    @property
    def clr(self) -> float:
        """torch's ``lr / (1 + (step - 1) * lr_decay)``."""
        return self.lr / (1 + (self.step - 1) * self.lr_decay)

    def scalars(self) -> list[float]:
        return [
            self.grad_multiplier,
            self.clip_coef,
            self.weight_decay,
            float(self.weight_decay != 0),
            -self.clr,
            self.eps,
        ]


@dataclass(frozen=True)
class LionHyper(_Hyper):
    step: int
    lr: float
    lion_beta1: float = 0.9
    lion_beta2: float = 0.99
    weight_decay: float = 0.0
    grad_scale: float = 1.0
    clip_coef: float = 1.0
    prechecked: InitVar[bool] = False  # checked already, by the same rules (NOTE [Checked once a step])
    where = "lion_step "

    @property
    def decay_mul(self) -> float:
        return 1.0 - self.lr * self.weight_decay if self.weight_decay != 0 else 1.0

    def scalars(self) -> list[float]:
        b1, b2 = self.lion_beta1, self.lion_beta2
        return [self.grad_multiplier, self.clip_coef, self.decay_mul, b1, 1.0 - b1, b2, 1.0 - b2, -self.lr]


def adam_scalars(hyper: Any) -> list[float]:
    """The native Adam kernel's scalars: AdamHyper.kernel_scalars(), its two flags, and (read by the
    8-bit kernel) 1 / bias_correction2_sqrt and the moment bound's 1 / K and 1 / (R K) (NOTE [8-bit
    moment bound])."""
    return hyper.kernel_scalars().tolist() + [
        float(hyper.l2),
        float(hyper.lerp_from_grad),
        1.0 / hyper.bias_correction2_sqrt,
        *hyper.moment_bound,
    ]
