"""The vocabulary every other module speaks: tiers, tensor classes and tensor descriptions."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch


class Tier(enum.Enum):
    """Where a tensor's bytes can live, fastest first."""

    DEVICE = "device"  # accelerator memory; the CPU itself (under a budget) on a machine without one
    HOST = "host"  # DRAM, pinned when an accelerator exists
    NVME = "nvme"  # files under a directory

    def __str__(self) -> str:
        return self.value


class TensorClass(enum.Enum):
    """What a tensor is for in a training step."""

    PARAM = "param"  # low-precision working weights that forward and backward read
    GRAD = "grad"  # gradients, accumulated in fp32 at their home
    OPTIM_STATE = "optim_state"  # fp32 master weights, Adam exp_avg and exp_avg_sq
    ACTIVATION = "activation"  # tensors autograd saves for backward

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TensorInfo:
    """What a policy is told about a tensor before it picks its home tier.

    ``name`` is the parameter's qualified name for PARAM, GRAD and OPTIM_STATE
    (``"blocks.0.fc.weight"``, ``"blocks.0.fc.weight:exp_avg"``) and the module's
    qualified name for ACTIVATION. ``module`` is the owning module's qualified name.
    """

    name: str
    kind: TensorClass
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    module: Optional[str] = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n
