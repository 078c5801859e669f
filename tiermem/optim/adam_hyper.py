"""Adam's hyperparameters for one update, checked once and turned into the scalars the kernels use."""

from __future__ import annotations

import math
import struct
from dataclasses import InitVar, dataclass
from functools import cached_property
from typing import ClassVar

import torch

from tiermem.config.rules import check_adam_hyper

# Where each scalar sits in the fp32 tensor the compiled kernel reads (one tensor, so a new lr or
# step is new data, never a new compiled graph).
(
    INV_GRAD_SCALE,
    CLIP_COEF,
    ONE,
    DECAY_MUL,
    L2_DECAY,
    LERP_COEFF,
    BETA2,
    ONE_MINUS_BETA2,
    BC2_SQRT,
    EPS,
    NEG_STEP_SIZE,
) = range(11)
NUM_SCALARS = 11


_FLOATS = ("lr", "beta1", "beta2", "eps", "weight_decay", "grad_scale", "clip_coef")


@dataclass(frozen=True)
class AdamHyper:
    """One update's hyperparameters. ``step`` counts updates including this one (torch's ``state["step"]``
    after its increment). The derived values are computed in Python floats exactly as
    ``torch.optim.adam._single_tensor_adam`` computes them."""

    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw: bool = True
    grad_scale: float = 1.0
    clip_coef: float = 1.0
    prechecked: InitVar[bool] = False  # checked already, by the same rules (NOTE [Checked once a step])
    #: what an error names before the argument: the functional entry these hyperparameters are for
    where: ClassVar[str] = "adam_step "

    def __post_init__(self, prechecked: bool = False) -> None:
        if not prechecked:
            self._check()
        for name in _FLOATS:  # checked as given ("1e-3" is an error, not a cast), then Python floats
            object.__setattr__(self, name, float(getattr(self, name)))

    def _check(self) -> None:
        check_adam_hyper(
            self.where,
            step=self.step,
            lr=self.lr,
            beta1=self.beta1,
            beta2=self.beta2,
            eps=self.eps,
            weight_decay=self.weight_decay,
            grad_scale=self.grad_scale,
            clip_coef=self.clip_coef,
            adamw=self.adamw,
        )

    @property
    def l2(self) -> bool:
        """Adam (not AdamW) with weight decay: the decay is added to the gradient."""
        return not self.adamw and self.weight_decay != 0.0

    @property
    def inv_grad_scale(self) -> float:
        """1/grad_scale, which multiplies the gradient as torch.amp.GradScaler's unscale_ does."""
        return 1.0 / self.grad_scale

    @cached_property
    def lerp_weight(self) -> float:
        """torch's lerp_ weight, 1 - beta1, as the fp32 number its kernel uses."""
        return to_fp32(1.0 - self.beta1)

    @property
    def lerp_from_grad(self) -> bool:
        """torch's lerp_ computes from the far end when its weight is >= 0.5."""
        return abs(self.lerp_weight) >= 0.5

    @property
    def step_size(self) -> float:
        return self.lr / (1.0 - self.beta1**self.step)

    @property
    def bias_correction2_sqrt(self) -> float:
        return (1.0 - self.beta2**self.step) ** 0.5

    @cached_property
    def moment_bound(self) -> tuple[float, float]:
        """``(1 / K_t, 1 / (R * K_t))`` after this update (NOTE [8-bit moment bound] in
        tiermem/optim/kernels/quant.py), each rounded to fp32; (0.0, 0.0) where no bound exists."""
        return bound_scalars(self.beta1, self.beta2, self.step)

    def kernel_scalars(self) -> torch.Tensor:
        """The fp32 scalars of the compiled kernel. Each is rounded to fp32 once, here, as torch's CPU
        kernels round a Python scalar before using it with an fp32 tensor."""
        s = [0.0] * NUM_SCALARS
        s[INV_GRAD_SCALE], s[CLIP_COEF], s[ONE] = self.inv_grad_scale, self.clip_coef, 1.0
        # AdamW multiplies the weights by (1 - lr*wd); 1.0 leaves them bit-identical when it is off.
        s[DECAY_MUL] = 1.0 - self.lr * self.weight_decay if self.adamw and self.weight_decay else 1.0
        s[L2_DECAY] = self.weight_decay if self.l2 else 0.0
        # torch's lerp_: start + w*(end-start) when |w| < 0.5, else end + (w-1)*(end-start), w in fp32
        # (w - 1 is exact in fp32 for w in [0.5, 1]).
        w = self.lerp_weight
        s[LERP_COEFF] = w - 1.0 if self.lerp_from_grad else w
        s[BETA2], s[ONE_MINUS_BETA2] = self.beta2, 1.0 - self.beta2
        s[BC2_SQRT], s[EPS], s[NEG_STEP_SIZE] = self.bias_correction2_sqrt, self.eps, -self.step_size
        return torch.tensor(s, dtype=torch.float32)


#: R of NOTE [8-bit moment bound]: how far one requantization can move m^2 / v (the maps' cell centres
#: at their lowest decades: m up 5.5x, v down to 0.59x, so 5.5^2 / 0.59 = 51.2), and a little more
ROUNDING_SLACK = 64.0


def moment_bound(beta1: float, beta2: float, updates: int) -> float:
    """K_t of NOTE [8-bit moment bound]: the largest ``m**2 / v`` exact Adam reaches after ``updates``
    updates, ``(1 - beta1)**2 / (1 - beta2) * sum(gamma**j for j < updates)``, gamma = beta1**2 / beta2;
    inf where there is none (beta2 = 0, or past float range)."""
    if beta2 == 0.0:
        return math.inf
    gamma = beta1 * beta1 / beta2
    try:
        total = float(updates) if gamma == 1.0 else (1.0 - gamma**updates) / (1.0 - gamma)
    except OverflowError:
        return math.inf
    return (1.0 - beta1) ** 2 / (1.0 - beta2) * total


def bound_scalars(beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """``(1 / K_t, 1 / (R * K_t))`` at ``step`` (t, counting this update), as fp32 numbers; (0.0, 0.0)
    where no bound exists."""
    k = moment_bound(beta1, beta2, step)
    if k == 0.0 or math.isinf(k):
        return 0.0, 0.0
    return to_fp32(1.0 / k), to_fp32(1.0 / (ROUNDING_SLACK * k))


class Adam8bitHyper(AdamHyper):
    """:class:`AdamHyper` as ``adam8bit_step`` takes it (the same rules; its errors name it)."""

    where: ClassVar[str] = "adam8bit_step "


def to_fp32(x: float) -> float:
    """``x`` rounded to the nearest fp32 number (as torch rounds a Python scalar for an fp32 op)."""
    return struct.unpack("f", struct.pack("f", x))[0]
