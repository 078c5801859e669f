"""The policy API: given what a tensor is, say where it lives.

A policy is pure: ``place(info) -> Tier`` with no I/O, no device calls and no state that the
manager mutates, so it can be tested with made-up :class:`TensorInfo` on any machine::

    class OptimStateOfEmbeddingOnNvme(Policy):
        def place(self, info):
            if info.kind is TensorClass.OPTIM_STATE and info.name.startswith("wte."):
                return Tier.NVME
            return ZeroOffload().place(info)
"""
from __future__ import annotations

import abc
from typing import Mapping, Optional

from tiermem.errors import ConfigError
from tiermem.types import TensorClass, TensorInfo, Tier


class Policy(abc.ABC):
    """Gives every managed tensor a home tier."""

    @abc.abstractmethod
    def place(self, info: TensorInfo) -> Tier:
        """The home tier of the tensor ``info`` describes."""

    def places_activations_by_module(self) -> bool:
        """Whether an activation's home may depend on the module that saved it (``info.name``,
        ``info.module``). By default it may: tiermem then tracks which module's forward is running,
        with a pre and post hook on every module. A policy that answers False gets ``""`` for
        both, and the model no hooks for it (fewer Python calls per forward; nothing for
        ``torch.compile`` to trace)."""
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class PerClass(Policy):
    """Every tensor of a class on one tier: subclasses set ``homes`` (TensorClass -> Tier)."""

    homes: Mapping[TensorClass, Tier] = {}

    def place(self, info: TensorInfo) -> Tier:
        return self.homes[info.kind]

    def places_activations_by_module(self) -> bool:
        return False  # one tier for every activation


def resolve_policy(policy: Optional[Policy]) -> Policy:
    if policy is None:
        from tiermem.policies import ZeroOffload  # lazy: policies import tiermem, never the reverse
        return ZeroOffload()
    if not isinstance(policy, Policy):
        raise ConfigError(f"tiermem: policy={policy!r} is not a tiermem.Policy; pass an instance such "
                          f"as ZeroOffload() or a subclass of Policy that implements place(info)")
    return policy


def checked_place(policy: Policy, info: TensorInfo) -> Tier:
    """``policy.place(info)``, refusing anything that is not a :class:`Tier`."""
    tier = policy.place(info)
    if not isinstance(tier, Tier):
        raise ConfigError(f"tiermem: {policy!r}.place() returned {tier!r} for {info.name!r} "
                          f"({info.kind}); it must return Tier.DEVICE, Tier.HOST or Tier.NVME")
    return tier
