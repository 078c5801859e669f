"""Buckets: trainable parameters packed into contiguous flat buffers, in reverse order of use.

Backward produces the last layers' gradients first, so buckets are filled from the end of the
model: bucket 0's grads are complete first and its transfer starts while backward goes on.
Parameters that share a placement (the tiers of their GRAD and OPTIM_STATE) share buckets.
A bucket only records layout (names, offsets, sizes); the buffers themselves belong to stores.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

from tiermem.types import Tier

#: the three fp32 tensors of a parameter's optimizer state, in the order every module uses
STATE_PARTS = ("master", "exp_avg", "exp_avg_sq")


@dataclass
class Slot:
    """One parameter's place in its bucket."""

    name: str
    param: torch.nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    order: int  # position in reverse order of use: the same whatever the placement


@dataclass
class Bucket:
    index: int
    grad_tier: Tier
    state_tier: Tier
    group: int  # index of its parameters' optimizer param group in Plan.groups (and tm.optimizer.param_groups)
    param_tier: Tier = Tier.DEVICE  # home of the working weights
    slots: list[Slot] = field(default_factory=list)
    numel: int = 0

    @property
    def key(self) -> str:
        return f"bucket{self.index}"

    def add(self, name: str, param: torch.nn.Parameter, order: int) -> None:
        self.slots.append(Slot(name, param, self.numel, param.numel(), param.shape, order))
        self.numel += param.numel()


class Placed(NamedTuple):
    """A trainable parameter, its homes and its param group: what :func:`plan_buckets` packs."""

    name: str
    param: torch.nn.Parameter
    grad_tier: Tier
    state_tier: Tier
    group: int  # index in Plan.groups
    param_tier: Tier


def plan_buckets(params: Sequence[Placed], bucket_numel: int, *, first_index: int = 0, first_order: int = 0
                 ) -> list[Bucket]:
    """Pack the parameters in the order given (already reverse order of use) into buckets of at
    most ``bucket_numel`` elements (a larger single parameter gets a bucket of its own). A bucket
    holds one placement and one param group, so each bucket is one call of the fused Adam.
    ``first_index``/``first_order``: where the buckets' indices and the slots' orders start (past
    a model's buckets, for parameters unfrozen later: NOTE [Freezing and unfreezing])."""
    buckets: list[Bucket] = []
    open_: dict[tuple, Bucket] = {}
    for order, (name, p, grad_tier, state_tier, group, param_tier) in enumerate(params, start=first_order):
        k = (grad_tier, state_tier, group, param_tier)
        b = open_.get(k)
        if b is None or (b.numel and b.numel + p.numel() > bucket_numel):
            b = open_[k] = Bucket(first_index + len(buckets), grad_tier, state_tier, group, param_tier)
            buckets.append(b)
        b.add(name, p, order)
    return buckets
