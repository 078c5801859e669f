"""Everything on the device: the baseline every offloading policy is measured against."""
from __future__ import annotations

from tiermem.policy import Policy
from tiermem.types import TensorInfo, Tier


class KeepOnDevice(Policy):
    def place(self, info: TensorInfo) -> Tier:
        return Tier.DEVICE
