"""Optimizer state homed on NVMe, streamed through a fixed set of host buffers.

# NOTE [Three-stage state pipeline]
For the buckets whose OPTIM_STATE lives on NVMe, a step reads bucket k+1's fp32 master,
exp_avg and exp_avg_sq ahead, runs the fused Adam on bucket k, and writes bucket k-1 behind.
Three host buffer sets (each as large as the largest such bucket) rotate through those roles, so
host memory stays bounded whatever the model size: a set is refilled only after its last write
has landed.

# NOTE [A failed step changes nothing]
The NVMe store keeps a key's previous value beside its latest (two slot files written
alternately, in place) and can ``revert`` a key's latest write. A step writes each bucket's new
state over its keys and remembers which writes landed; if any part of the step fails (disk
full, I/O error), it reverts those, so every key holds the state from before the step again: the
caller restores the device weights from it and the step can be retried. The disk holds twice
the state (both slots), never more host memory.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from tiermem.handles import Handle, wait_all, wait_all_quietly
from tiermem.plan.buckets import STATE_PARTS, Bucket
from tiermem.train.homes import StateHome, StateViews, Update
from tiermem.types import TensorClass, Tier

log = logging.getLogger(__name__)

PARTS = STATE_PARTS


class NvmeState(StateHome):
    """The OPTIM_STATE home of the buckets whose state lives on NVMe, and the step's pipeline
    over them. Adam runs on the host, in the pipeline's buffers."""

    compute_tier = Tier.HOST
    revertible = True  # NOTE [A failed step changes nothing]

    def __init__(self, buckets: Sequence[Bucket], engine, host_store):
        self.buckets = list(buckets)
        self.engine = engine
        largest = max(b.numel for b in self.buckets)
        self.sets = [{part: host_store.allocate(f"nvme state set{i}:{part}", (largest,), torch.float32,
                                                TensorClass.OPTIM_STATE) for part in PARTS} for i in range(3)]

    def key(self, b: Bucket, part: str) -> str:
        return f"{b.key}:{part}"

    # -- initial contents, reads and writes --------------------------------------------------------
    def initial_master(self, b: Bucket) -> torch.Tensor:
        return self._views(0, b)[0]

    def initialize(self, b: Bucket) -> None:
        """Store a bucket's initial state: the master filled into :meth:`initial_master`, moments zero."""
        views = self._views(0, b)
        views[1].zero_()
        views[2].zero_()
        wait_all(self._write(b, views))

    def read(self, b: Bucket, which: int = 0) -> StateViews:
        """The bucket's current state in host set ``which`` (blocking)."""
        views = self._views(which, b)
        wait_all(self._read(b, views))
        return views

    def load_views(self, b: Bucket) -> StateViews:
        return self._views(0, b)

    def store(self, b: Bucket, views: StateViews) -> None:
        """Overwrite a bucket's state (checkpoint load; blocking)."""
        wait_all(self._write(b, views))

    def _views(self, which: int, b: Bucket) -> StateViews:
        s = self.sets[which]
        return tuple(s[part][:b.numel] for part in PARTS)  # type: ignore[return-value]

    def _read(self, b: Bucket, views: StateViews) -> list[Handle]:
        return [self.engine.store_read(Tier.NVME, self.key(b, part), v, kind=TensorClass.OPTIM_STATE)
                for part, v in zip(PARTS, views)]

    def _write(self, b: Bucket, views: StateViews) -> list[Handle]:
        return [self.engine.store_write(Tier.NVME, self.key(b, part), v, kind=TensorClass.OPTIM_STATE)
                for part, v in zip(PARTS, views)]

    # -- the step ----------------------------------------------------------------------------------
    def step(self, plan: Sequence[tuple[Bucket, list]], update: Update, tracer, updated: set[int]) -> list[str]:
        """Run ``update(bucket, runs, (master, exp_avg, exp_avg_sq))`` over every bucket of
        ``plan`` in the three-stage pipeline; returns the keys written (for :meth:`revert`). On
        failure every key is reverted to its value from before the step and the error
        propagates; ``updated`` is left alone (every bucket here can be undone).
        NOTE [A failed step changes nothing]"""
        reads: dict[int, list[Handle]] = {}
        writes: dict[int, list[Handle]] = {}  # host set -> writes still reading from it
        written: list[tuple[str, Handle]] = []  # every write of this step, to revert on failure
        try:
            if plan:
                reads[0] = self._read(plan[0][0], self._views(0, plan[0][0]))
            for k, (b, runs) in enumerate(plan):
                if k + 1 < len(plan):  # read ahead into the set bucket k-2 was written from
                    nxt = (k + 1) % 3
                    with tracer.span("wait write-behind", "stall"):
                        wait_all(writes.pop(nxt, ()))  # ordering: its bytes have left the set
                    reads[k + 1] = self._read(plan[k + 1][0], self._views(nxt, plan[k + 1][0]))
                with tracer.span("wait read-ahead", "stall"):
                    wait_all(reads.pop(k))
                views = self._views(k % 3, b)
                update(b, runs, views)  # with no runs the state is written back unchanged
                writes[k % 3] = self._write(b, views)
                written += [(self.key(b, part), h) for part, h in zip(PARTS, writes[k % 3])]
            with tracer.span("wait write-behind", "stall"):
                wait_all([h for hs in writes.values() for h in hs])
        except BaseException:
            wait_all_quietly([h for hs in list(reads.values()) + list(writes.values()) for h in hs])
            self.revert([key for key, h in written if h.succeeded()])
            raise
        return [key for key, _ in written]

    def revert(self, keys: Sequence[str]) -> None:  # type: ignore[override]
        """Undo this step's writes of ``keys``: each holds its value from before the step again."""
        for key in keys:
            self.engine.store_revert(Tier.NVME, key)
