"""Everything on the device: the baseline every offloading policy is measured against."""
from __future__ import annotations

from tiermem.plan.policy import PerClass
from tiermem.types import TensorClass, Tier


class KeepOnDevice(PerClass):
    homes = {kind: Tier.DEVICE for kind in TensorClass}
