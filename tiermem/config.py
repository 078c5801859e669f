"""Frozen, validated configuration: optimizer hyperparameter specs and precision."""
from __future__ import annotations

import fnmatch
import logging
import math
import numbers
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

import torch

from tiermem.errors import ConfigError, checked_arguments

log = logging.getLogger(__name__)

#: The working precisions: the dtype of the weights forward and backward use, by name. The one
#: list: ``tiermem plan`` (tiermem.plan.sizing) derives its precisions and bytes per element from it.
PRECISIONS: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


#: What ``precision=`` takes: a working precision, or "auto" for this device's (NOTE [Choosing the precision]).
PRECISION_CHOICES: tuple[str, ...] = (*PRECISIONS, "auto")


def working_dtype(precision: str) -> torch.dtype:
    try:
        return PRECISIONS[precision]
    except (KeyError, TypeError):
        raise ConfigError(f"tiermem: precision={precision!r} is not supported; "
                          f"use one of {', '.join(repr(p) for p in PRECISIONS)}") from None


def precision_of(dtype: torch.dtype) -> str:
    """The name of a working dtype (``torch.bfloat16`` -> ``"bf16"``)."""
    return next(name for name, d in PRECISIONS.items() if d == dtype)


# NOTE [Choosing the precision]
# ``precision="auto"`` becomes a working precision here, once, from the device the weights live on:
# - a GPU that computes bf16 natively (CUDA compute capability 8.0 and later, any ROCm device): "bf16";
# - an older GPU (Volta, Turing): "fp16", with dynamic loss scaling: its tensor cores run fp16 at
#   about 8x its fp32 rate, and it has no bf16 units (torch emulates bf16 there through fp32);
# - a CPU with AVX512-BF16 or AMX, when torch may use them (ATen's capability is an AVX512 level, and
#   ONEDNN_MAX_CPU_ISA/DNNL_MAX_CPU_ISA, when set, is not below AVX512_CORE_BF16): "bf16";
# - any other CPU (AVX2 only, ARM, ...): "fp32". Without those instructions torch has no fast bf16
#   matmul (on an AVX2 EPYC a bf16 F.linear took 11x its fp32 time) and fp16 is no better, so
#   fp32 is the fastest there and needs no loss scaling. A CPU never gets "fp16": where it has fast
#   fp16 (AVX512-FP16, AMX-FP16) it has AMX-BF16 too, and bf16 needs no loss scaling.
# The rule reads what the hardware and torch say, never a timing: the same answer every time on a
# machine, and on every rank alike. How much slower bf16 and fp16 are than fp32 on this CPU is
# measured once into the machine profile (tiermem/train/machine.py): an explicit "bf16" on a CPU
# where it is much slower gets one warning with the figures, and the cost model predicts compute
# at the rate of the precision in use (NOTE [Cost model]).
_BELOW_BF16_ISAS = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"})


@dataclass(frozen=True)
class CpuFeatures:
    """What decides whether this CPU computes bf16 natively (NOTE [Choosing the precision]).
    Tests make one up; :meth:`detect` asks torch."""

    capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX512", "AVX2", "DEFAULT", ...
    avx512_bf16: bool
    amx: bool
    onednn_max_isa: Optional[str] = None  # ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA), when set

    @classmethod
    def detect(cls) -> "CpuFeatures":
        def has(name: str) -> bool:  # private torch probes (torch >= 2.3): absent means "cannot tell", so no
            probe = getattr(torch.cpu, name, None)
            return bool(probe()) if probe is not None else False
        isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
        return cls(torch.backends.cpu.get_cpu_capability(), has("_is_avx512_bf16_supported"),
                   has("_is_amx_tile_supported"), isa or None)

    @property
    def native_bf16(self) -> bool:
        capped = self.onednn_max_isa is not None and self.onednn_max_isa.upper() in _BELOW_BF16_ISAS
        return (self.avx512_bf16 or self.amx) and self.capability.upper().startswith("AVX512") and not capped

    def __str__(self) -> str:
        isa = [n for n, on in (("AVX512-BF16", self.avx512_bf16), ("AMX", self.amx)) if on]
        cap = f"; oneDNN capped at {self.onednn_max_isa}" if self.onednn_max_isa else ""
        return f"{self.capability} ({'has ' + ', '.join(isa) if isa else 'no AVX512-BF16, no AMX'}{cap})"


def auto_precision(device: torch.device, *, cpu: Optional[CpuFeatures] = None) -> tuple[str, str]:
    """What ``precision="auto"`` is on ``device``, and why in words (NOTE [Choosing the precision]);
    ``cpu``: this CPU's features (None: detected)."""
    if device.type == "cuda":
        if torch.version.hip is not None:
            return "bf16", "a ROCm GPU computes bf16"
        major, minor = torch.cuda.get_device_capability(device)
        if major >= 8:
            return "bf16", f"a GPU of compute capability {major}.{minor} computes bf16"
        return "fp16", f"a GPU of compute capability {major}.{minor} has fp16 tensor cores and no bf16"
    cpu = CpuFeatures.detect() if cpu is None else cpu
    if cpu.native_bf16:
        return "bf16", f"this CPU computes bf16 natively: {cpu}"
    return "fp32", f"this CPU has no fast bf16 matmul: {cpu}"


def resolve_precision(precision: Any, device: torch.device, *, cpu: Optional[CpuFeatures] = None) -> str:
    """``precision`` checked, with "auto" made this device's working precision (NOTE [Choosing the
    precision])."""
    if precision == "auto":
        chosen, why = auto_precision(device, cpu=cpu)
        log.info("tiermem: precision='auto' is %r on %s: %s", chosen, device, why)
        return chosen
    if not (isinstance(precision, str) and precision in PRECISIONS):
        raise ConfigError(f"tiermem: precision={precision!r} is not supported; use one of "
                          f"{', '.join(repr(p) for p in PRECISION_CHOICES)} ('auto': bf16 where the device "
                          f"computes it natively, else fp32 on a CPU, fp16 on an older GPU)")
    return precision


# NOTE [Numbers are not bools]
# ``True`` is an int to Python, so every check of a number must also refuse a bool. The two
# functions below are that check, for every argument tiermem takes (the Adam rules table below,
# the policies' shares, TieredModel's and NvmeStore's arguments, DeepSpeed configs, checkpoint
# footers): a number is a real number but not a bool (ints, floats, numpy scalars); a count is
# an int but not a bool.
def is_number(v: Any) -> bool:
    """A real number that is not a bool (NOTE [Numbers are not bools])."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def is_int(v: Any) -> bool:
    """An int that is not a bool (NOTE [Numbers are not bools])."""
    return isinstance(v, int) and not isinstance(v, bool)


# NOTE [Adam hyperparameter rules]
# The rule for each Adam hyperparameter, by name, in one table that the three places taking them
# check against: the AdamW/Adam specs here, CPUAdam's arguments and adam_step's (through
# tiermem.optim._hyper.AdamHyper). Numbers follow NOTE [Numbers are not bools] (CPUAdam and
# adam_step check a one-element tensor, which torch optimizers allow for lr, as the number it holds).
def _finite_non_negative(v: Any) -> bool:
    return is_number(v) and 0 <= v < math.inf


def _unit(v: Any) -> bool:
    return is_number(v) and 0.0 <= v < 1.0


_FINITE_NON_NEGATIVE = (_finite_non_negative, "a finite number >= 0")
_ADAM_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "lr": _FINITE_NON_NEGATIVE,
    "betas": (lambda v: isinstance(v, (tuple, list)) and len(v) == 2 and all(_unit(b) for b in v),
              "two numbers, each in [0, 1)"),
    "beta1": (_unit, "a number in [0, 1)"),
    "beta2": (_unit, "a number in [0, 1)"),
    "eps": _FINITE_NON_NEGATIVE,
    "weight_decay": _FINITE_NON_NEGATIVE,
    "step": (lambda v: isinstance(v, int) and v >= 1, "a 1-based count of updates including this one, >= 1"),
    "grad_scale": (lambda v: is_number(v) and 2.0**-126 < v < 2.0**126,
                   "between 2**-126 and 2**126 (its reciprocal a normal fp32 number)"),
    "clip_coef": _FINITE_NON_NEGATIVE,
    "adamw": (lambda v: isinstance(v, bool), "True (AdamW: decoupled weight decay) or False (Adam: L2 penalty)"),
}


def _invalid(where: str, name: str, value: Any, rule: str) -> ConfigError:
    """The error for a value that breaks its rule. ``where`` is what the name is read after:
    ``"AdamW."`` for a field, ``"CPUAdam "`` or ``"adam_step "`` for an argument."""
    return ConfigError(f"tiermem: {where}{name}={value!r} is invalid: it must be {rule}; pass a value that is")


def check_adam_hyper(where: str, **values: Any) -> None:
    """Check each Adam hyperparameter given by the one rule for its name (NOTE [Adam
    hyperparameter rules]); raises :class:`ConfigError` naming the first that breaks it."""
    for name, value in values.items():
        ok, rule = _ADAM_RULES[name]
        if not ok(value):
            raise _invalid(where, name, value, rule)


# NOTE [Param groups]
# An optimizer spec defines its param groups: each a name and the hyperparameters it sets over the
# spec's own (``group_defaults``), and which group each trainable parameter joins (``group_of``).
# The planner lists every group's parameters (tiermem.plan.placement.ParamGroup), each bucket
# holds one group's parameters (one fused Adam call, one set of hyperparameters), and
# ``tm.optimizer.param_groups`` shows the groups in this order, which lr schedulers drive and
# checkpoints keep. The first group is always there (it may hold no parameter); a later one
# only when some parameter joins it. Today's specs define two: "decay" and "no_decay" (weight
# decay 0, from ``no_decay``/``no_decay_1d``); torch-style groups with hyperparameters of their
# own are more GroupSpecs, each with its overrides.
@dataclass(frozen=True)
class GroupSpec:
    """One param group as a spec defines it (NOTE [Param groups])."""

    name: str
    #: the hyperparameters this group sets over the spec's (e.g. ``{"weight_decay": 0.0}``)
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "overrides", MappingProxyType(dict(self.overrides)))


DECAY = GroupSpec("decay")
NO_DECAY = GroupSpec("no_decay", {"weight_decay": 0.0})


@checked_arguments
@dataclass(frozen=True, kw_only=True)
class _AdamSpec:
    """Adam hyperparameters. ``no_decay`` lists fnmatch patterns of parameter names that get no
    weight decay (e.g. ``("*.bias", "*.ln_*")``); ``no_decay_1d=True`` exempts every parameter with
    fewer than two dimensions, which covers biases and norm weights in most models."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    no_decay: tuple[str, ...] = ()
    no_decay_1d: bool = False

    adamw = False  # class constant: how weight decay is applied

    def __post_init__(self) -> None:
        where = f"{type(self).__name__}."
        check_adam_hyper(where, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        nd = self.no_decay
        if isinstance(nd, (set, frozenset)):
            nd = sorted(nd, key=str)  # one order in every process (the ranks compare their configurations)
        nd = (nd,) if isinstance(nd, str) else tuple(nd) if isinstance(nd, (tuple, list)) else None
        if nd is None or not all(isinstance(p, str) for p in nd):
            raise _invalid(where, "no_decay", self.no_decay, "a name pattern or a tuple of them, such as ('*.bias',)")
        object.__setattr__(self, "no_decay", nd)
        if not isinstance(self.no_decay_1d, bool):
            raise _invalid(where, "no_decay_1d", self.no_decay_1d, "True or False")

    def decays(self, name: str, param: torch.Tensor) -> bool:
        """Whether weight decay applies to the parameter ``name``."""
        if self.no_decay_1d and param.dim() < 2:
            return False
        return not any(fnmatch.fnmatchcase(name, p) for p in self.no_decay)

    def param_groups(self) -> tuple[GroupSpec, ...]:
        """The param groups this spec defines, in order (NOTE [Param groups])."""
        return (DECAY, NO_DECAY)

    def group_of(self, name: str, param: torch.Tensor) -> int:
        """The index in :meth:`param_groups` of the group the parameter ``name`` joins."""
        return 0 if self.decays(name, param) else 1

    def group_defaults(self) -> dict[str, Any]:
        """The keys torch optimizers keep in each param group (so lr schedulers work)."""
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps,
                "weight_decay": self.weight_decay, "adamw": self.adamw}


@checked_arguments
@dataclass(frozen=True, kw_only=True)
class Adam(_AdamSpec):
    """Adam (L2 penalty added to the gradient), like ``torch.optim.Adam``."""


@checked_arguments
@dataclass(frozen=True, kw_only=True)
class AdamW(_AdamSpec):
    """AdamW (decoupled weight decay), like ``torch.optim.AdamW``; weight decay defaults to 0.01."""

    weight_decay: float = 1e-2
    adamw = True


@checked_arguments
@dataclass(frozen=True, kw_only=True)
class LossScale:
    """fp16 dynamic loss scaling: start at ``init_scale``; on overflow skip the step and halve the
    scale, never below ``min_scale``; after ``growth_interval`` clean steps in a row, double it.
    The defaults are ``torch.amp.GradScaler``'s (no floor); DeepSpeed's are ``init_scale=2**16``,
    ``growth_interval=1000``, ``min_scale=1`` (what :func:`tiermem.from_deepspeed_config` uses)."""

    init_scale: float = 2.0**16
    growth_interval: int = 2000
    min_scale: float | None = None

    def __post_init__(self) -> None:
        ok, rule = _ADAM_RULES["grad_scale"]  # the loss scale divides the grads: the same range
        if not ok(self.init_scale):
            raise _invalid("LossScale.", "init_scale", self.init_scale, rule)
        if not is_int(self.growth_interval) or self.growth_interval < 1:
            raise _invalid("LossScale.", "growth_interval", self.growth_interval, "an int >= 1")
        if self.min_scale is not None and not (ok(self.min_scale) and self.min_scale <= self.init_scale):
            raise _invalid("LossScale.", "min_scale", self.min_scale, f"None or {rule}, at most init_scale")
