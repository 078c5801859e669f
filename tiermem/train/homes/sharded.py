"""A rank's shard as one more home (NOTE [Data parallel]): each class of home wrapped so the
step, the checkpoint and the model see the same interfaces as in one process.

- :class:`ShardedGrads`: the device's gradients of a whole bucket accumulate in a device buffer
  (zeroed, so a parameter this rank never saw counts as 0), reduce-scattered into this rank's
  chunk, in bucket order on every rank, as soon as the bucket is complete; the chunk's mean
  lands in the inner GRAD home (host memory; under update_in_backward, the window of NOTE
  [Updates in backward], which takes each chunk as it lands).
- :class:`ShardedState`: the inner OPTIM_STATE home (host or NVMe) holds this rank's chunk of
  every bucket. Read by the model (checkpoint, ``state_dict``), it all-gathers whole buckets into
  one host buffer set; written from a checkpoint, it keeps its chunk of the whole bucket given.
- :class:`ShardedWeights`: Adam's new low-precision weights of this rank's chunk are all-gathered
  into every rank's full device copy (the inner WEIGHT home).

The step runs on the shard buckets (:func:`shard_buckets`): a bucket's chunk, its slots the
pieces of the parameters that fall inside it.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from tiermem.handles import Handle
from tiermem.plan.buckets import Bucket, Slot
from tiermem.train.homes.grad_homes import GradHome
from tiermem.train.homes.state_homes import StateHome
from tiermem.train.homes.store_keys import Part, bucket_key
from tiermem.train.homes.update_runs import Runs, StateViews
from tiermem.train.homes.weight_homes import WeightHome
from tiermem.transfer.collectives import Chunk, Group, Pending
from tiermem.transfer.service import CopyService
from tiermem.types import TensorClass, Tier


def chunk_of(group: Group, b: Bucket) -> Chunk:
    """This rank's chunk of ``b`` (NOTE [Chunks cut where the state allows])."""
    return group.chunk(b.numel, b.chunk_size(group.world))


def _landing_key(b: Bucket, copy: bool = False) -> str:
    """The device buffer whole bucket ``b``'s grads accumulate in, to be reduce-scattered; with
    ``copy``, the copy of it that a pass which must leave it be sends (:class:`ShardedGrads`)."""
    return str(bucket_key(b, Part.GRAD_LANDING_COPY if copy else Part.GRAD_LANDING))


def shard_buckets(buckets: Sequence[Bucket], group: Group) -> list[Bucket]:
    """Each bucket's chunk for this rank, as a bucket of its own (same index and placement)."""
    out = []
    for b in buckets:
        c = chunk_of(group, b)
        sb = Bucket(b.index, b.grad_tier, b.state_tier, b.group, b.param_tier, state=b.state)
        for s in b.slots:
            lo, hi = c.overlap(s.offset, s.numel)
            if lo < hi:
                sb.slots.append(
                    Slot(s.name, s.param, lo - c.start, hi - lo, torch.Size([hi - lo]), s.order, first=lo - s.offset)
                )
        sb.numel = c.size  # the chunk with its padding: every rank's chunk is the same size
        out.append(sb)
    return out


class ShardedGrads(GradHome):
    def __init__(
        self,
        buckets: Sequence[Bucket],
        shards: Sequence[Bucket],
        inner: GradHome,
        group: Group,
        device_store,
        engine: CopyService,
        *,
        holds: Optional[Callable[[Bucket], bool]] = None,
        keeps: Callable[[], bool] = lambda: False,
    ):
        """``holds(shard bucket)``: whether the buffer ``inner.landing`` gives next holds grads of
        this step that the chunk is added to; by default, whether an earlier backward of the step
        landed one there. An inner home whose buffers come and go within a step (the window
        under update_in_backward, NOTE [Updates in backward]) says it itself. ``keeps()``: the
        backward running now must leave what ``tm.no_sync()`` accumulated on the device as it is
        (a first pass under update_in_backward, whose graph runs again): it adds to a copy."""
        self.landing_tier = Tier.DEVICE
        self._holds = holds if holds is not None else (lambda sb: sb.index in self._have)
        self._keeps = keeps
        self._copies: dict[int, torch.Tensor] = {}  # by bucket: a copy of its landing buffer, sent instead
        self._unsent: set[int] = set()  # buckets whose landing buffer holds grads of a backward inside no_sync()
        self.full = {b.index: b for b in buckets}
        self.shards = {b.index: b for b in shards}
        self.inner, self.group, self.store, self.engine = inner, group, device_store, engine
        self.deferred = False  # no_sync(): accumulate locally, communicate on a later backward
        self._landing: dict[int, torch.Tensor] = {}
        self._arrived: dict[int, int] = {}
        self._issued: set[int] = set()  # buckets communicated in this backward
        self._next = 0  # buckets are communicated in index order on every rank
        self._complete: set[int] = set()
        self._pending: list[tuple[Pending, int, torch.Tensor, int]] = []  # (work, index, out, fill)
        self._have: set[int] = set()  # shard buckets holding this step's grads already
        self._dirty = False  # a backward ran since the last communication
        self._fill = 0

    def landing(self, b: Bucket, fill: int) -> torch.Tensor:
        self._dirty = True
        self._fill = fill  # the inner buffer this backward's chunks land in (two alternate under overlap_step)
        if self.deferred:
            self._unsent.add(b.index)
        elif b.index in self._unsent and self._keeps():
            return self._copy(b)
        t = self._landing.get(b.index)
        if t is None:
            c = chunk_of(self.group, b)
            t = self.store.allocate(_landing_key(b), (c.padded,), torch.float32, TensorClass.GRAD).zero_()
            self._landing[b.index] = t
        return t

    def _copy(self, b: Bucket) -> torch.Tensor:
        """A copy of ``b``'s landing buffer (what ``tm.no_sync()`` left there), made at this
        backward's first use of it; the copy is sent and freed, the buffer stays for a later pass."""
        t = self._copies.get(b.index)
        if t is None:
            kept = self._landing[b.index]
            t = self.store.allocate(_landing_key(b, copy=True), kept.shape, torch.float32, TensorClass.GRAD)
            t.copy_(kept)
            self._copies[b.index] = t
        return t

    def arrived(self, b: Bucket) -> None:
        self._arrived[b.index] = self._arrived.get(b.index, 0) + 1
        if self._arrived[b.index] >= len(b.slots):
            self._complete.add(b.index)
            if not self.deferred:
                self._issue_ready()

    def _issue_ready(self) -> None:
        while self._next in self.full and (self._next in self._complete or self._next in self._issued):
            if self._next not in self._issued:
                self._issue(self._next)
            self._next += 1

    def _issue(self, index: int) -> None:
        b = self.full[index]
        full = self.landing(b, self._fill)  # a bucket no grad reached on this rank contributes zeros
        c = chunk_of(self.group, b)
        # in place: this rank's chunk of the bucket receives the mean (NCCL and gloo reduce-scatter so
        # when the output is the input's own chunk), so no second device buffer per bucket in flight
        out = full[c.start : c.start + c.size]
        self._pending.append((self.group.reduce_scatter_mean_async(out, full), index, out, self._fill))
        self._issued.add(index)
        while len(self._pending) > self.IN_FLIGHT:  # the device holds a few buckets of fp32 grads, not all
            self._land(*self._pending.pop(0))

    #: reduce-scatters in flight before the oldest is waited for and its device buffers freed
    IN_FLIGHT = 2

    def _land(self, work: Pending, index: int, out: torch.Tensor, fill: int) -> None:
        work.wait()
        sb = self.shards[index]
        adds = self._holds(sb)  # asked before landing(), which may fill the buffer it gives
        self.engine.copy_async(
            self.inner.landing(sb, fill),
            out,
            src_tier=Tier.DEVICE,
            dst_tier=self.inner.landing_tier,
            accumulate=adds,
            kind=TensorClass.GRAD,
        ).wait()
        self.inner.complete(sb)  # grads on NVMe: written there now, not kept on the host
        self._have.add(index)
        copied = self._copies.pop(index, None) is not None
        self.store.delete(_landing_key(sb, copy=copied))
        if not copied:
            self._landing.pop(index, None)
            self._unsent.discard(index)

    def end_backward(self) -> None:
        self._arrived.clear()
        self._dirty = True  # even a backward that reached no parameter of this rank's buckets
        if not self.deferred:  # every bucket goes out, in order, complete or not; landed before returning
            self.wait()
        self._complete.clear()

    def wait(self) -> None:
        """Every bucket's chunk is in the inner home. After a backward every bucket is sent, in
        order, whether this rank got grads for it or not (every rank sends the same sequence);
        grads kept back by no_sync() go out here, at the step."""
        if self._dirty:
            self._complete.update(self.full)
            self._issue_ready()
            self._dirty = False
        pending, self._pending = self._pending, []
        for item in pending:
            self._land(*item)
        self.inner.wait()
        self._issued.clear()
        self._complete.clear()
        self._next = 0

    def defer(self, on: bool) -> None:
        self.inner.defer(on)  # first: an inner home that refuses it leaves this one unchanged
        self.deferred = on

    def gather(self, fill: int) -> list[Handle]:
        return self.inner.gather(fill)

    def read(self, b: Bucket, fill: int):
        return self.inner.read(b, fill)

    def drop(self) -> None:
        self._dirty = False
        for work, *_ in self._pending:
            try:
                work.wait()
            except Exception:  # noqa: BLE001 - draining after the error that matters
                pass
        self._pending.clear()
        self.end_step()
        self.inner.drop()

    def _free(self) -> None:
        """Every device buffer goes: landing buffers and their copies."""
        for index in list(self._copies):
            self.store.delete(_landing_key(self.full[index], copy=True))
        for index in list(self._landing):
            self.store.delete(_landing_key(self.full[index]))
        self._copies.clear()
        self._landing.clear()
        self._unsent.clear()

    def end_step(self) -> None:
        """The step's grads are consumed or dropped: a step skipped after a first pass under
        update_in_backward leaves what no_sync() accumulated on the device; it goes too."""
        self._free()
        self._have.clear()
        self._issued.clear()
        self._complete.clear()
        self._arrived.clear()
        self._next = 0
        self.inner.end_step()

    def has(self, index: int) -> bool:
        return index in self._have


class ShardedState(StateHome):
    """This rank's chunk of every bucket's optimizer state, in ``inner``; whole buckets for the
    model (all-gathered when read, sliced when written)."""

    revertible = False  # a failed step under data parallelism stops every rank: resume from a checkpoint

    def __init__(self, buckets: Sequence[Bucket], shards: Sequence[Bucket], inner: StateHome, group: Group, host_store):
        self.compute_tier = inner.compute_tier
        self.full = {b.index: b for b in buckets}
        self.shards = {b.index: b for b in shards}
        self.inner, self.group, self.host = inner, group, host_store
        self._padded = max(chunk_of(group, b).padded for b in buckets)
        self._set: dict[str, torch.Tensor] = {}  # whole-bucket buffers, only while the model reads or writes

    def _part(self, b: Bucket, i: int) -> torch.Tensor:
        """The whole-bucket buffer of part ``i`` of ``b``'s state (elementwise: ``padded`` elements)."""
        part = b.state.parts[i]
        dtype = "" if part.dtype == torch.float32 else f":{str(part.dtype).removeprefix('torch.')}"
        key = f"shard gather:{part.name}{dtype}"
        if key not in self._set:
            self._set[key] = self.host.allocate(key, (self._padded,), part.dtype, TensorClass.OPTIM_STATE)
        return self._set[key]

    def _whole(self, b: Bucket) -> StateViews:
        return tuple(self._part(b, i)[:n] for i, n in enumerate(b.part_numels()))

    def _blocked(self, b: Bucket, i: int) -> tuple[int, int, list[int]]:
        """Part ``i`` of ``b`` is blocked: where this rank's piece starts in the whole part, the most
        any rank keeps, and each rank's count (NOTE [Chunks cut where the state allows]): the
        ranks' pieces back to back in rank order are the whole part."""
        world = self.group.world
        counts = [b.chunk_part_numels(world, r)[i] for r in range(world)]
        return sum(counts[: self.group.rank]), max(counts), counts

    def release_views(self) -> None:
        for key in list(self._set):
            self.host.delete(key)
        self._set.clear()

    def initial_master(self, b: Bucket) -> torch.Tensor:
        return self._part(b, 0)[: b.numel]  # the other parts start at their initial value: no whole buffers for them

    def initial_span(self, b: Bucket) -> tuple[int, int]:
        c = chunk_of(self.group, b)
        return c.start, c.end

    def agree(self, b: Bucket) -> None:
        self.group.broadcast_(self.initial_master(b))  # every rank starts from rank 0's weights

    def initialize(self, b: Bucket) -> None:
        master = self.initial_master(b)  # rank 0's (agree()), or the same on every rank: its chunk read
        c, sb = chunk_of(self.group, b), self.shards[b.index]
        mine = self.inner.initial_master(sb)
        mine.zero_()
        mine[: c.end - c.start].copy_(master[c.start : c.end])
        self.inner.initialize(sb)

    def built(self) -> None:
        self.inner.built()

    def step(self, plan, update, tracer, updated):
        return self.inner.step(plan, update, tracer, updated)

    def revert(self, undo) -> None:
        self.inner.revert(undo)

    def read(self, b: Bucket) -> StateViews:
        padded = chunk_of(self.group, b).padded
        for i, mine in enumerate(self.inner.read(self.shards[b.index])):
            if b.state.parts[i].block == 1:
                self.group.all_gather(self._part(b, i)[:padded], mine)
                continue
            _, most, counts = self._blocked(b, i)
            sent = torch.zeros(most, dtype=mine.dtype)
            sent[: counts[self.group.rank]].copy_(mine[: counts[self.group.rank]])
            every = torch.empty(most * self.group.world, dtype=mine.dtype)
            self.group.all_gather(every, sent)
            whole, at = self._part(b, i), 0
            for r, n in enumerate(counts):
                whole[at : at + n].copy_(every[r * most : r * most + n])
                at += n
        return self._whole(b)

    def load_views(self, b: Bucket) -> StateViews:
        return self._whole(b)

    def store(self, b: Bucket, views: StateViews) -> None:
        c, sb = chunk_of(self.group, b), self.shards[b.index]
        mine = self.inner.load_views(sb)
        for i, (dst, src) in enumerate(zip(mine, views)):
            dst.zero_()
            if b.state.parts[i].block == 1:
                dst[: c.end - c.start].copy_(src[c.start : c.end])
            else:
                at, _, counts = self._blocked(b, i)
                n = counts[self.group.rank]
                dst[:n].copy_(src[at : at + n])
        self.inner.store(sb, mine)

    # -- this rank's chunk alone (a sharded checkpoint: NOTE [Sharded values for DCP]) -------------
    @property
    def resident(self) -> bool:  # type: ignore[override]
        return self.inner.resident

    def read_local(self, b: Bucket) -> StateViews:
        return self.inner.read(self.shards[b.index])

    def local_views(self, b: Bucket) -> StateViews:
        c = chunk_of(self.group, b)
        mine = self.inner.load_views(self.shards[b.index])
        for i, t in enumerate(mine):  # the chunk's padding stays zero, as :meth:`store` leaves it
            t[c.end - c.start if b.state.parts[i].block == 1 else self._blocked(b, i)[2][self.group.rank] :].zero_()
        return mine

    def store_local(self, b: Bucket, views: StateViews) -> None:
        self.inner.store(self.shards[b.index], views)

    def whole_master(self, b: Bucket, mine: torch.Tensor) -> torch.Tensor:
        self.group.all_gather(self._part(b, 0)[: chunk_of(self.group, b).padded], mine)
        return self._part(b, 0)[: b.numel]


class ShardedWeights(WeightHome):
    """The full working weights in ``inner`` on every rank; a step's chunk is all-gathered into them."""

    def __init__(self, buckets: Sequence[Bucket], inner: WeightHome, group: Group, engine: CopyService):
        """``group``: the weights' own (NOTE [Data parallel]): under overlap_step their gathers run
        on the engine's thread while backward reduce-scatters grads on the caller's."""
        self.full = {b.index: b for b in buckets}
        self.inner, self.group, self.engine = inner, group, engine

    def initialize(self, b: Bucket, master: torch.Tensor) -> None:
        self.inner.initialize(b, master)

    def built(self) -> None:
        self.inner.built()

    def write(self, b: Bucket, src: torch.Tensor, runs: Runs, src_tier: Tier) -> list[Handle]:
        """The gather starts here, in bucket order on every rank; an engine lane waits for it and
        sends the whole bucket home, while Adam runs on the next bucket."""
        full_b = self.full[b.index]
        c = chunk_of(self.group, full_b)
        whole = torch.empty(c.padded, dtype=src.dtype, device=src.device)
        gathering = self.group.all_gather_async(whole, src[: c.size])  # `src` holds the chunk's complete new weights

        def land() -> None:
            gathering.wait()
            for h in self.inner.write(full_b, whole[: full_b.numel], [(0, full_b.numel, 0)], src_tier):
                h.wait()  # `whole` lives until its copy is done

        # not on the upload lane itself: the copies `land` queues there would wait behind it
        return [self.engine.run_async(land, name=f"gather {b.key}", lane="compute")]

    def load(self, b: Bucket, master: torch.Tensor, src_tier: Tier) -> None:
        self.inner.load(b, master, src_tier)

    def begin_update(self) -> None:
        self.inner.begin_update()

    def end_update(self) -> None:
        self.inner.end_update()
