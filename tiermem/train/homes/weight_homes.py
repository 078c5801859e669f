"""Weight homes: where a bucket's low-precision working weights live, given their first value and
each update (NOTE [Homes] in :mod:`tiermem.train.homes.bucket_homes`).

The interface, :class:`WeightHome`, and its home on the device, :class:`DeviceWeights`. The
off-device ones are :mod:`tiermem.train.weights.param_offload`'s and
:mod:`tiermem.train.weights.gathered`'s, the sharded one :mod:`tiermem.train.homes.sharded`'s.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence

import torch

from tiermem.handles import Handle
from tiermem.plan.buckets import Bucket
from tiermem.plan.placement import adam_writes_device
from tiermem.train.homes.store_keys import Part, bucket_key
from tiermem.train.homes.update_runs import Runs
from tiermem.train.weights.offdevice import point
from tiermem.transfer.service import CopyService
from tiermem.types import TensorClass, Tier


class WeightHome(ABC):
    """The low-precision working weights of some buckets."""

    @abstractmethod
    def initialize(self, b: Bucket, master: torch.Tensor) -> None:
        """The first working weights, rounded from ``b``'s fp32 ``master``; the module's
        parameters are pointed at them (or at a placeholder, when they live off the device)."""

    def initial_span(self, b: Bucket) -> tuple[int, int]:
        """The elements ``[lo, hi)`` of ``master`` that :meth:`initialize` reads: all of them, or a
        rank's chunk (weights sharded over the ranks)."""
        return 0, b.numel

    def built(self) -> None:
        """Every bucket is initialized: what :meth:`initialize` left in flight has landed, or its
        first error is raised (NOTE [Initial writes in flight])."""

    def in_place(self, b: Bucket, compute_tier: Tier) -> Optional[torch.Tensor]:
        """A buffer Adam running on ``compute_tier`` may write ``b``'s new weights into directly,
        needing no :meth:`write` afterwards; None when the weights live elsewhere."""
        return None

    def from_master(self, b: Bucket) -> bool:
        """``b``'s working weights are rounded from its master whenever they are read (NOTE [A
        chunk rounded from its master] in tiermem/train/weights/weight_shards.py): the update writes none."""
        return False

    @abstractmethod
    def write(self, b: Bucket, src: torch.Tensor, runs: Runs, src_tier: Tier) -> list[Handle]:
        """Send the ranges ``runs`` of ``b``'s new weights (``src``, on ``src_tier``) home;
        ``src`` stays unchanged until the handles are done."""

    def load(self, b: Bucket, master: torch.Tensor, src_tier: Tier) -> None:
        """Replace ``b``'s whole working weights with ``master`` rounded (a checkpoint's)."""
        for h in self.write(b, master, [(0, b.numel, 0)], src_tier):
            h.wait()

    def begin_update(self) -> None:
        """New weights are about to be written: cached device copies become stale."""

    def end_update(self) -> None:
        """The update (or a step that skipped it) is over."""


class DeviceWeights(WeightHome):
    """Working weights in one flat device buffer per bucket; the parameters are views of it, so
    one copy uploads a whole bucket."""

    def __init__(self, store, buckets: Sequence[Bucket], dtype: torch.dtype, engine: CopyService):
        self.engine = engine
        self._param = {
            b.index: store.allocate(str(bucket_key(b, Part.PARAM)), (b.numel,), dtype, TensorClass.PARAM)
            for b in buckets
        }
        self._device_is_host = store.device.type == "cpu"  # NOTE [A CPU device]

    def initialize(self, b: Bucket, master: torch.Tensor) -> None:
        param = self._param[b.index]
        param.copy_(master)  # the working copy is the master rounded to the working precision
        for s in b.slots:
            point(s.param, param[s.offset : s.offset + s.numel].view(s.shape))  # NOTE [Models on the meta device]

    def in_place(self, b: Bucket, compute_tier: Tier) -> Optional[torch.Tensor]:
        return self._param[b.index] if adam_writes_device(compute_tier, self._device_is_host) else None

    def write(self, b: Bucket, src: torch.Tensor, runs: Runs, src_tier: Tier) -> list[Handle]:
        param = self._param[b.index]
        return [
            self.engine.copy_async(
                param[a:e], src[a:e], src_tier=src_tier, dst_tier=Tier.DEVICE, kind=TensorClass.PARAM
            )
            for a, e, _ in runs
        ]
