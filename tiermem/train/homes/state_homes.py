"""State homes: where a bucket's master weights and optimizer state live, and where the step's update
runs on them (NOTE [Homes] in :mod:`tiermem.train.homes.bucket_homes`).

The interface, :class:`StateHome`, and its home in memory (device or host: buffers from the tier's
store), :class:`MemoryState`. The NVMe one is :mod:`tiermem.train.homes.nvme_state`'s, the sharded
one :mod:`tiermem.train.homes.sharded`'s.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterator, Sequence

import torch

from tiermem.plan.buckets import Bucket, Slot
from tiermem.train.homes.store_keys import state_key
from tiermem.train.homes.update_runs import Runs, StateViews, Update
from tiermem.types import TensorClass, Tier


class StateHome(ABC):
    """Master weights and optimizer state for some buckets, each part as its format says."""

    #: where Adam runs on this state
    compute_tier: Tier
    #: a step's writes can be undone (the tier keeps each key's previous value)
    revertible: bool = False

    @abstractmethod
    def initial_master(self, b: Bucket) -> torch.Tensor:
        """A buffer to fill with ``b``'s initial fp32 weights before :meth:`initialize`."""

    def initial_span(self, b: Bucket) -> tuple[int, int]:
        """The elements ``[lo, hi)`` of ``b``'s initial master that :meth:`initialize` keeps: all of
        them, or a rank's chunk (NOTE [Models on the meta device])."""
        return 0, b.numel

    def agree(self, b: Bucket) -> None:
        """Make the initial master just filled (all of it) rank 0's on every rank; nothing to do in
        one process. Not called when every rank filled the same values (a checkpoint's)."""

    @abstractmethod
    def initialize(self, b: Bucket) -> None:
        """Store ``b``'s initial state: the master just filled, the other parts at their initial value."""

    def built(self) -> None:
        """Every bucket is initialized: what :meth:`initialize` left in flight has landed, or its
        first error is raised (NOTE [Initial writes in flight])."""

    @abstractmethod
    def step(self, plan: Sequence[tuple[Bucket, Runs]], update: Update, tracer, updated: set[int]) -> object:
        """Run ``update`` over every bucket of ``plan`` (adding each bucket it finished to
        ``updated`` when that update cannot be undone); returns what :meth:`revert` needs."""

    def revert(self, undo: object) -> None:
        """Undo a whole :meth:`step` (only when ``revertible``)."""

    @abstractmethod
    def read(self, b: Bucket) -> StateViews:
        """``b``'s current state, valid until the next call on this home."""

    def read_master(self, b: Bucket) -> torch.Tensor:
        """``b``'s master alone (the first part of :meth:`read`), valid until the next call on this
        home: a home that can read it without the moments does (NOTE [Weights read one tensor at a
        time])."""
        return self.read(b)[0]

    def read_masters(self, buckets: Sequence[Bucket]) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """Each bucket's master in turn (:meth:`read_master`), each valid until the next item; a
        home that reads from disk reads the next one meanwhile."""
        for b in buckets:
            yield b, self.read_master(b)

    @abstractmethod
    def load_views(self, b: Bucket) -> StateViews:
        """Buffers to fill with ``b``'s state from a checkpoint; then :meth:`store`."""

    def store(self, b: Bucket, views: StateViews) -> None:
        """Commit the state filled into :meth:`load_views`."""

    def release_views(self) -> None:
        """The model is done reading or writing whole buckets: buffers kept for that can go."""

    def master(self, b: Bucket, s: Slot) -> torch.Tensor:
        """The parameter's master as torch optimizer param groups show it (a meta tensor of the
        right shape when it is not resident)."""
        return torch.empty(s.shape, device="meta")

    # -- this rank's part of a bucket (a sharded checkpoint: NOTE [Sharded values for DCP]) --------
    #: :meth:`read_local` returns the live state (valid while the model lives), not a staging copy
    resident: bool = False

    def read_local(self, b: Bucket) -> StateViews:
        """The part of ``b``'s state this process keeps (all of it in one process; this rank's
        chunk under data parallelism), with no communication; valid until the next call."""
        return self.read(b)

    def local_views(self, b: Bucket) -> StateViews:
        """Buffers to fill with the part of ``b``'s state this process keeps; then :meth:`store_local`."""
        return self.load_views(b)

    def store_local(self, b: Bucket, views: StateViews) -> None:
        """Commit the state filled into :meth:`local_views`."""
        self.store(b, views)

    def whole_master(self, b: Bucket, mine: torch.Tensor) -> torch.Tensor:
        """``b``'s whole fp32 master, given this process's part of it (``mine``, from
        :meth:`local_views`): ``mine`` itself in one process, gathered under data parallelism."""
        return mine


class MemoryState(StateHome):
    """Optimizer state in buffers of a memory tier, updated in place by Adam where it lives."""

    def __init__(self, store, buckets: Sequence[Bucket]):
        self.compute_tier = store.tier
        self._views: dict[int, StateViews] = {}
        for b in buckets:
            views = tuple(
                store.allocate(str(state_key(b, part)), (n,), part.dtype, TensorClass.OPTIM_STATE)
                for part, n in zip(b.state.parts, b.part_numels())
            )
            for part, t in zip(b.state.parts[1:], views[1:]):
                t.fill_(part.initial)
            self._views[b.index] = views

    def initial_master(self, b: Bucket) -> torch.Tensor:
        return self._views[b.index][0]

    def initialize(self, b: Bucket) -> None:
        pass  # already in place; the other parts were set at allocation

    def step(self, plan, update, tracer, updated):
        for b, runs in plan:
            update(b, runs, self._views[b.index])
            updated.add(b.index)  # memory has no previous value: this bucket cannot be undone
        return None

    def read(self, b: Bucket) -> StateViews:
        return self._views[b.index]

    def load_views(self, b: Bucket) -> StateViews:
        return self._views[b.index]

    resident = True

    def master(self, b: Bucket, s: Slot) -> torch.Tensor:
        return self._views[b.index][0][s.offset : s.offset + s.numel].view(s.shape)
