"""The policy API: given what a tensor is, say where it lives.

A policy is pure: ``place(info) -> Tier`` with no I/O, no device calls and no state that the
manager mutates, so it can be tested with made-up :class:`TensorInfo` on any machine::

    class OptimStateOfEmbeddingOnNvme(Policy):
        def place(self, info):
            if info.kind is TensorClass.OPTIM_STATE and info.name.startswith("wte."):
                return Tier.NVME
            return ZeroOffload().place(info)

A policy that decides over the whole model (how much of the optimizer state fits on the device,
which parameters get it) overrides :meth:`Policy.for_model`: it is told about every trainable
parameter once, before any ``place`` call, and returns the policy to ask, itself still pure
(NOTE [Whole-model policies]).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import torch

from tiermem.config.rules import is_number
from tiermem.errors import ConfigError, OutOfTierMemory, fmt_bytes
from tiermem.types import TensorClass, TensorInfo, Tier


# NOTE [Whole-model policies]
# ``place(info)`` sees one tensor; a split such as "a quarter of the optimizer state on the device"
# needs the whole model. Before asking about any tensor, the planner calls ``for_model`` once with
# a :class:`ModelInfo` and asks the policy it returns from then on. That policy is an ordinary
# pure one (usually a frozen set of names decided from the ModelInfo), so the decision is made
# once, is visible in its repr, and every ``place`` answer stays a function of the info alone.
# The bound policy is a separate object, complete when made (ZeroOffload's DeviceShare, Auto's
# AutoChoice): nothing is set on a policy after it was built, and binding it again gives it back.
# The policy that was bound only answers what it knows without the model; asked about the rest
# it raises :func:`asked_alone`'s error. To build on such a policy, wrap it and forward
# ``for_model`` to it (as ActivationOffload does), rather than subclass it.
@dataclass(frozen=True)
class ModelInfo:
    """What a policy is told about the whole model before it places any tensor."""

    #: a PARAM info for every trainable parameter (tied weights once), in the order forward uses
    #: them (registration order): backward produces their gradients in the reverse order; for an
    #: inference-only model (``inference``), every parameter
    params: tuple[TensorInfo, ...]
    #: the working precision of the weights
    dtype: torch.dtype = torch.bfloat16
    #: bytes each tier may hold for this model (the Budgets, or the tier's capacity); a tier
    #: absent from the mapping is unbounded
    limits: Mapping[Tier, int] = field(default_factory=dict)

    #: the planner's judge of a candidate placement (NOTE [Choosing a placement]); None where no
    #: planner can judge (a ModelInfo made up in a test of a policy that needs none)
    evaluate: Optional[Callable[..., "Evaluation"]] = field(default=None, compare=False)
    #: no parameter trains: a model built for inference (``optimizer=None``, NOTE [Inference only]
    #: in tiermem/model/inference.py), whose weights are all that is placed
    inference: bool = False

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


# NOTE [Choosing a placement]
# A policy that chooses among placements (policies.Auto) cannot check one itself: the footprint,
# the budgets and the cost model sit above the policy layer. The planner passes its judge in
# ModelInfo.evaluate: ``evaluate(policy, profile=None, forward_backward=0.0, *, tokens=0)`` plans the
# buckets ``policy`` gives this model exactly as TieredModel would, and says whether the constructor
# would accept them (no refused combination, every tier within its limit) and how long a step is
# predicted to take, per stage (tiermem/plan/cost.py, NOTE [Cost model]; ``tokens`` of a step predict
# the compute at the precision's matmul rate when ``forward_backward`` is 0). ``profile``: a machine
# profile to use instead of this machine's (saved by ``tiermem bench``, measured on first use when none is).
# The judge keeps nothing of what it was asked: a policy bound from a profile keeps that profile as
# its ``profile`` (Auto's AutoChoice), which ``tm.report()`` predicts the measured step with.
@dataclass(frozen=True)
class Evaluation:
    """The planner's verdict on one candidate placement."""

    fits: bool
    stages: Mapping[str, float]  # predicted seconds per stage of a step
    need: Mapping[Tier, int]  # bytes per tier the constructor would check
    short: Mapping[Tier, int]  # bytes over the limit, per tier that does not fit
    refused: Optional[str] = None  # the constructor's error for a combination it cannot honour

    @property
    def seconds(self) -> float:
        return sum(self.stages.values())


class Policy(abc.ABC):
    """Gives every managed tensor a home tier.

    Subclass it and implement :meth:`place`. A policy is pure: no I/O, no device calls and no state
    the manager mutates, so it can be tested with made-up :class:`~tiermem.TensorInfo` on any machine.
    """

    @abc.abstractmethod
    def place(self, info: TensorInfo) -> Tier:
        """The home tier of the tensor ``info`` describes.

        Args:
            info: what the tensor is (name, kind, nbytes, shape, dtype, module; ``param`` and
                ``part`` for optimizer state).

        Returns:
            ``Tier.DEVICE``, ``Tier.HOST`` or ``Tier.NVME``.
        """

    def for_model(self, model: ModelInfo) -> "Policy":
        """The policy to ask about this model's tensors (NOTE [Whole-model policies]); by default
        this one, which places each tensor on its own.

        Args:
            model: every trainable parameter in forward order, the working dtype and the tiers'
                limits (:class:`ModelInfo`).

        Returns:
            A pure :class:`Policy`, complete when made (a separate object when the decision
            depends on the model).
        """
        return self

    def places_activations_by_module(self) -> bool:
        """Whether an activation's home may depend on the module that saved it (``info.name``,
        ``info.module``). By default it may: tiermem then tracks which module's forward is running,
        with a pre and post hook on every module. A policy that answers False gets ``""`` for
        both, and the model no hooks for it (fewer Python calls per forward; nothing for
        ``torch.compile`` to trace)."""
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class PerClass(Policy):
    """Every tensor of a class on one tier: subclasses set ``homes``, a mapping of
    :class:`~tiermem.TensorClass` to :class:`~tiermem.Tier`. Its ``place`` never looks at the
    module, so the model gets no per-module hooks for it."""

    homes: Mapping[TensorClass, Tier] = {}

    def place(self, info: TensorInfo) -> Tier:
        """``homes[info.kind]``.

        Args:
            info: the tensor to place.
        """
        return self.homes[info.kind]

    def places_activations_by_module(self) -> bool:
        return False  # one tier for every activation


def resolve_policy(policy: Optional[Policy]) -> Policy:
    if policy is None:
        from tiermem.policies import ZeroOffload  # lazy: policies import tiermem, never the reverse

        default: Policy = ZeroOffload()
        return default
    if not isinstance(policy, Policy):
        raise ConfigError(
            f"tiermem: policy={policy!r} is not a tiermem.Policy; pass an instance such "
            f"as ZeroOffload() or a subclass of Policy that implements place(info)"
        )
    return policy


def asked_alone(policy: Policy, info: TensorInfo) -> ConfigError:
    """The error of a whole-model policy asked about one tensor before it was bound (NOTE
    [Whole-model policies])."""
    return ConfigError(
        f"tiermem: {policy!r} decides over the whole model and was asked about {info.name!r} "
        f"alone; call .for_model(ModelInfo(...)) first and ask the policy it returns (TieredModel "
        f"does this)"
    )


def bound(policy: Policy, model: ModelInfo) -> Policy:
    """``policy.for_model(model)``, refusing anything that is not a :class:`Policy`."""
    out = policy.for_model(model)
    if not isinstance(out, Policy):
        raise ConfigError(
            f"tiermem: {policy!r}.for_model() returned {out!r}; it must return a tiermem.Policy "
            f"(itself, when nothing depends on the whole model)"
        )
    return out


def checked_place(policy: Policy, info: TensorInfo) -> Tier:
    """``policy.place(info)``, refusing anything that is not a :class:`Tier`."""
    tier = policy.place(info)
    if not isinstance(tier, Tier):
        raise ConfigError(
            f"tiermem: {policy!r}.place() returned {tier!r} for {info.name!r} "
            f"({info.kind}); it must return Tier.DEVICE, Tier.HOST or Tier.NVME"
        )
    return tier


# NOTE [Device reserve]
# Activations depend on the batch, which a placement is chosen without, so the footprint counts none
# (NOTE [Activations that do not fit] in tiermem/memory/ledger.py). A policy that takes
# ``device_reserve=r`` (Auto, ZeroOffload, KeepOnDevice) leaves the share ``r`` of the device's limit
# out of its layout: the layout's device bytes must fit ``(1 - r)`` of it. Auto chooses among the
# candidates that do; the others check, when bound to a model by the planner, that theirs does, and
# refuse up front otherwise. The rule is these three functions, for all of them.
def check_reserve(value: object, owner: str) -> float:
    """``value`` as a device reserve (a share from 0 up to, not including, 1), or a ConfigError
    naming ``owner`` (e.g. ``"Auto"``)."""
    if not is_number(value) or not 0 <= value < 1:
        raise ConfigError(
            f"tiermem: {owner}.device_reserve={value!r} is invalid: the share of the device "
            f"left for activations, a number from 0 up to (not including) 1, e.g. 0.1"
        )
    return float(value)


def over_reserve(need_device: int, limits: Mapping[Tier, int], reserve: float) -> Optional[str]:
    """Why ``need_device`` bytes on the device leave less than ``reserve`` of its limit, in words
    ("the device needs ..."), or None when they leave enough (or the device has no limit)."""
    limit = limits.get(Tier.DEVICE)
    if limit is None or need_device <= int(limit * (1 - reserve)):
        return None
    return (
        f"the device needs {fmt_bytes(need_device)}, more than {100 * (1 - reserve):.0f}% of its "
        f"{fmt_bytes(limit)} (device_reserve={reserve:g})"
    )


def check_device_reserve(policy: Policy, model: ModelInfo, reserve: float, fix: str) -> None:
    """Refuse ``policy`` (bound to ``model``) when its layout leaves less than ``reserve`` of the
    device: an OutOfTierMemory saying so and ``fix``. Nothing to check without a reserve or a
    planner; a layout that does not fit at all is left to the constructor's own error."""
    if not reserve or model.evaluate is None or Tier.DEVICE not in model.limits:
        return
    ev = model.evaluate(policy, predict=False)
    words = None if ev.refused is not None or ev.short else over_reserve(ev.need[Tier.DEVICE], model.limits, reserve)
    if words is not None:
        limit = model.limits[Tier.DEVICE]
        raise OutOfTierMemory(
            tier=Tier.DEVICE,
            key="<model working set>",
            asked=ev.need[Tier.DEVICE],
            used=0,
            allowed=int(limit * (1 - reserve)),
            hint=f"{words}: the rest is kept for activations (NOTE [Device reserve]); {fix}, lower device_reserve, "
            f"or raise Budgets(device=...)",
        )
