"""Frozen, validated configuration: optimizer hyperparameter specs and their param groups (the
precisions live in :mod:`tiermem.config.precision`, the hyperparameters' rules in
:mod:`tiermem.config.rules`, both re-exported here)."""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Mapping, Optional, cast

import torch

from tiermem.config.argdocs import shares_args
from tiermem.config.kinds import Kind
from tiermem.config.precision import (
    PRECISION_CHOICES as PRECISION_CHOICES,
    PRECISIONS as PRECISIONS,
    CpuFeatures as CpuFeatures,
    auto_precision as auto_precision,
    precision_of as precision_of,
    resolve_precision as resolve_precision,
    working_dtype as working_dtype,
)
from tiermem.config.rules import (
    _ADAM_RULES,
    ALL_GROUP_HYPER as ALL_GROUP_HYPER,
    check_adam_hyper as check_adam_hyper,
    check_hyper as check_hyper,
    invalid as invalid,
    is_int as is_int,
    is_number as is_number,
)
from tiermem.errors import ConfigError, checked_arguments

log = logging.getLogger(__name__)


# NOTE [Param groups]
# An optimizer spec defines its param groups: each a name and the hyperparameters it sets over the
# spec's own (``group_defaults``), and which group each parameter joins (``group_of``). The
# planner lists every group's parameters (tiermem.plan.placement.ParamGroup): the trainable ones,
# and the frozen ones that join it once unfrozen. At construction each bucket holds one group's
# parameters (one fused Adam call, one set of hyperparameters); ``tm.optimizer.param_groups``
# shows the groups in this order, each with its ``name`` and ``param_names``, which lr schedulers
# drive and checkpoints keep. Membership is the groups' ``param_names`` from then on: the step
# reads each parameter's hyperparameters from the group that lists it, so
# ``tm.optimizer.add_param_group`` may move a parameter to a new group (tiermem.train.step.groups).
# Two kinds of spec:
# - rule groups (``AdamW(lr=...)``): "decay" and "no_decay" (weight decay 0, from
#   ``no_decay``/``no_decay_1d``); the first group is always there (it may hold no parameter), a
#   later one only when some parameter, trainable or frozen, joins it;
# - given groups (``AdamW(groups, lr=...)``, or a torch optimizer read by tiermem.config.torch_optim):
#   torch-style groups, each with hyperparameters of its own, matched to the model's parameters by
#   identity; every group is kept, in the order given, empty or not (an lr scheduler's per-group
#   lambdas follow that order).
@dataclass(frozen=True)
class GroupSpec:
    """One param group as a spec defines it (NOTE [Param groups])."""

    name: str
    #: the hyperparameters this group sets over the spec's (e.g. ``{"weight_decay": 0.0}``)
    overrides: Mapping[str, Any] = field(default_factory=dict)
    #: a group the user gave: kept even when no parameter joins it
    given: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "overrides", MappingProxyType(dict(self.overrides)))


@dataclass(frozen=True, eq=False)
class GivenGroup:
    """A torch-style param group as given to a spec: its tensors and the hyperparameters it sets."""

    name: str
    params: tuple[torch.Tensor, ...]
    overrides: Mapping[str, Any]


#: the hyperparameters a param group may set (torch's names)
GROUP_HYPER = ("lr", "betas", "eps", "weight_decay")
#: torch group keys that choose how torch runs its update, never its numbers: accepted and ignored
TORCH_NO_EFFECT = ("foreach", "fused", "capturable", "differentiable")
#: torch group keys for features tiermem's Adam has not: accepted only when off
TORCH_OFF = ("amsgrad", "maximize")


def _number(v: Any) -> Any:
    """A one-element tensor (torch optimizers allow one for lr and betas) as the number it holds."""
    return v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v


def _tensors(where: str, params: Any) -> list[torch.Tensor]:
    """A group's ``params``: a tensor, or an iterable of tensors or of (name, tensor) pairs (torch's)."""
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, (set, frozenset, dict, str)) or not hasattr(params, "__iter__"):
        raise ConfigError(
            f"tiermem: {where}params is a {type(params).__name__}; give a group's parameters as a "
            f"tensor, or a list of tensors or of (name, tensor) pairs (an ordered sequence, not a set)"
        )
    out = []
    for item in params:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            item = item[1]  # torch 2.x takes named parameters too
        if not isinstance(item, torch.Tensor):
            raise ConfigError(
                f"tiermem: {where}params holds a {type(item).__name__}; a group holds tensors (the model's parameters)"
            )
        out.append(item)
    return out


def read_groups(
    where: str,
    given: Any,
    *,
    hyper: tuple[str, ...] = GROUP_HYPER,
    off: tuple[str, ...] = TORCH_OFF,
    rules: Optional[Mapping[str, str]] = None,
    what: str = "Adam",
) -> tuple[GivenGroup, ...]:
    """Torch-style param groups (as ``torch.optim.AdamW(params, ...)`` takes them: an iterable of
    tensors, or of dicts with ``"params"`` and the hyperparameters the group sets) checked and
    normalised. ``where``: what the field names are read after (``"AdamW."``); ``hyper``: the keys
    a group may set (checked by the rule of their name, or of ``rules[name]``), ``off``: keys taken
    only when False, ``what``: the optimizer, as errors name it."""
    out: list[GivenGroup] = []
    seen: dict[int, int] = {}  # id of a tensor -> the group that holds it
    for i, g in enumerate(_group_dicts(where, given)):
        at = f"{where}params[{i}]."
        if "params" not in g:
            raise ConfigError(f"tiermem: {at[:-1]} has no 'params'; give each group its parameters as 'params'")
        tensors = _tensors(at, g["params"])
        for t in tensors:
            if id(t) in seen:
                raise ConfigError(
                    f"tiermem: {at[:-1]} repeats a parameter of group {seen[id(t)]} (shape "
                    f"{tuple(t.shape)}); a parameter belongs to one group"
                )
            seen[id(t)] = i
        name, overrides = _group_settings(at, g, f"group{i}", hyper=hyper, off=off, what=what)
        for k, v in overrides.items():
            if k in hyper:
                check_hyper(at, **{(rules or {}).get(k, k): v})
        if "betas" in overrides:
            overrides["betas"] = (float(overrides["betas"][0]), float(overrides["betas"][1]))
        out.append(GivenGroup(name, tuple(tensors), MappingProxyType(overrides)))
    names = [g.name for g in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"tiermem: {where}params names groups {twice} more than once; give each group its own name")
    return tuple(out)


def _group_dicts(where: str, given: Any) -> list[dict[str, Any]]:
    """``read_groups``' argument as a list of torch-style group dicts (bare tensors: one group)."""
    items: Optional[list[Any]] = [given] if isinstance(given, (torch.Tensor, dict)) else None
    if items is None:
        if isinstance(given, (set, frozenset, str)) or not hasattr(given, "__iter__"):
            what = repr(given) if isinstance(given, (int, float, str)) else f"a {type(given).__name__}"
            raise ConfigError(
                f"tiermem: {where}params={what} is invalid: the one positional argument is the "
                f"model's parameters or torch-style param groups (a list of dicts with 'params'), as "
                f"torch.optim takes them; pass hyperparameters by keyword (lr=...)"
            )
        items = list(given)
    if not items:
        raise ConfigError(
            f"tiermem: {where}params is empty; give the model's parameters or param groups, or leave "
            f"params out (every trainable parameter in the groups by rule)"
        )
    if all(isinstance(g, dict) for g in items):
        return items
    if not any(isinstance(g, dict) for g in items):
        return [{"params": items}]
    raise ConfigError(f"tiermem: {where}params mixes tensors and param groups (dicts); give either")


def _group_settings(
    at: str, g: Mapping[str, Any], name: str, *, hyper: tuple[str, ...], off: tuple[str, ...], what: str
) -> tuple[str, dict[str, Any]]:
    """A group dict's name (``name`` when it gives none) and the hyperparameters it sets (one-element
    tensors read as numbers; torch's Adam ``decoupled_weight_decay`` as ``adamw``), not yet checked;
    a key the optimizer does not take is an error."""
    overrides: dict[str, Any] = {}
    for key, value in g.items():
        if key in ("params", "param_names"):
            continue
        if key == "name":
            if not isinstance(value, str) or not value:
                raise invalid(at, "name", value, "a non-empty str")
            name = value
        elif key in hyper:
            betas = key == "betas" and isinstance(value, (tuple, list))
            overrides[key] = tuple(_number(b) for b in value) if betas else _number(value)
        elif key == "decoupled_weight_decay" and "betas" in hyper and "adamw" not in off:  # torch's Adam -> AdamW
            if not isinstance(value, bool):
                raise invalid(at, key, value, "True or False")
            overrides["adamw"] = value
        elif key in off:
            if value is not False:
                raise ConfigError(f"tiermem: {at}{key}={value!r}: tiermem's {what} has no {key}; leave it False")
        elif key not in TORCH_NO_EFFECT:
            raise ConfigError(
                f"tiermem: {at[:-1]} sets {key!r}, which tiermem's {what} does not take; a group "
                f"takes 'params', 'name' and {', '.join(repr(k) for k in hyper)}"
            )
    return name, overrides


DECAY = GroupSpec("decay")
NO_DECAY = GroupSpec("no_decay", {"weight_decay": 0.0})


# NOTE [Optimizer specs]
# A spec names an optimizer (``kind``: the kernel family of tiermem/optim/formats.py, which the
# planner turns into each parameter's state format), its hyperparameters (``HYPER``: the keys a
# param group holds, in order, each checked by the rule of its name or of ``RULES[name]``) and its
# groups (NOTE [Param groups]). ``bf16_stochastic_round=True`` (bf16 precision only) keeps the
# master weights in bf16, each update rounded stochastically into them (NOTE [Stochastic rounding
# bits] in tiermem/optim/kernels/sr.py).
# The fields every spec takes are documented once (SPEC_ARGS, on each spec's constructor), a spec's
# Args list its hyperparameters. Adam and AdamW are here; the others in tiermem/config/optimizers.py.
#: the fields every spec takes, documented once: each spec's constructor shows them (config/argdocs.py)
SPEC_ARGS = """Besides its hyperparameters, every spec takes these.

Args:
    params: optional, the one positional argument: torch-style param groups (the model's
        parameters, or dicts with ``"params"``, the hyperparameters each group sets and a
        ``"name"``); every trainable parameter must be in one (NOTE [Param groups]).
    no_decay: without ``params``: fnmatch patterns of parameter names that get no weight decay
        (e.g. ``("*.bias", "*.ln_*")``).
    no_decay_1d: without ``params``: True exempts every parameter with fewer than two
        dimensions (biases and norm weights in most models).
    bf16_stochastic_round: in bf16 precision, keep bf16 master weights and round each update
        into them stochastically (seeded per parameter, step and element), no fp32 master.
"""


@dataclass(frozen=True, kw_only=True)
class _Spec:
    """What every optimizer spec shares: the param groups, the rule groups and the master's dtype.
    ``params`` (optional, the one positional argument): torch-style param groups, as torch
    optimizers take them (the model's parameters, or dicts with ``"params"`` and the
    hyperparameters each group sets, ``"name"`` too); every trainable parameter must be in one
    (NOTE [Param groups]). Without them, ``no_decay`` lists fnmatch patterns of parameter names
    that get no weight decay (e.g. ``("*.bias", "*.ln_*")``) and ``no_decay_1d=True`` exempts every
    parameter with fewer than two dimensions, which covers biases and norm weights in most models."""

    params: Any = field(default=None, kw_only=False, repr=False, compare=False)
    lr: float = 1e-3
    weight_decay: float = 0.0
    no_decay: tuple[str, ...] = ()
    no_decay_1d: bool = False
    bf16_stochastic_round: bool = False
    #: id(tensor) -> index of its given group (NOTE [Param groups])
    _member: Mapping[int, int] = field(init=False, repr=False, compare=False, default_factory=dict)

    kind: ClassVar[Kind] = Kind.ADAM
    HYPER: ClassVar[tuple[str, ...]] = GROUP_HYPER
    RULES: ClassVar[Mapping[str, str]] = MappingProxyType({})
    OFF: ClassVar[tuple[str, ...]] = TORCH_OFF  # torch keys taken only when False
    WHAT: ClassVar[str] = "Adam"

    def __post_init__(self) -> None:
        where = f"{type(self).__name__}."
        for name in self.HYPER:
            value = getattr(self, name)
            value = tuple(_number(b) for b in value) if isinstance(value, (tuple, list)) else _number(value)
            check_hyper(where, **{self.RULES.get(name, name): value})
            kept = tuple(None if b is None else float(b) for b in value) if isinstance(value, tuple) else value
            object.__setattr__(self, name, kept)
        check_hyper(where, bf16_stochastic_round=self.bf16_stochastic_round)
        nd = self.no_decay
        if isinstance(nd, (set, frozenset)):
            nd = sorted(nd, key=str)  # one order in every process (the ranks compare their configurations)
        nd = (nd,) if isinstance(nd, str) else tuple(nd) if isinstance(nd, (tuple, list)) else None
        if nd is None or not all(isinstance(p, str) for p in nd):
            raise invalid(where, "no_decay", self.no_decay, "a name pattern or a tuple of them, such as ('*.bias',)")
        object.__setattr__(self, "no_decay", nd)
        if not isinstance(self.no_decay_1d, bool):
            raise invalid(where, "no_decay_1d", self.no_decay_1d, "True or False")
        if self.params is not None:
            if nd or self.no_decay_1d:
                raise ConfigError(
                    f"tiermem: {where}no_decay/no_decay_1d choose groups by rule; with param groups "
                    f"given, put the parameters without weight decay in a group of their own with "
                    f"'weight_decay': 0.0"
                )
            groups = read_groups(where, self.params, hyper=self.HYPER, off=self.OFF, rules=self.RULES, what=self.WHAT)
            object.__setattr__(self, "params", groups)
            object.__setattr__(
                self, "_member", MappingProxyType({id(t): i for i, g in enumerate(groups) for t in g.params})
            )

    @property
    def given(self) -> Optional[tuple[GivenGroup, ...]]:
        """The param groups given (NOTE [Param groups]), or None when groups follow the rule."""
        return cast(Optional[tuple[GivenGroup, ...]], self.params)  # read_groups' result, once constructed

    def decays(self, name: str, param: torch.Tensor) -> bool:
        """Whether weight decay applies to the parameter ``name`` under the rule groups."""
        if self.no_decay_1d and param.dim() < 2:
            return False
        return not any(fnmatch.fnmatchcase(name, p) for p in self.no_decay)

    def param_groups(self) -> tuple[GroupSpec, ...]:
        """The param groups this spec defines, in order (NOTE [Param groups])."""
        if self.params is None:
            return (DECAY, NO_DECAY)
        return tuple(GroupSpec(g.name, g.overrides, given=True) for g in self.params)

    def group_of(self, name: str, param: torch.Tensor) -> Optional[int]:
        """The index in :meth:`param_groups` of the group the parameter ``name`` joins; None when
        groups were given and none holds it."""
        if self.params is None:
            return 0 if self.decays(name, param) else 1
        return self._member.get(id(param))

    def group_defaults(self) -> dict[str, Any]:
        """The keys torch optimizers keep in each param group (so lr schedulers work)."""
        return {name: getattr(self, name) for name in self.HYPER}

    def group_values(self, name: str) -> list[Any]:
        """``name``'s value in every group this spec defines (the spec's own where a group sets none)."""
        return [g.overrides.get(name, getattr(self, name)) for g in self.param_groups()]

    def state_options(self) -> dict[str, Any]:
        """What the state format depends on besides ``kind`` (tiermem.optim.formats.state_format)."""
        return {}

    def __repr__(self) -> str:
        groups = "" if self.params is None else f"<{len(self.params)} param groups>, "
        hyper = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.HYPER)
        sr = ", bf16_stochastic_round=True" if self.bf16_stochastic_round else ""
        return (
            f"{type(self).__name__}({groups}{hyper}, no_decay={self.no_decay!r}, no_decay_1d={self.no_decay_1d!r}{sr})"
        )


@checked_arguments
@dataclass(frozen=True, kw_only=True, repr=False)
class _AdamSpec(_Spec):
    """Adam hyperparameters (and the groups, NOTE [Optimizer specs])."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    adamw = False  # class constant: how weight decay is applied

    def group_defaults(self) -> dict[str, Any]:
        return {**super().group_defaults(), "adamw": self.adamw}


@shares_args(SPEC_ARGS)
@checked_arguments
@dataclass(frozen=True, kw_only=True, repr=False)
class Adam(_AdamSpec):
    """Adam (L2 penalty added to the gradient), like ``torch.optim.Adam``.

    Args:
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and of its square.
        eps: term added to the denominator for numerical stability.
        weight_decay: L2 penalty added to the gradient.
    """


@shares_args(SPEC_ARGS)
@checked_arguments
@dataclass(frozen=True, kw_only=True, repr=False)
class AdamW(_AdamSpec):
    """AdamW (decoupled weight decay), like ``torch.optim.AdamW``; weight decay defaults to 0.01.

    Args:
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and of its square.
        eps: term added to the denominator for numerical stability.
        weight_decay: decoupled weight decay.
    """

    weight_decay: float = 1e-2
    adamw = True
    kind: ClassVar[Kind] = Kind.ADAMW


@checked_arguments
@dataclass(frozen=True, kw_only=True)
class LossScale:
    """fp16 dynamic loss scaling: start at ``init_scale``; on overflow skip the step and halve the
    scale, never below ``min_scale``; after ``growth_interval`` clean steps in a row, double it.
    The defaults are ``torch.amp.GradScaler``'s (no floor); DeepSpeed's are ``init_scale=2**16``,
    ``growth_interval=1000``, ``min_scale=1`` (what :func:`tiermem.from_deepspeed_config` uses).

    Args:
        init_scale: the first loss scale, a finite number > 0.
        growth_interval: clean steps in a row after which the scale doubles, an int >= 1.
        min_scale: the floor the scale never goes below (at most ``init_scale``); None: no floor.
    """

    init_scale: float = 2.0**16
    growth_interval: int = 2000
    min_scale: float | None = None

    def __post_init__(self) -> None:
        ok, rule = _ADAM_RULES["grad_scale"]  # the loss scale divides the grads: the same range
        if not ok(self.init_scale):
            raise invalid("LossScale.", "init_scale", self.init_scale, rule)
        if not is_int(self.growth_interval) or self.growth_interval < 1:
            raise invalid("LossScale.", "growth_interval", self.growth_interval, "an int >= 1")
        if self.min_scale is not None and not (ok(self.min_scale) and self.min_scale <= self.init_scale):
            raise invalid("LossScale.", "min_scale", self.min_scale, f"None or {rule}, at most init_scale")
