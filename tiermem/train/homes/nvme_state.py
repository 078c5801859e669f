"""Optimizer state homed on NVMe, streamed through a fixed set of host buffers.

# NOTE [Three-stage state pipeline]
For the buckets whose OPTIM_STATE lives on NVMe, a step reads bucket k+1's state (every part of
its format: fp32 master, exp_avg and exp_avg_sq for Adam) ahead, runs the fused update on bucket
k, and writes bucket k-1 behind.
Three host buffer sets (each as large as the largest such bucket) rotate through those roles, so
host memory stays bounded whatever the model size: a set is refilled only after its last write
has landed.

A step that completes reads the next step's first bucket ahead into the first set, so that its
read overlaps the forward and backward in between instead of the start of the next step (the
state of that bucket cannot change before then: anything else that touches this home's state,
a checkpoint load or a read, first waits for that read and drops it).

# NOTE [A failed step is rolled forward]
Each bucket's state (all its parts, back to back: StateFormat.joined) is one NVMe key, ``<bucket>:state``, so it
changes as a whole: the store switches a key to its new value only once every byte landed, and a
write that fails leaves the previous value (NOTE [One value per key, and a few spare files] in
tiermem/memory/nvme_keys.py). The store keeps one value per key, not the one before it, so a
step cannot be undone; it is completed instead. A bucket whose state write landed is *updated*:
the step reports it, and the stepper drops its gradients, keeps its step counts and sends its
weights home again at the next step (in case they did not land). A bucket whose write did not
land still holds the state from before the step, and the stepper keeps its gradients: retrying
``tm.step()`` runs Adam on it from that state with those gradients, which gives bit for bit what
the uninterrupted step would have. What the disk holds between the failure and the retry is one
consistent state per bucket, some buckets one step ahead of the others, never a bucket torn
between two steps. A bucket whose bf16 master is its weights' keys (NOTE [One copy of bf16 master
weights] in tiermem/train/weights/param_offload.py) is several keys: when only some of them landed, its
new value (still in its host set) is kept in memory, the bucket counts as updated, and the next
use of this home (the retry's step, a read) writes it whole first.

Until the retry, the weights are those of two steps (the updated buckets' new ones, the others'
old ones; a kept bucket's keys even torn between the two), so ``tm(...)``, ``tm.resident(...)``
and a checkpoint, state dict or detached module of them (``tm.save``, ``tm.sharded_state_dict``,
``tm.state_dict``, ``tm.detach``) are refused with a ``tiermem:`` error saying to call
``tm.step()`` again (or to load a checkpoint): no forward computes with a mix, and nothing the
user keeps holds one (``Stepper.check_whole`` in tiermem/train/step/stepper.py). A failure that updated
no bucket leaves every weight at its value before the step, and forwards run: the new weights the
step had sent home for a bucket whose state did not land are sent again from its old master.
"""

from __future__ import annotations

import logging
from typing import Iterator, Optional, Protocol, Sequence

import torch

from tiermem.handles import Handle, wait_all, wait_all_quietly
from tiermem.plan.buckets import Bucket
from tiermem.train.homes.state_homes import StateHome
from tiermem.train.homes.store_keys import Part, StoreKey, bucket_key
from tiermem.train.homes.update_runs import StateViews, Update
from tiermem.transfer.service import CopyService
from tiermem.types import TensorClass, Tier

log = logging.getLogger(__name__)


class MasterKeys(Protocol):
    """The weights' home that keeps some buckets' bf16 master as their weights (NOTE [One copy of
    bf16 master weights]): :class:`~tiermem.train.weights.param_offload.ParamOffload`."""

    def from_master(self, b: Bucket) -> bool: ...

    def read_master(self, b: Bucket, out: torch.Tensor) -> list[Handle]: ...

    def write_master(self, b: Bucket, src: torch.Tensor) -> list[Handle]: ...


class NvmeState(StateHome):
    """The OPTIM_STATE home of the buckets whose state lives on NVMe, and the step's pipeline
    over them. Adam runs on the host, in the pipeline's buffers. ``masters``: the weights' home,
    which keeps the master of the buckets whose weights are their master."""

    compute_tier = Tier.HOST
    revertible = False  # NOTE [A failed step is rolled forward]

    def __init__(
        self, buckets: Sequence[Bucket], engine: CopyService, host_store, masters: Optional[MasterKeys] = None
    ):
        self.buckets = list(buckets)
        self.engine = engine
        self.masters = masters
        self._kept: dict[int, tuple[Bucket, torch.Tensor]] = {}  # a bucket's new value that landed in part
        largest = max(b.joined_bytes() for b in self.buckets)
        # each set holds one bucket's parts back to back (bytes), so that they are one key's value
        # named by the first bucket: buckets appended later get a home with sets of their own
        self.sets = [
            host_store.allocate(
                f"nvme state set{i} of {self.buckets[0].key}...", (largest,), torch.uint8, TensorClass.OPTIM_STATE
            )
            for i in range(3)
        ]
        self._ahead: Optional[tuple[int, list[Handle]]] = None  # (bucket, its read into set 0) for the next step
        # construction (NOTE [Initial writes in flight]): the set the next bucket is filled in, and the
        # writes still reading from each set
        self._filling = 0
        self._initial: dict[int, list[Handle]] = {}

    @staticmethod
    def key(b: Bucket) -> StoreKey:
        return bucket_key(b, Part.STATE)

    # -- initial contents, reads and writes --------------------------------------------------------
    def initial_master(self, b: Bucket) -> torch.Tensor:
        """NOTE [Initial writes in flight]: in host sets 0 and 1 by turns, once the writes of the
        bucket filled there before have landed."""
        wait_all(self._initial.pop(self._filling, ()))
        return self._views(self._filling, b)[0]

    def initialize(self, b: Bucket) -> None:
        """Store a bucket's initial state: the master filled into :meth:`initial_master`, the other
        parts at their initial value. The writes are left in flight (NOTE [Initial writes in
        flight]): :meth:`built` waits for them."""
        self._drop_ahead()
        views = self._views(self._filling, b)
        for part, t in zip(b.state.parts[1:], views[1:]):
            t.fill_(part.initial)
        self._initial[self._filling] = self._write(b, views, master=False)  # a shared master: the weights' home
        self._filling = 1 - self._filling  # stores it next

    def built(self) -> None:
        """Every initial write has landed; the first error, if any, is raised."""
        pending, self._initial = [h for hs in self._initial.values() for h in hs], {}
        wait_all(pending)

    def read(self, b: Bucket, which: int = 0) -> StateViews:
        """The bucket's current state in host set ``which`` (blocking)."""
        self._settled()
        self._write_kept()
        views = self._views(which, b)
        wait_all(self._read(b, views))
        return views

    def read_master(self, b: Bucket) -> torch.Tensor:
        """A shared master is read from the weights' keys alone, not the moments with it (a third
        of the bytes with 8-bit moments)."""
        self._settled()
        self._write_kept()
        views = self._views(0, b)
        wait_all(self._read_master_into(b, views))
        return views[0]

    def read_masters(self, buckets: Sequence[Bucket]) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """NOTE [Weights read one tensor at a time]: each bucket's master in host sets 0 and 1 by
        turns, the next bucket's read in flight while the caller copies this one out (a shared
        master from the weights' keys alone, as :meth:`read_master`). Leaving early waits for the
        read in flight, so that the sets are free again."""
        self._settled()
        self._write_kept()
        ahead: list[Handle] = []
        try:
            for i, b in enumerate(buckets):
                views = self._views(i % 2, b)
                hs = ahead or self._read_master_into(b, views)
                ahead = []
                wait_all(hs)
                if i + 1 < len(buckets):
                    nxt = buckets[i + 1]
                    ahead = self._read_master_into(nxt, self._views((i + 1) % 2, nxt))
                yield b, views[0]
        finally:
            wait_all_quietly(ahead)

    def _read_master_into(self, b: Bucket, views: StateViews) -> list[Handle]:
        if not self._shared(b):
            return self._read(b, views)
        assert self.masters is not None
        return self.masters.read_master(b, views[0])

    def load_views(self, b: Bucket) -> StateViews:
        self._settled()
        return self._views(0, b)

    def store(self, b: Bucket, views: StateViews) -> None:
        """Overwrite a bucket's state (checkpoint load; blocking)."""
        self._settled()
        self._kept.pop(b.index, None)
        wait_all(self._write(b, views))

    def _write_kept(self) -> None:
        """The buckets a failed step left landed in part, written whole (NOTE [A failed step is
        rolled forward]); a failure raises, and they stay kept."""
        for index, (b, value) in list(self._kept.items()):
            views = self._views(0, b)
            self._joined(b, views).copy_(value)
            wait_all(self._write(b, views))
            del self._kept[index]

    def _shared(self, b: Bucket) -> bool:
        """``b``'s master is its weights' keys (NOTE [One copy of bf16 master weights])."""
        return self.masters is not None and self.masters.from_master(b)

    def _settled(self) -> None:
        """Nothing of this home in flight: the initial writes landed (their first error raised) and
        the next step's read ahead dropped; before any read or write of its sets."""
        self.built()
        self._drop_ahead()

    def _drop_ahead(self) -> None:
        """The next step's first read, issued at the end of the last step: landed and forgotten
        (its set is about to be reused, or its bucket rewritten)."""
        if self._ahead is not None:
            wait_all_quietly(self._ahead[1])
            self._ahead = None

    def _views(self, which: int, b: Bucket) -> StateViews:
        numels = b.part_numels()
        offsets, _ = b.state.joined(numels)
        whole = self.sets[which]
        return tuple(
            whole[at : at + n * part.itemsize].view(part.dtype) for part, n, at in zip(b.state.parts, numels, offsets)
        )

    def _joined(self, b: Bucket, views: StateViews) -> torch.Tensor:
        """The one byte buffer the views of :meth:`_views` are parts of: the key's value."""
        which = [t.data_ptr() for t in self.sets].index(views[0].data_ptr())  # the master starts its set
        return self.sets[which][: b.joined_bytes()]

    def _state_key_bytes(self, b: Bucket, views: StateViews) -> torch.Tensor:
        """What the bucket's state key holds: every part, or every part but a shared master."""
        joined = self._joined(b, views)
        if not self._shared(b):
            return joined
        return joined[b.state.joined(b.part_numels())[0][1] :]  # from the second part on

    def _read(self, b: Bucket, views: StateViews) -> list[Handle]:
        key = str(self.key(b))
        hs = [self.engine.store_read(Tier.NVME, key, self._state_key_bytes(b, views), kind=TensorClass.OPTIM_STATE)]
        if self._shared(b):
            assert self.masters is not None
            hs += self.masters.read_master(b, views[0])
        return hs

    def _write(self, b: Bucket, views: StateViews, *, master: bool = True) -> list[Handle]:
        key, state = str(self.key(b)), self._state_key_bytes(b, views)
        hs = [self.engine.store_write(Tier.NVME, key, state, kind=TensorClass.OPTIM_STATE)]
        if master and self._shared(b):
            assert self.masters is not None
            hs += self.masters.write_master(b, views[0])
        return hs

    # -- the step ----------------------------------------------------------------------------------
    def step(self, plan: Sequence[tuple[Bucket, list]], update: Update, tracer, updated: set[int]) -> None:
        """Run ``update(bucket, runs, views)`` (views: the parts of its state) over every bucket of
        ``plan`` in the three-stage pipeline, adding each bucket to ``updated`` once its new state
        has landed; on failure, the buckets whose state landed are added and the error propagates
        (NOTE [A failed step is rolled forward])."""
        reads: dict[int, list[Handle]] = {}
        writes: dict[int, list[Handle]] = {}  # host set -> writes still reading from it
        written: list[tuple[int, Handle]] = []  # (bucket, one of its state's writes) of this step
        placed: dict[int, tuple[Bucket, int]] = {}  # bucket -> (itself, the set it was updated in)
        self.built()
        ahead, self._ahead = self._ahead, None
        if self._kept:
            wait_all_quietly(ahead[1] if ahead is not None else ())
            ahead = None
            self._write_kept()
        try:
            if plan:
                first = plan[0][0]
                if ahead is not None and ahead[0] == first.index:
                    reads[0] = ahead[1]  # read at the end of the last step
                else:
                    wait_all_quietly(ahead[1] if ahead is not None else ())
                    reads[0] = self._read(first, self._views(0, first))
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
                written += [(b.index, h) for h in writes[k % 3]]
                placed[b.index] = (b, k % 3)
            with tracer.span("wait write-behind", "stall"):
                wait_all([h for hs in writes.values() for h in hs])
            if plan:  # every set is free again: the next step's first bucket, read ahead
                self._ahead = (plan[0][0].index, self._read(plan[0][0], self._views(0, plan[0][0])))
        except BaseException:
            wait_all_quietly([h for hs in list(reads.values()) + list(writes.values()) for h in hs])
            landed: dict[int, list[bool]] = {}
            for index, h in written:
                landed.setdefault(index, []).append(h.succeeded())
            for index, ok in landed.items():
                if any(ok) and not all(ok):  # its set still holds the new value: kept, written at the retry
                    b, which = placed[index]
                    self._kept[index] = (b, self._joined(b, self._views(which, b)).clone())
            updated.update(index for index, ok in landed.items() if any(ok))
            raise
        updated.update(index for index, _ in written)
