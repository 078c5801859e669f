"""ZeRO-Offload: weights and activations on the device; grads and optimizer state on the host,
where the fused CPU Adam updates them."""
from __future__ import annotations

from tiermem.policy import Policy
from tiermem.types import TensorClass, TensorInfo, Tier

_HOMES = {
    TensorClass.PARAM: Tier.DEVICE,
    TensorClass.ACTIVATION: Tier.DEVICE,
    TensorClass.GRAD: Tier.HOST,
    TensorClass.OPTIM_STATE: Tier.HOST,
}


class ZeroOffload(Policy):
    def place(self, info: TensorInfo) -> Tier:
        return _HOMES[info.kind]
