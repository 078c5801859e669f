"""Homes: where each class of a bucket's training state lives, behind one interface per class.

# NOTE [Homes]
A bucket's fp32 gradients, its optimizer state and its working weights each have a *home*: an
object that owns those bytes on one tier and answers the step, the checkpoint and ``detach()``
in the same words whatever that tier is. The step never asks where a bucket's grads are; it asks
the bucket's :class:`GradHome` for them. Three interfaces:

- :class:`GradHome`: where the device's gradient copies land during backward (``landing``), and
  the step's view of them where Adam runs (``read``, with a function that frees what it took).
- :class:`StateHome`: master weights and the optimizer's state, the parts of each bucket's state
  format (NOTE [State formats] in tiermem/optim/formats.py: fp32 master, ``exp_avg`` and
  ``exp_avg_sq`` for Adam); runs the step's update
  over its buckets (``step``), can undo a step when its tier keeps the previous value
  (``revertible``), and reads/writes whole buckets for checkpoints.
- :class:`WeightHome`: the low-precision working weights the module computes with: given their
  first value (``initialize``) and each update (``write``).

This module holds the interfaces and the homes in memory (device or host: buffers from the
tier's store); :func:`tiermem.train.layout.make_homes` is the one place that maps a tier to the
class that homes it. The NVMe homes live in :mod:`tiermem.train.homes.nvme_grads` and :mod:`tiermem.train.homes.nvme_state`, the
off-device weights in :mod:`tiermem.train.weights.param_offload`. Adding a tier (another rank's memory)
is one more class per interface and one more row in ``make_homes``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, TypeVar

import torch

from tiermem.handles import Handle, wait_all
from tiermem.plan.buckets import Bucket, Slot
from tiermem.plan.placement import adam_writes_device
from tiermem.train.homes.store_keys import Part, bucket_key, state_key
from tiermem.train.weights.offdevice import point
from tiermem.transfer.service import CopyService
from tiermem.types import TensorClass, Tier

StateViews = tuple[torch.Tensor, ...]  # one flat tensor per part of the bucket's state format, master first
Runs = list[tuple[int, int, int]]  # (start, end, step) ranges of a bucket that an update covers
Update = Callable[[Bucket, Runs, StateViews], None]


def _nothing() -> None:
    return None


def slots_in(bucket: Bucket, runs: Runs) -> list[Slot]:
    """The slots of ``bucket`` that the update ``runs`` cover."""
    return [s for s in bucket.slots if any(a <= s.offset < e for a, e, _ in runs)]


# -- gradients ------------------------------------------------------------------------------------
H = TypeVar("H")  # a kind of home


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


# -- optimizer state --------------------------------------------------------------------------------
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


# -- working weights --------------------------------------------------------------------------------
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


# -- all homes of a model ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Homes:
    """Each bucket's three homes, by bucket index."""

    grads: dict[int, GradHome]
    state: dict[int, StateHome]
    weights: dict[int, WeightHome]
    #: weight homes of no trainable bucket (frozen weights sharded over the ranks alone: NOTE
    #: [Frozen weights sharded over the ranks]), told of updates and iterations like the others
    also: tuple[WeightHome, ...] = ()

    @staticmethod
    def _unique(homes: Mapping[int, H]) -> list[H]:
        seen: dict[int, H] = {}
        for h in homes.values():
            seen.setdefault(id(h), h)
        return list(seen.values())

    def grad_homes(self) -> list[GradHome]:
        return self._unique(self.grads)

    def state_homes(self) -> list[StateHome]:
        """Revertible homes first: a step that fails there has changed nothing else yet."""
        return sorted(self._unique(self.state), key=lambda h: not h.revertible)

    def weight_homes(self) -> list[WeightHome]:
        return self._unique({**self.weights, **{-1 - i: h for i, h in enumerate(self.also)}})

    def begin_update(self) -> None:
        """Every weight home's cached device copies are about to be stale (an update, a roll back, a load)."""
        for home in self.weight_homes():
            home.begin_update()

    def compute_tier(self, b: Bucket) -> Tier:
        return self.state[b.index].compute_tier

    def built(self) -> None:
        """Every home's initial writes have landed (NOTE [Initial writes in flight]); after all
        were waited for, the first error is raised."""
        error: Optional[BaseException] = None
        every: list[StateHome | WeightHome] = [*self.state_homes(), *self.weight_homes()]
        for home in every:
            try:
                home.built()
            except BaseException as e:  # noqa: BLE001 - the others are drained first, then it is raised
                error = error or e
        if error is not None:
            raise error

    def add(self, other: "Homes") -> None:
        """The homes of buckets appended to the model (NOTE [Freezing and unfreezing])."""
        assert not (other.grads.keys() & self.grads.keys()), "appended buckets reuse an index"
        self.grads.update(other.grads)
        self.state.update(other.state)
        self.weights.update(other.weights)


def wait_gathered(homes: Homes, fill: int) -> None:
    """Every grad home brings its grads where Adam runs; returns when all have arrived."""
    wait_all([h for home in homes.grad_homes() for h in home.gather(fill)])
