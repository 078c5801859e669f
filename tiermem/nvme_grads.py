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

from collections import defaultdict
from typing import Callable, Sequence

import torch

from tiermem.buckets import Bucket
from tiermem.handles import Handle, wait_all
from tiermem.types import TensorClass, Tier


class NvmeGrads:
    def __init__(self, buckets: Sequence[Bucket], engine, host_store):
        self.engine, self.host = engine, host_store
        self._landing: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> (fp32 view, pool buffer)
        self._arrived: dict[int, int] = defaultdict(int)  # gradients delivered in this backward
        self._on_disk: set[int] = set()  # buckets whose NVMe key holds this step's gradients so far
        self._flushes: list[Handle] = []
        self._flush_of: dict[int, Handle] = {}  # bucket -> its latest flush

    @staticmethod
    def key(b: Bucket) -> str:
        return f"{b.key}:grad"

    # -- backward ----------------------------------------------------------------------------------
    def landing(self, b: Bucket) -> torch.Tensor:
        """The host buffer that accumulates ``b``'s gradients in this backward."""
        if b.index not in self._landing:
            base = self.host.acquire(b.numel * 4, f"<grad landing {b.key}>", TensorClass.GRAD)
            t = base[:b.numel * 4].view(torch.float32)
            if b.index in self._on_disk:  # an earlier micro-batch of this step: continue from it
                self._flush_of.pop(b.index).wait()  # ordering: its flush is issued and landed first
                self.engine.store_read(Tier.NVME, self.key(b), t, kind=TensorClass.GRAD).wait()
            self._landing[b.index] = (t, base)
        return self._landing[b.index][0]

    def arrived(self, b: Bucket) -> None:
        """One more of ``b``'s parameters has its gradient copy queued."""
        self._arrived[b.index] += 1
        if self._arrived[b.index] >= len(b.slots):
            self._flush(b)

    def end_backward(self, buckets: dict[int, Bucket]) -> None:
        for index in list(self._landing):
            self._flush(buckets[index])
        self._arrived.clear()

    def _flush(self, b: Bucket) -> None:
        t, base = self._landing.pop(b.index)
        self._arrived[b.index] = 0
        self._on_disk.add(b.index)

        def write() -> None:  # runs on the lane after the bucket's copies: NOTE [Gradients on NVMe]
            try:
                self.engine.store_write(Tier.NVME, self.key(b), t, kind=TensorClass.GRAD).wait()
            finally:
                self.host.release(f"<grad landing {b.key}>", base)
        h = self.engine.run_async(write, name=f"flush {b.key} grads", lane="d2h")
        self._flushes.append(h)
        self._flush_of[b.index] = h

    def wait(self) -> None:
        flushes, self._flushes = self._flushes, []
        wait_all(flushes)

    # -- the step ----------------------------------------------------------------------------------
    def read(self, b: Bucket) -> tuple[torch.Tensor, Callable[[], None]]:
        """``b``'s gradients of this step in a pooled host buffer, and the function that frees it."""
        tag = f"<grad read {b.key}>"
        base = self.host.acquire(b.numel * 4, tag, TensorClass.GRAD)
        t = base[:b.numel * 4].view(torch.float32)
        self.engine.store_read(Tier.NVME, self.key(b), t, kind=TensorClass.GRAD).wait()
        return t, lambda: self.host.release(tag, base)

    def has(self, b: Bucket) -> bool:
        return b.index in self._on_disk

    def end_step(self) -> None:
        """The step consumed the gradients: the next backward starts afresh."""
        self._on_disk.clear()
        self._flush_of.clear()
