"""The rule of every optimizer hyperparameter tiermem takes, by name, and the checks of numbers
that refuse a bool: what the specs (:mod:`tiermem.config.specs`), the optimizers and the step functions
check their arguments against."""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, TypeGuard

from tiermem.errors import ConfigError


# NOTE [Numbers are not bools]
# ``True`` is an int to Python, so every check of a number must also refuse a bool. The two
# functions below are that check, for every argument tiermem takes (the Adam rules table below,
# the policies' shares, TieredModel's and NvmeStore's arguments, DeepSpeed configs, checkpoint
# footers): a number is a real number but not a bool (ints, floats, numpy scalars); a count is
# an int but not a bool.
def is_number(v: Any) -> TypeGuard[float]:
    """A real number that is not a bool (NOTE [Numbers are not bools])."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def is_int(v: Any) -> TypeGuard[int]:
    """An int that is not a bool (NOTE [Numbers are not bools])."""
    return isinstance(v, int) and not isinstance(v, bool)


# NOTE [Adam hyperparameter rules]
# The rule for each Adam hyperparameter, by name, in one table that the three places taking them
# check against: the AdamW/Adam specs (tiermem/config/specs.py), CPUAdam's arguments and adam_step's (through
# tiermem.optim.adam_hyper.AdamHyper). Numbers follow NOTE [Numbers are not bools] (CPUAdam and
# adam_step check a one-element tensor, which torch optimizers allow for lr, as the number it holds).
def _finite_non_negative(v: Any) -> bool:
    return is_number(v) and 0 <= v < math.inf


def _unit(v: Any) -> bool:
    return is_number(v) and 0.0 <= v < 1.0


_FINITE_NON_NEGATIVE = (_finite_non_negative, "a finite number >= 0")
_ADAM_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "lr": _FINITE_NON_NEGATIVE,
    "betas": (
        lambda v: isinstance(v, (tuple, list)) and len(v) == 2 and all(_unit(b) for b in v),
        "two numbers, each in [0, 1)",
    ),
    "beta1": (_unit, "a number in [0, 1)"),
    "beta2": (_unit, "a number in [0, 1)"),
    "eps": _FINITE_NON_NEGATIVE,
    "weight_decay": _FINITE_NON_NEGATIVE,
    "step": (lambda v: isinstance(v, int) and v >= 1, "a 1-based count of updates including this one, >= 1"),
    "grad_scale": (
        lambda v: is_number(v) and 2.0**-126 < v < 2.0**126,
        "between 2**-126 and 2**126 (its reciprocal a normal fp32 number)",
    ),
    "clip_coef": _FINITE_NON_NEGATIVE,
    "adamw": (lambda v: isinstance(v, bool), "True (AdamW: decoupled weight decay) or False (Adam: L2 penalty)"),
}


#: the rules of the other optimizers' hyperparameters (SGD, Adagrad, Lion: torch's names), checked by
#: :func:`check_hyper` with Adam's; Lion's betas may reach 1 (``lion_betas``)
_OTHER_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "momentum": (_finite_non_negative, "a finite number >= 0"),
    "dampening": (lambda v: is_number(v) and math.isfinite(v), "a finite number"),
    "nesterov": (lambda v: isinstance(v, bool), "True or False"),
    "maximize": (lambda v: isinstance(v, bool), "True or False"),
    "init_buffer": (lambda v: v is None or isinstance(v, bool), "None, True or False"),
    "lr_decay": _FINITE_NON_NEGATIVE,
    "initial_accumulator_value": _FINITE_NON_NEGATIVE,
    "lion_beta": (lambda v: is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "lion_betas": (
        lambda v: isinstance(v, (tuple, list)) and len(v) == 2 and all(is_number(b) and 0 <= b <= 1 for b in v),
        "two numbers, each in [0, 1]",
    ),
    "bf16_stochastic_round": (lambda v: isinstance(v, bool), "True or False"),
    # the 8-bit Adams' (specs and CPUAdam8bit): the fewest elements a tensor needs for 8-bit moments
    "min_8bit_size": (lambda v: is_int(v) and v >= 1, "an int >= 1"),
    # a generic optimizer's (NOTE [Generic optimizers]): its own constructor checked them
    "generic": (lambda v: True, "anything its optimizer takes"),
    # Adafactor's, as torch.optim.Adafactor names them (eps is the pair (eps1, eps2): ``adafactor_eps``)
    "beta2_decay": (lambda v: is_number(v) and -math.inf < v <= 0, "a number <= 0"),
    "eps1": (lambda v: v is None or _finite_non_negative(v), "None or a finite number >= 0"),
    "eps2": _FINITE_NON_NEGATIVE,
    "d": (lambda v: is_number(v) and 1 <= v < math.inf, "a finite number >= 1"),
    "adafactor_eps": (
        lambda v: (
            isinstance(v, (tuple, list))
            and len(v) == 2
            and (v[0] is None or _finite_non_negative(v[0]))
            and _finite_non_negative(v[1])
        ),
        "a pair (eps1 or None, eps2) of finite numbers >= 0",
    ),
}
#: every hyperparameter a param group of some tiermem optimizer may hold (what a checkpoint keeps)
ALL_GROUP_HYPER = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "momentum",
    "dampening",
    "nesterov",
    "maximize",
    "lr_decay",
    "initial_accumulator_value",
    "beta2_decay",
    "d",
)


def check_hyper(where: str, **values: Any) -> None:
    """Each value against the one rule for its name (Adam's table and the others'); the error names
    ``where`` (``"sgd_step "``, ``"SGD."``), the name and the value."""
    for name, value in values.items():
        key = "lion_beta" if name in ("lion_beta1", "lion_beta2") else name
        ok, rule = _ADAM_RULES[key] if key in _ADAM_RULES else _OTHER_RULES[key]
        if not ok(value):
            raise invalid(where, name.removeprefix("lion_").removeprefix("adafactor_"), value, rule)


def invalid(where: str, name: str, value: Any, rule: str) -> ConfigError:
    """The error for a value that breaks its rule. ``where`` is what the name is read after:
    ``"AdamW."`` for a field, ``"CPUAdam "`` or ``"adam_step "`` for an argument."""
    return ConfigError(f"tiermem: {where}{name}={value!r} is invalid: it must be {rule}; pass a value that is")


def check_adam_hyper(where: str, **values: Any) -> None:
    """Check each Adam hyperparameter given by the one rule for its name (NOTE [Adam
    hyperparameter rules]); raises :class:`ConfigError` naming the first that breaks it."""
    for name, value in values.items():
        ok, rule = _ADAM_RULES[name]
        if not ok(value):
            raise invalid(where, name, value, rule)
