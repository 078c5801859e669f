"""ZeRO-Offload: weights and activations on the device; grads and optimizer state on the host,
where the fused CPU Adam updates them. ``device_fraction`` keeps part of the optimizer state (and
its grads) on the device, where the device's Adam updates it while the CPU updates the rest.

# NOTE [Which optimizer state goes to the device first]
``ZeroOffload(device_fraction=f)`` keeps the state of about ``f`` of the trainable parameters
(counted in elements, so in bytes: all of it is fp32) on the device, chosen in the order forward
uses the parameters: the first layers first. Those are the parameters whose gradients backward
produces *last*, and three things follow:

- the grads that arrive early leave for the host while backward still runs, hidden behind it;
  the last ones would leave when backward is over, with the step waiting for them. Keeping the
  last ones on the device takes that exposed tail off the critical path;
- the host buckets are the ones whose grads have been home longest, so the CPU Adam can start on
  them at once, while the device Adam runs on the freshest grads where they already are;
- in a GPT the first parameter forward uses is the token embedding, usually tied to the output
  head and the largest tensor, whose grad is complete only after the very last op of backward.

A parameter is taken whole, and the walk stops at the first one that would pass the fraction: the
device part is a prefix of the model in forward order (the tail of backward), at most ``f`` of the
state and short of it by less than one parameter. (Skipping a large parameter to take smaller
ones after it would get closer to ``f``, but would send grads that arrive early in backward, the
ones whose trip home is hidden anyway, to the device.) ``f=0`` is plain
ZeRO-Offload, ``f=1`` every grad and all state on the device (KeepOnDevice's step, weights and
activations as ZeRO-Offload places them).

``device_reserve=r`` keeps the share ``r`` of the device's limit for activations: TieredModel
refuses, before allocating anything, a layout whose device bytes pass ``1 - r`` of it (NOTE [Device
reserve] in tiermem/plan/policy.py), where without it the first forward would find no room for
the activations of its batch. 0 (the default) checks nothing beyond the constructor's fit check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tiermem.config.specs import is_number
from tiermem.errors import ConfigError, checked_arguments
from tiermem.plan.policy import ModelInfo, PerClass, Policy, asked_alone, check_device_reserve, check_reserve
from tiermem.types import TensorClass, TensorInfo, Tier

_SPLIT = (TensorClass.GRAD, TensorClass.OPTIM_STATE)  # the classes device_fraction places


def _check_fraction(value: object) -> float:
    if not is_number(value) or not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ConfigError(
            f"tiermem: ZeroOffload.device_fraction={value!r} is invalid: it is the share of the "
            f"optimizer state kept on the device, a number from 0 (all on the host) to 1 (all "
            f"on the device); pass e.g. device_fraction=0.25"
        )
    return float(value)


def device_share(model: ModelInfo, fraction: float) -> frozenset[str]:
    """The parameters whose grads and optimizer state ``ZeroOffload(device_fraction=fraction)`` keeps
    on the device (NOTE [Which optimizer state goes to the device first])."""
    room = fraction * model.numel
    chosen: set[str] = set()
    for p in model.params:
        if p.numel > room:
            break
        chosen.add(p.name)
        room -= p.numel
    return frozenset(chosen)


@checked_arguments
class ZeroOffload(PerClass):
    """ZeRO-Offload (the default policy): weights and activations on the device, grads and optimizer
    state on the host, where the fused CPU Adam updates them.

    Args:
        device_fraction: the share (0 to 1) of the trainable parameters whose grads and optimizer
            state stay on the device, stepped there while the CPU steps the rest (the split
            optimizer); 0 is plain ZeRO-Offload, 1 keeps them all on the device.
        device_reserve: the share of the device kept for activations; a layout that leaves less is
            refused up front (NOTE [Device reserve]).
    """

    homes = {
        TensorClass.PARAM: Tier.DEVICE,
        TensorClass.ACTIVATION: Tier.DEVICE,
        TensorClass.GRAD: Tier.HOST,
        TensorClass.OPTIM_STATE: Tier.HOST,
    }

    def __init__(self, *, device_fraction: float = 0.0, device_reserve: float = 0.0):
        self.device_fraction = _check_fraction(device_fraction)
        self.device_reserve = check_reserve(device_reserve, type(self).__name__)

    def for_model(self, model: ModelInfo) -> Policy:
        bound: Policy = self  # nothing depends on the model
        if self.device_fraction not in (0.0, 1.0):
            if type(self).place is not ZeroOffload.place:
                raise ConfigError(
                    f"tiermem: {type(self).__name__} overrides place() of a ZeroOffload that splits the optimizer "
                    f"state (device_fraction={self.device_fraction}); the split is decided over the whole model by "
                    f"the policy for_model returns, which would not ask your place(): wrap ZeroOffload(device_"
                    f"fraction=...) in your policy instead and forward for_model to it (NOTE [Whole-model policies])"
                )
            bound = DeviceShare(self, device_share(model, self.device_fraction))
        check_device_reserve(
            bound,
            model,
            self.device_reserve,
            "lower device_fraction" if self.device_fraction else "place less on the device",
        )
        return bound

    def place(self, info: TensorInfo) -> Tier:
        if info.kind not in _SPLIT or self.device_fraction == 0.0:
            return self.homes[info.kind]
        if self.device_fraction == 1.0:
            return Tier.DEVICE
        raise asked_alone(self, info)  # the share needs the whole model: DeviceShare answers

    def __repr__(self) -> str:
        args = [
            f"{k}={v}"
            for k, v in (("device_fraction", self.device_fraction), ("device_reserve", self.device_reserve))
            if v
        ]
        return f"{type(self).__name__}({', '.join(args)})"


@dataclass(frozen=True, repr=False)
class DeviceShare(Policy):
    """``ZeroOffload(device_fraction=f)`` bound to a model: the grads and optimizer state of the
    parameters ``on_device`` on the device, those of the others on the host, the rest as ``base``
    places it (NOTE [Which optimizer state goes to the device first])."""

    base: ZeroOffload
    on_device: frozenset[str]

    def place(self, info: TensorInfo) -> Tier:
        if info.kind in _SPLIT:
            return Tier.DEVICE if info.param in self.on_device else Tier.HOST
        return self.base.place(info)

    def places_activations_by_module(self) -> bool:
        return self.base.places_activations_by_module()

    def __repr__(self) -> str:
        return repr(self.base)
