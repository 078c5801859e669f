"""Grad homes: where a bucket's fp32 gradients accumulate through backward and how the step reads
them where Adam runs (NOTE [Homes] in :mod:`tiermem.train.homes.bucket_homes`).

The interface, :class:`GradHome`, and its home in memory (device or host: buffers from the tier's
store), :class:`MemoryGrads`, whose memory is taken for each step (NOTE [Grads come and go]). The
NVMe one is :mod:`tiermem.train.homes.nvme_grads`'s, the sharded one :mod:`tiermem.train.homes.sharded`'s.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence

import torch

from tiermem.handles import Handle
from tiermem.plan.buckets import Bucket
from tiermem.train.homes.store_keys import Part, bucket_key
from tiermem.transfer.service import CopyService
from tiermem.types import TensorClass, Tier


def _nothing() -> None:
    return None


class GradHome(ABC):
    """fp32 gradient accumulation for some buckets."""

    #: the tier the device's gradient copies land on (the home's own, or a host buffer before NVMe)
    landing_tier: Tier

    @abstractmethod
    def landing(self, b: Bucket, fill: int) -> torch.Tensor:
        """The fp32 buffer ``b``'s device gradients are copied (or added) into in this backward;
        ``fill`` picks one of two buffers under overlap_step."""

    def arrived(self, b: Bucket) -> None:
        """One more of ``b``'s parameters has its gradient copy queued."""

    def complete(self, b: Bucket) -> None:
        """``b``'s whole landing buffer has this backward's grads (a rank's reduce-scattered chunk
        landed at once, NOTE [Data parallel]): a home that writes complete buckets elsewhere may."""

    def end_backward(self) -> None:
        """Backward returned: buckets still open (a parameter got no grad) are complete."""

    def wait(self) -> None:
        """Everything this backward sent home has landed (raises what failed)."""

    def accumulating(self) -> bool:
        """A backward stopped before its end and left buckets open."""
        return False

    def gather(self, fill: int) -> list[Handle]:
        """Start bringing the step's grads where Adam runs; the step waits on the handles."""
        return []

    @abstractmethod
    def read(self, b: Bucket, fill: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """``b``'s grads of this step where Adam runs, and the function that frees them."""

    def drop(self) -> None:
        """Forget this step's grads after an error: nothing in flight keeps writing."""
        self.end_step()

    def defer(self, on: bool) -> None:
        """Inside ``tm.no_sync()``: grads accumulate here and are not communicated yet (only a
        home that communicates does anything)."""

    def end_step(self) -> None:
        """The step consumed (or dropped) the grads: the next backward starts afresh."""


# NOTE [Grads come and go]
# A bucket's fp32 accumulation buffer holds memory only while it holds grads of the step to come:
# it is allocated when the bucket's first gradient of the step lands (``landing``; under data
# parallelism when its reduce-scattered chunk lands, bucket by bucket through backward) and its
# memory goes back to the system once the step has consumed or dropped the grads (``end_step``:
# MemoryStore.vacate), as does that of the grads brought where Adam runs (``grad_in``). Between a
# step and the next backward, forward included, a rank's grads take no memory, and at the
# backward's peak (its start, every activation alive) only those of the buckets done so far, as
# FSDP2's sharded grads. Their bytes stay counted against the budget from construction on (room
# held in the ledger: MemoryStore.hold_room), so what the budget check accepted at construction
# still fits at every backward: nothing else (offloaded activations, a gather's staging) takes
# the grads' room meanwhile, and the ledger and report() count them as before. The step reads only
# buckets that got a grad this step (one process: the parameters it received; data parallelism:
# every bucket, landed whole), so a fresh buffer's other bytes are never read; no_sync() and
# micro-batches keep adding into the buffers, which live until the step. A pinned host buffer
# stays for the run (pinning is what costs on a GPU machine; vacate keeps it), and so do both
# buffers under overlap_step, where the update in the background reads one after its step returned.
class MemoryGrads(GradHome):
    """Gradients accumulated in fp32 buffers of a memory tier (device or host), whose memory is
    taken for each step (NOTE [Grads come and go]). When Adam runs on another tier, ``gather``
    copies them there first (``grad_in``)."""

    def __init__(
        self,
        store,
        buckets: Sequence[Bucket],
        compute_tier: dict[int, Tier],
        stores: dict,
        engine: CopyService,
        *,
        buffers: int = 1,
    ):
        self.landing_tier = store.tier
        self.engine = engine
        self._numel = {b.index: b.numel for b in buckets}
        parts = (Part.GRAD, Part.GRAD_ALT)[:buffers]  # overlap_step: backward fills one while Adam reads the other
        self._acc = {b.index: [(store, str(bucket_key(b, part))) for part in parts] for b in buckets}
        self._in = {  # where Adam reads them, when that is another tier
            b.index: (stores[compute_tier[b.index]], str(bucket_key(b, Part.GRAD_IN)))
            for b in buckets
            if compute_tier[b.index] != store.tier
        }
        self._compute = compute_tier
        self._bufs: dict[str, torch.Tensor] = {}  # by key: the buffers holding memory now
        self._for_the_run = buffers > 1  # overlap_step
        for b in buckets:
            for st, key in self._keys(b.index):
                if self._for_the_run:
                    self._buffer(st, key, b.index)
                else:
                    st.hold_room(key, (b.numel,), torch.float32, TensorClass.GRAD)

    def _keys(self, index: int) -> list[tuple[Any, str]]:
        """(store, key) of each buffer of bucket ``index``: its accumulation buffers and its grad_in."""
        return self._acc[index] + ([self._in[index]] if index in self._in else [])

    def _buffer(self, store, key: str, index: int) -> torch.Tensor:
        t = self._bufs.get(key)
        if t is None:
            t = self._bufs[key] = store.allocate(key, (self._numel[index],), torch.float32, TensorClass.GRAD)
        return t

    def landing(self, b: Bucket, fill: int) -> torch.Tensor:
        return self._buffer(*self._acc[b.index][fill], b.index)

    def gather(self, fill: int) -> list[Handle]:
        return [
            self.engine.copy_async(
                self._buffer(*self._in[index], index),
                self._bufs[self._acc[index][fill][1]],
                src_tier=self.landing_tier,
                dst_tier=self._compute[index],
                kind=TensorClass.GRAD,
            )
            for index in self._in
            if self._acc[index][fill][1] in self._bufs  # grads landed (or a buffer kept for the run)
        ]

    def read(self, b: Bucket, fill: int) -> tuple[torch.Tensor, Callable[[], None]]:
        st, key = self._in[b.index] if b.index in self._in else self._acc[b.index][fill]
        return self._bufs[key], _nothing

    def end_step(self) -> None:
        if self._for_the_run:
            return
        for index in self._numel:
            for st, key in self._keys(index):
                if key in self._bufs and st.vacate(key):  # a pinned buffer stays
                    del self._bufs[key]
