"""ZeRO-Infinity: weights and optimizer state on NVMe, grads on the host, activations on the
device. Weights come to the device just in time for their module (prefetched in the order the
first step recorded) and the step streams the optimizer state through bounded host buffers."""

from __future__ import annotations

from tiermem.errors import checked_arguments
from tiermem.plan.policy import PerClass
from tiermem.types import TensorClass, Tier


@checked_arguments
class ZeroInfinity(PerClass):
    """ZeRO-Infinity: weights and optimizer state on NVMe, grads on the host, activations on the
    device; needs ``nvme_dir``. Takes no arguments."""

    homes = {
        TensorClass.PARAM: Tier.NVME,
        TensorClass.OPTIM_STATE: Tier.NVME,
        TensorClass.GRAD: Tier.HOST,
        TensorClass.ACTIVATION: Tier.DEVICE,
    }
