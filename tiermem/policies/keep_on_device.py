"""Everything on the device: the baseline every offloading policy is measured against.
``device_reserve=r`` keeps the share ``r`` of the device for activations (NOTE [Device reserve] in
tiermem/plan/policy.py): a model whose training state passes the rest is refused up front."""

from __future__ import annotations

from tiermem.errors import checked_arguments
from tiermem.plan.policy import ModelInfo, PerClass, Policy, check_device_reserve, check_reserve
from tiermem.types import TensorClass, Tier


@checked_arguments
class KeepOnDevice(PerClass):
    """Every tensor on the device: the baseline every offloading policy is measured against.

    Args:
        device_reserve: the share of the device kept for activations; a model whose training state
            needs more than the rest is refused up front (NOTE [Device reserve]).
    """

    homes = {kind: Tier.DEVICE for kind in TensorClass}

    def __init__(self, *, device_reserve: float = 0.0):
        self.device_reserve = check_reserve(device_reserve, type(self).__name__)

    def for_model(self, model: ModelInfo) -> Policy:
        check_device_reserve(self, model, self.device_reserve, "offload the optimizer state (ZeroOffload())")
        return self

    def __repr__(self) -> str:
        return f"KeepOnDevice(device_reserve={self.device_reserve})" if self.device_reserve else "KeepOnDevice()"
