"""Gradients homed on NVMe: accumulated per bucket in a pooled host buffer, flushed when complete.

# NOTE [Gradients on NVMe]
During backward a bucket's fp32 accumulation lives in a host buffer taken from the pool when its
first gradient arrives. Once every parameter of the bucket has delivered its gradient, a flush
is queued on the device-to-host lane behind the bucket's copies (the lane runs in order, so the
flush sees them all), writes the buffer to the bucket's NVMe key and gives the buffer back.
Buckets still open when backward ends (some parameter got no gradient) are flushed then. A later
micro-batch of the same step reads the bucket back before adding to it. Host memory holds the
buckets in flight, not all gradients. The step reads each bucket's gradients back twice: once
for the global norm, once for Adam.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Callable, Sequence

import torch

from tiermem.errors import OutOfTierMemory
from tiermem.handles import Handle, wait_all
from tiermem.plan.buckets import Bucket
from tiermem.train.homes.grad_homes import GradHome
from tiermem.train.homes.store_keys import Part, StoreKey, bucket_key
from tiermem.transfer.lease import Lease
from tiermem.transfer.service import CopyService
from tiermem.types import TensorClass, Tier


class NvmeGrads(GradHome):
    """The GRAD home of the buckets whose gradients live on NVMe: NOTE [Gradients on NVMe]."""

    landing_tier = Tier.HOST

    def __init__(self, buckets: Sequence[Bucket], engine: CopyService, host_store):
        self.engine, self.host = engine, host_store
        self._buckets = {b.index: b for b in buckets}
        self._landing: dict[int, tuple[torch.Tensor, Lease]] = {}  # bucket -> (fp32 view, pool buffer)
        self._arrived: dict[int, int] = defaultdict(int)  # gradients delivered in this backward
        self._on_disk: set[int] = set()  # buckets whose NVMe key holds this step's gradients so far
        self._flushes: list[Handle] = []
        self._flush_of: dict[int, Handle] = {}  # bucket -> its latest flush

    @staticmethod
    def key(b: Bucket) -> StoreKey:
        return bucket_key(b, Part.GRAD)

    # -- backward ----------------------------------------------------------------------------------
    def landing(self, b: Bucket, fill: int) -> torch.Tensor:
        """The host buffer that accumulates ``b``'s gradients in this backward (one buffer: this
        home refuses overlap_step, see :func:`tiermem.train.layout.make_homes`)."""
        if b.index not in self._landing:
            lease = self._lease(b.numel * 4, f"<grad landing {b.key}>")
            t = lease.view(torch.float32)
            try:
                if b.index in self._on_disk:  # an earlier micro-batch of this step: continue from it
                    earlier = self._flush_of.pop(b.index, None)
                    if earlier is not None:
                        earlier.wait()  # ordering: its flush is issued and landed first
                    self.engine.store_read(Tier.NVME, str(self.key(b)), t, kind=TensorClass.GRAD).wait()
            except BaseException:
                lease.release()
                raise
            self._landing[b.index] = (t, lease)
        return self._landing[b.index][0]

    def _lease(self, nbytes: int, tag: str) -> Lease:
        """A pooled host buffer (NOTE [Pooled staging]); when the host budget is tight, the flushes
        in flight (whose buffers go back to the pool) land first. Bounded: a few flushes in flight."""
        while len([h for h in self._flushes if not h.done()]) > 2:
            next(h for h in self._flushes if not h.done()).wait()
        try:
            return self.engine.lease(nbytes, tag, TensorClass.GRAD)
        except OutOfTierMemory:
            wait_all(self._flushes)
            return self.engine.lease(nbytes, tag, TensorClass.GRAD)

    def arrived(self, b: Bucket) -> None:
        """One more of ``b``'s parameters has its gradient copy queued."""
        self._arrived[b.index] += 1
        if self._arrived[b.index] >= len(b.slots):
            self._flush(b)

    def complete(self, b: Bucket) -> None:
        if b.index in self._landing:
            self._flush(b)

    def end_backward(self) -> None:
        for index in list(self._landing):
            self._flush(self._buckets[index])
        self._arrived.clear()

    def _flush(self, b: Bucket) -> None:
        """Write the bucket behind its copies (the d2h lane runs in order: NOTE [Gradients on
        NVMe]); the write is issued from the lane, which is not held while the disk works, and the
        buffer goes back to the pool when it lands, whichever way (NOTE [Chained requests])."""
        t, lease = self._landing.pop(b.index)
        self._arrived[b.index] = 0
        self._on_disk.add(b.index)
        h = self.engine.chain(
            self.engine.behind("d2h"),
            lambda: self.engine.store_write(Tier.NVME, str(self.key(b)), t, kind=TensorClass.GRAD),
            cleanup=lease.release,
            stall=Tier.NVME,
        )
        self._flushes.append(h)
        self._flush_of[b.index] = h

    def wait(self) -> None:
        flushes, self._flushes = self._flushes, []
        wait_all(flushes)

    # -- the step ----------------------------------------------------------------------------------
    def read(self, b: Bucket, fill: int = 0) -> tuple[torch.Tensor, Callable[[], None]]:
        """``b``'s gradients of this step in a pooled host buffer, and the function that frees it."""
        lease = self.engine.lease(b.numel * 4, f"<grad read {b.key}>", TensorClass.GRAD)
        t = lease.view(torch.float32)
        try:
            self.engine.store_read(Tier.NVME, str(self.key(b)), t, kind=TensorClass.GRAD).wait()
        except BaseException:
            lease.release()
            raise
        return t, lease.release

    def accumulating(self) -> bool:
        return bool(self._landing)

    def drop(self) -> None:
        with contextlib.suppress(BaseException):
            self.end_backward()
        with contextlib.suppress(BaseException):
            self.wait()  # drain: no flush keeps writing behind the error
        self.end_step()

    def end_step(self) -> None:
        """The step consumed (or dropped) the gradients: the next backward starts afresh."""
        self._on_disk.clear()
        self._flush_of.clear()
        self._arrived.clear()
