"""ActivationOffload: another policy, with large activations sent off the device.

Activations of at least ``min_bytes`` live on ``tier`` (host or NVMe) from the moment autograd
saves them until backward needs them; everything else goes where ``base`` says::

    policy = ActivationOffload(ZeroOffload(), tier=Tier.HOST, min_bytes="1MiB")

The hooks never move parameters, nor tensors under one page
(:data:`tiermem.train.activations.MIN_OFFLOAD_BYTES`), whatever ``min_bytes`` says.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, replace

from tiermem.config.budgets import ByteSize, parse_bytes
from tiermem.errors import ConfigError, checked_arguments
from tiermem.plan.policy import ModelInfo, Policy
from tiermem.types import TensorClass, TensorInfo, Tier


@checked_arguments
@dataclass(frozen=True, repr=False)
class ActivationOffload(Policy):
    """``base``'s placements, with activations of at least ``min_bytes`` on ``tier``.

    Args:
        base: the policy that places everything else (and whose ``for_model`` it forwards to).
        tier: where large activations go: ``Tier.HOST`` or ``Tier.NVME``.
        min_bytes: the smallest activation sent there (an int or a string such as ``"1MiB"``).
    """

    base: Policy
    _: KW_ONLY
    tier: Tier = Tier.HOST
    # 1 MiB: a copy that small already runs near full bandwidth, and the many tiny tensors a
    # forward saves (norm statistics, masks) cost more to move than the memory they free.
    min_bytes: ByteSize = 2**20

    def __post_init__(self) -> None:
        if not isinstance(self.base, Policy):
            raise ConfigError(
                f"tiermem: ActivationOffload.base={self.base!r} is not a tiermem.Policy; "
                f"pass the policy to wrap, e.g. ActivationOffload(ZeroOffload())"
            )
        if self.tier not in (Tier.HOST, Tier.NVME):
            raise ConfigError(
                f"tiermem: ActivationOffload.tier={self.tier!r} is invalid: activations are "
                f"offloaded to Tier.HOST or Tier.NVME; pass one of those (or use the base "
                f"policy alone to keep them on the device)"
            )
        object.__setattr__(self, "min_bytes", parse_bytes(self.min_bytes, what="ActivationOffload.min_bytes"))

    def place(self, info: TensorInfo) -> Tier:
        if info.kind is TensorClass.ACTIVATION and info.nbytes >= int(self.min_bytes):  # an int once constructed
            return self.tier
        return self.base.place(info)

    def for_model(self, model: ModelInfo) -> Policy:
        base = self.base.for_model(model)
        return self if base is self.base else replace(self, base=base)

    def places_activations_by_module(self) -> bool:
        return self.base.places_activations_by_module()  # this one looks at the size alone

    def __repr__(self) -> str:
        return f"ActivationOffload({self.base!r}, tier={self.tier}, min_bytes={self.min_bytes})"
