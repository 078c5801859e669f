"""ZeRO-Offload: weights and activations on the device; grads and optimizer state on the host,
where the fused CPU Adam updates them."""
from __future__ import annotations

from tiermem.plan.policy import PerClass
from tiermem.types import TensorClass, Tier


class ZeroOffload(PerClass):
    homes = {
        TensorClass.PARAM: Tier.DEVICE,
        TensorClass.ACTIVATION: Tier.DEVICE,
        TensorClass.GRAD: Tier.HOST,
        TensorClass.OPTIM_STATE: Tier.HOST,
    }
