"""The vocabulary every other module speaks: tiers, tensor classes and tensor descriptions."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional

import torch


class Tier(enum.Enum):
    """Where a tensor's bytes can live, fastest first.

    Attributes:
        DEVICE: accelerator memory; on a machine without one, the CPU itself (under a device budget).
        HOST: DRAM, pinned when an accelerator exists.
        NVME: files under a directory (``nvme_dir``).
    """

    DEVICE = "device"  # accelerator memory; the CPU itself (under a budget) on a machine without one
    HOST = "host"  # DRAM, pinned when an accelerator exists
    NVME = "nvme"  # files under a directory

    def __str__(self) -> str:
        return self.value


class TensorClass(enum.Enum):
    """What a tensor is for in a training step.

    Attributes:
        PARAM: the low-precision working weights that forward and backward read.
        GRAD: gradients, accumulated in fp32 at their home.
        OPTIM_STATE: fp32 master weights and the optimizer's state (Adam's ``exp_avg``, ``exp_avg_sq``).
        ACTIVATION: tensors autograd saves for backward.
    """

    PARAM = "param"  # low-precision working weights that forward and backward read
    GRAD = "grad"  # gradients, accumulated in fp32 at their home
    OPTIM_STATE = "optim_state"  # fp32 master weights, Adam exp_avg and exp_avg_sq
    ACTIVATION = "activation"  # tensors autograd saves for backward

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class StateKey:
    """One tensor of a parameter's optimizer state: the parameter's qualified name and the part
    (``"master"``, ``"exp_avg"`` or ``"exp_avg_sq"``). ``str()`` of it is the name a policy sees
    in :attr:`TensorInfo.name`: ``"blocks.0.fc.weight:exp_avg"``.

    Attributes:
        param: the parameter's qualified name.
        part: which of its state tensors: ``"master"``, ``"exp_avg"`` or ``"exp_avg_sq"``.
    """

    param: str
    part: str

    def __str__(self) -> str:
        return f"{self.param}:{self.part}"


@dataclass(frozen=True)
class TensorInfo:
    """What a policy is told about a tensor before it picks its home tier.

    ``name`` is the parameter's qualified name for PARAM, GRAD and OPTIM_STATE
    (``"blocks.0.fc.weight"``, ``"blocks.0.fc.weight:exp_avg"``) and the module's
    qualified name for ACTIVATION. ``module`` is the owning module's qualified name.
    ``param`` is the parameter's qualified name (PARAM, GRAD and OPTIM_STATE; None for an
    activation) and ``part`` which of its optimizer state tensors an OPTIM_STATE info is, so a
    policy never takes the name apart (:attr:`state_key`).

    Attributes:
        name: the parameter's qualified name (PARAM, GRAD), with ``":part"`` for OPTIM_STATE; the
            saving module's qualified name for ACTIVATION.
        kind: the tensor's :class:`TensorClass`.
        nbytes: its size in bytes.
        shape: its shape.
        dtype: its dtype.
        module: the owning module's qualified name.
        param: the parameter's qualified name (None for an activation).
        part: the optimizer state part (OPTIM_STATE only).
    """

    name: str
    kind: TensorClass
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    module: Optional[str] = None
    param: Optional[str] = None
    part: Optional[str] = None

    def __post_init__(self) -> None:
        if self.param is None and self.kind is not TensorClass.ACTIVATION:
            # an info made by hand with the name alone (a policy's own test): the planner always
            # gives ``param`` and ``part``; this is the one place that reads them from the name
            param, sep, part = self.name.rpartition(":")
            if self.kind is TensorClass.OPTIM_STATE and sep:
                object.__setattr__(self, "param", param)
                object.__setattr__(self, "part", part)
            else:
                object.__setattr__(self, "param", self.name)

    @classmethod
    def of_state(
        cls, key: StateKey, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype, module: Optional[str] = None
    ) -> "TensorInfo":
        """The OPTIM_STATE info of ``key``.

        Args:
            key: the parameter and part.
            nbytes: the state tensor's bytes.
            shape: its shape.
            dtype: its dtype.
            module: the owning module's qualified name.
        """
        return cls(str(key), TensorClass.OPTIM_STATE, nbytes, shape, dtype, module, key.param, key.part)

    @property
    def state_key(self) -> Optional[StateKey]:
        """The optimizer state tensor this info describes (None unless OPTIM_STATE)."""
        if self.kind is not TensorClass.OPTIM_STATE or self.param is None or self.part is None:
            return None
        return StateKey(self.param, self.part)

    @property
    def numel(self) -> int:
        """The number of elements of ``shape``."""
        return math.prod(self.shape)
