"""Everything on the device: the baseline every offloading policy is measured against."""
from __future__ import annotations

from tiermem.errors import checked_arguments
from tiermem.plan.policy import PerClass
from tiermem.types import TensorClass, Tier


@checked_arguments
class KeepOnDevice(PerClass):
    homes = {kind: Tier.DEVICE for kind in TensorClass}
