"""Weights sharded over the ranks (ZeRO-3): each rank keeps 1/N of every bucket's working weights
at home, and a bucket is gathered whole on the device while its weights are read.

# NOTE [Weights sharded over the ranks]
Under data parallelism the buckets whose weights live off the device (and, with
``TieredModel(..., shard_weights=True)``, those on the device too) are cut into ``world`` chunks
like their grads and optimizer state (NOTE [Data parallel] in tiermem/transfer/collectives.py):
rank r keeps only chunk r of the bucket's flat working weights, on the weights' home tier
(:mod:`tiermem.train.weights.weight_shards`: the device's or the host's memory, or an NVMe key). Adam's
new weights of the chunk go there after the step, and nowhere else: no all-gather follows the step,
unlike ZeRO-2's replicated weights.

Each parameter of such a bucket is an :class:`~tiermem.train.weights.offdevice.OffDeviceWeight` (NOTE
[Weights off the device are a tensor subclass]) whose values :class:`GatheredWeights` holds: a
bucket is *gathered* (every rank's chunk read at home and all-gathered into a device buffer of
``padded`` elements on every rank) and a parameter's values are a view of it at the slot's
offset. The unit is a bucket, not a module: one all-gather of a few MiB rather than one per
module (DeepSpeed ZeRO-3's per-submodule gathers are what its users find slow).

Two ways in, as in one process (NOTE [Parameters off the device]): a forward pre-hook of each
module holds the buckets of its own parameters until its forward hook releases them (a forward
recomputed by activation checkpointing, reentrant or not, runs them again), and any other op
reading such a weight (backward's formulas, another module's code, user code) holds its bucket
for that op. Whether a bucket is gathered, kept or freed is decided by
:class:`~tiermem.transfer.gather_schedule.GatherSchedule` from the accesses alone (NOTE [A gather
schedule every rank takes alike]): a gather is a collective, so every rank must issue the same
ones in the same order, and nothing that differs between ranks (the room activations leave on
the device) may change them. The gathers run on a process group of their own
(``group.for_gathers()``), each announced by a header every rank checks
(:class:`~tiermem.train.weights.weight_shards.Gatherer`): ranks whose forwards read different weights stop
with an error naming the buckets, never mixing two buckets' bytes. At the end of each iteration
(the step) the ranks compare their accesses in the same way; the next iteration gathers ahead
along them only if every rank made the same.

The step's ordering follows ZeRO-2's: new weights are written home at the step (with
``overlap_step``, when the next step lands the background update), after every gathered bucket
was freed (:meth:`GatheredWeights.begin_update`); the gathers the next forward needs start after
that, at the end of the step. Reading a sharded weight is collective: every rank must make the
same reads (a weight printed on rank 0 alone waits for the others until the group's timeout).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from tiermem.errors import TierMemError
from tiermem.handles import Handle
from tiermem.plan.buckets import Bucket, Slot
from tiermem.plan.footprint import gather_ahead
from tiermem.plan.placement import weights_from_master
from tiermem.train.homes.per_class import Runs, WeightHome
from tiermem.train.homes.sharded import chunk_of
from tiermem.train.hooks import HookSet, eager
from tiermem.train.weights.offdevice import Link, SwappedParams
from tiermem.train.weights.weight_shards import Gatherer, MasterShards, MemoryShards, NvmeShards, ShardHome
from tiermem.transfer.collectives import Group, Pending
from tiermem.transfer.gather_schedule import GatherSchedule
from tiermem.transfer.service import CopyService
from tiermem.types import TensorClass, Tier

log = logging.getLogger(__name__)


@dataclass
class _Gathered:
    """A bucket gathered on the device, or on its way: announced (``announced``: every rank's
    header on its way), then launched (``pending``: the data on its way), then ready (neither)."""

    buffer: torch.Tensor
    mine: torch.Tensor  # this rank's chunk, to send
    announced: Optional[Pending]
    pending: Optional[Pending]
    release: Callable[[], None]  # frees what the gather sent (a chunk read from NVMe)


class GatheredWeights(WeightHome):
    """The PARAM home of the sharded buckets, and the source of their weights' values: NOTE
    [Weights sharded over the ranks]. ``buckets``: the whole buckets it homes; ``shards``: each
    one's chunk home, by index; ``group``: the gathers' own process group, ``headers`` their
    headers' (NOTE [Announced, then launched]); ``ahead``: the bytes of gathered buckets kept or
    fetched ahead besides the held ones (the same on every rank)."""

    def __init__(
        self,
        module: torch.nn.Module,
        buckets: Sequence[Bucket],
        shards: dict[int, ShardHome],
        group: Group,
        headers: Group,
        device_store,
        dtype: torch.dtype,
        device: torch.device,
        hooks: HookSet,
        *,
        ahead: int,
        prefetch: bool = True,
    ):
        self.store, self.dtype, self.device, self.shards = device_store, dtype, device, shards
        self.full = {b.key: b for b in buckets}
        self.chunks = {b.index: chunk_of(group, b) for b in buckets}
        self.slots: dict[str, tuple[Bucket, Slot]] = {s.name: (b, s) for b in buckets for s in b.slots}
        self.homes = {name: shards[b.index].tier for name, (b, _) in self.slots.items()}
        self.gatherer = Gatherer(group, headers, {b.index: [s.name for s in b.slots] for b in buckets})
        self.schedule = GatherSchedule(
            {b.key: self.chunks[b.index].padded * dtype.itemsize for b in buckets}, ahead, prefetch=prefetch
        )
        self._gathered: dict[str, _Gathered] = {}
        self._queue: list[str] = []  # announced, not launched yet (NOTE [Announced, then launched])
        self._lock = threading.RLock()  # reads come from autograd's threads too
        self._swaps = SwappedParams(module, {name: s.param for name, (_, s) in self.slots.items()})
        self._link = Link(self)
        self._writable: Counter[str] = Counter()  # keys user code may write into (inside tm.resident)
        self._dirty: set[str] = set()
        self.on_demand: Counter[str] = Counter()  # with a trace, reads that waited for a gather started for them
        self.gathers = 0
        owned = {id(s.param): b.key for b, s in self.slots.values()}
        self.owners: dict[torch.nn.Module, list[str]] = {}
        self._holding: dict[torch.nn.Module, list[list[str]]] = {}  # module -> what each running call acquired
        for mod in module.modules():
            mine = list(dict.fromkeys(owned[id(p)] for p in mod.parameters(recurse=False) if id(p) in owned))
            if mine:
                self.owners[mod] = mine
                hooks.add(mod.register_forward_pre_hook(eager(self._before)))
                hooks.add(mod.register_forward_hook(eager(self._after), always_call=True))  # also when forward raises
        hooks.add(self)  # remove(): reads after the model is given back fail clearly

    # -- as a WeightHome ---------------------------------------------------------------------------
    def _chunk_of(self, b: Bucket, values: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of the whole bucket ``values``, padded with zeros, in its dtype."""
        c = self.chunks[b.index]
        mine = torch.zeros(c.size, dtype=values.dtype, device=values.device)
        mine[: c.end - c.start].copy_(values[c.start : c.end])
        return mine

    def initial_span(self, b: Bucket) -> tuple[int, int]:
        c = self.chunks[b.index]
        return c.start, c.end  # _chunk_of reads these alone

    def initialize(self, b: Bucket, master: torch.Tensor) -> None:
        """The chunk of ``b``'s first weights (``master`` rounded) at home; its parameters become
        OffDeviceWeights."""
        for h in self.shards[b.index].write(b, self._chunk_of(b, master).to(self.dtype), Tier.HOST):
            h.wait()
        for s in b.slots:
            self._swaps.swap_in(s.name, self._link, self.dtype, self.device)

    def in_place(self, b: Bucket, compute_tier: Tier) -> Optional[torch.Tensor]:
        return self.shards[b.index].in_place(b, compute_tier)

    def from_master(self, b: Bucket) -> bool:
        return self.shards[b.index].from_master

    def write(self, b: Bucket, src: torch.Tensor, runs: Runs, src_tier: Tier) -> list[Handle]:
        """``b`` is this rank's chunk (a shard bucket); ``src`` holds its complete new weights."""
        return self.shards[b.index].write(b, src, src_tier)

    def load(self, b: Bucket, master: torch.Tensor, src_tier: Tier) -> None:
        """``b`` is the whole bucket and ``master`` its weights (a checkpoint's): the chunk goes home."""
        for h in self.shards[b.index].write(b, self._chunk_of(b, master), src_tier):
            h.wait()

    def write_home(self, key: str, value: torch.Tensor) -> None:
        """``value`` (the whole parameter ``key``, in any float dtype) becomes its weight: this
        rank's piece of it goes into its bucket's chunk at home, and gathered copies no one holds
        are dropped. Not collective (each rank writes its own piece); for a frozen parameter (NOTE
        [Frozen weights sharded over the ranks] in tiermem/train/weights/frozen.py), whose chunk no update
        rewrites."""
        b, s = self.slots[key]
        c = self.chunks[b.index]
        lo, hi = c.overlap(s.offset, s.numel)
        self.begin_update()
        if lo >= hi:
            return
        mine, release = self.shards[b.index].read(b)
        try:
            chunk = mine[: c.size].to("cpu", copy=True)
        finally:
            release()
        chunk[lo - c.start : hi - c.start].copy_(value.detach().reshape(-1)[lo - s.offset : hi - s.offset])
        for h in self.shards[b.index].write(b, chunk, Tier.HOST):
            h.wait()

    def begin_update(self) -> None:
        """New weights are about to be written home: every gathered bucket no one holds is freed
        (its gather finished first: it may still be reading the chunk)."""
        with self._lock:
            for key in self.schedule.free_all():
                self._free(key)

    def end_update(self) -> None:
        """The iteration ends on every rank: they compare their accesses, which become the next
        iteration's trace if they agree, and the next forward's first buckets are gathered ahead."""
        with self._lock:
            self._launch()  # every rank launches what it announced before it ends the iteration
            agreed = self.gatherer.end(self.schedule.recording)
            if not agreed:
                log.warning(
                    "tiermem: the ranks read their sharded weights in different orders in this iteration; "
                    "the next one gathers on demand (NOTE [Weights sharded over the ranks])"
                )
            self._carry_out(*self.schedule.end_iteration(agreed=agreed))
            self._launch()  # every rank is here: nothing to wait for

    # -- gathers -----------------------------------------------------------------------------------
    # NOTE [Announced, then launched]
    # A gather is announced when the schedule decides it (its header goes to every rank,
    # asynchronously) and launched (its data all-gathered) once every rank's header has arrived
    # (looked at, without waiting, at each access) or when its bucket is needed, whichever comes
    # first, always in the order announced, so the k-th data collective is the same bucket on every
    # rank whenever each rank launches it. A rank thus runs ahead of another without waiting for it
    # at each gather, as with FSDP's prefetched all-gathers, and never sends a bucket's bytes before
    # every rank has said it gathers that bucket.
    def _carry_out(self, gather: list[str], free: list[str]) -> None:
        for key in free:
            self._free(key)
        for key in gather:
            self._announce(key)

    def _announce(self, key: str) -> None:
        b, c = self.full[key], self.chunks[self.full[key].index]
        mine, release = self.shards[b.index].read(b)
        try:
            buffer = self.store.allocate(f"{key}:gathered", (c.padded,), self.dtype, TensorClass.PARAM)
            announced = self.gatherer.announce(b, self.schedule.pos)
        except BaseException:
            release()
            self.store.delete(f"{key}:gathered")
            raise
        self._gathered[key] = _Gathered(buffer, mine[: c.size], announced, None, release)
        self._queue.append(key)
        self.gathers += 1

    def _launch(self, upto: Optional[str] = None, *, arrived: bool = False) -> None:
        """Launch the announced gathers in the order announced: all, or up to ``upto``, or (with
        ``arrived``) those whose every header is here already."""
        while self._queue:
            key = self._queue[0]
            g = self._gathered[key]
            assert g.announced is not None  # queued once announced, until launched
            if arrived and not g.announced.done():
                return
            self._queue.pop(0)
            announced, g.announced = g.announced, None
            g.pending = self.gatherer.launch(announced, g.buffer, g.mine)
            if key == upto:
                return

    def _ready(self, key: str) -> torch.Tensor:
        """``key`` gathered: its gather launched and waited for (a rank that stopped surfaces here, named)."""
        g = self._gathered[key]
        if g.announced is not None:
            self._launch(upto=key)
        if g.pending is not None:
            pending, g.pending = g.pending, None
            try:
                pending.wait()
            finally:
                g.release()
        return g.buffer

    def _free(self, key: str) -> None:
        if key not in self._gathered:
            return
        try:
            self._ready(key)  # every rank finishes the gathers it announced
        finally:
            self._gathered.pop(key, None)
            self.store.delete(f"{key}:gathered")

    def _acquire(self, key: str, *, counted: bool = False) -> torch.Tensor:
        with self._lock:
            self._launch(arrived=True)  # what earlier accesses announced goes out, if every rank has said so
            gather, free = self.schedule.acquire(key)
            if counted and key in gather and self.schedule.trace is not None:
                self.on_demand[key] += 1
            self._carry_out(gather, free)
            return self._ready(key)

    def _release(self, key: str) -> None:
        with self._lock:
            for k in self.schedule.release(key):
                self._free(k)
            self._launch(arrived=True)

    # -- reads -----------------------------------------------------------------------------------------
    def _before(self, mod: torch.nn.Module, args) -> None:
        taken: list[str] = []
        self._holding.setdefault(mod, []).append(taken)
        for key in self.owners[mod]:
            self._acquire(key)
            taken.append(key)

    def _after(self, mod: torch.nn.Module, args, out) -> None:
        stack = self._holding.get(mod)
        for key in stack.pop() if stack else []:
            self._release(key)

    def _view(self, name: str) -> torch.Tensor:
        b, s = self.slots[name]
        return self._gathered[b.key].buffer[s.offset : s.offset + s.numel].view(s.shape)

    @contextlib.contextmanager
    def holding(self, keys: Sequence[str], reader: str) -> Iterator[list[torch.Tensor]]:
        """The device tensors of ``keys`` for one op: their buckets held already by a running
        module or block, or acquired for the op (NOTE [Weights sharded over the ranks])."""
        taken: list[str] = []
        try:
            for key in dict.fromkeys(self.slots[k][0].key for k in keys):
                with self._lock:
                    if self.schedule.held[key]:
                        self._ready(key)
                        continue
                self._acquire(key, counted=True)
                taken.append(key)
            with self._lock:
                reals = [self._view(k) for k in keys]
            yield reals
        finally:
            for key in taken:
                self._release(key)

    def written(self, key: str, op: str) -> None:
        """An op writes into ``key``: allowed inside ``tm.resident(...)`` only."""
        with self._lock:
            if self._writable[key]:
                self._dirty.add(key)
                return
        raise TierMemError(
            f"tiermem: {op} writes into the weight {key!r}, which is sharded over the ranks; write "
            f"to it inside `with tm.resident(...)` on every rank, which sends the new values home "
            f"and to the optimizer's master weights"
        )

    @contextlib.contextmanager
    def resident(self, names: Sequence[str]) -> Iterator[dict[str, torch.Tensor]]:
        """Hold the buckets of ``names`` gathered for a block in which they may be written (on
        every rank: it gathers); yields the written ones' new values (host copies, filled in when
        the block ends), whose home has them."""
        held: list[str] = []
        written: dict[str, torch.Tensor] = {}
        marked: list[str] = []
        try:
            for key in dict.fromkeys(self.slots[n][0].key for n in names):
                self._acquire(key)
                held.append(key)
            with self._lock:
                for name in names:
                    self._writable[name] += 1
                    marked.append(name)
            yield written
            with self._lock:
                dirty = [n for n in names if n in self._dirty]
                for key in dict.fromkeys(self.slots[n][0].key for n in dirty):
                    b, c = self.full[key], self.chunks[self.full[key].index]
                    mine = self._gathered[key].buffer[c.start : c.start + c.size].to("cpu", copy=True)
                    for h in self.shards[b.index].write(b, mine, Tier.HOST):
                        h.wait()
                written.update({n: self._view(n).to("cpu", copy=True) for n in dirty})
        finally:
            with self._lock:
                for name in marked:
                    self._writable[name] -= 1
                    if not self._writable[name]:
                        del self._writable[name]
                        self._dirty.discard(name)
            for key in held:
                self._release(key)

    # -- the parameters ------------------------------------------------------------------------------
    def settle(self) -> None:
        self._swaps.settle()

    def undo(self) -> None:
        self._swaps.undo()

    def restore(self, values: dict[str, torch.Tensor]) -> None:
        self._swaps.restore(values)

    def remove(self) -> None:
        """The model is detached or given back: nothing is read through it any more, and the
        gathered buffers go, without waiting for a gather in flight: a rank may have launched one
        that another, dropping its model at another moment, never will (the collective holds its
        own references to the tensors until it ends, or fails at the group's timeout)."""
        self._link.source = None
        with self._lock:
            self._queue.clear()
            for g in list(self._gathered.values()):
                if g.pending is None and g.announced is None:
                    continue
                with contextlib.suppress(Exception):
                    g.release()
            for key in list(self._gathered):
                self.store.delete(f"{key}:gathered")
            self._gathered.clear()


def build_gathered(
    module: torch.nn.Module,
    buckets: Sequence[Bucket],
    stores: dict,
    engine: CopyService,
    group: Group,
    dtype: torch.dtype,
    device: torch.device,
    hooks: HookSet,
    *,
    prefetch: bool = True,
    overlap: bool = False,
) -> GatheredWeights:
    """The home of the sharded ``buckets`` (whole ones), its chunks on each bucket's PARAM tier:
    the one place that maps that tier to the class that keeps the chunks there (none kept where
    the master beside them gives them: NOTE [A chunk rounded from its master]). Collective (it
    makes the gathers' process group): every rank builds it, in the same order. On a CPU device the
    device's memory is the host's, so a chunk on the device beside its master on the host is
    rounded from it too."""
    sizes = {b.index: chunk_of(group, b).size for b in buckets}
    shards: dict[int, ShardHome] = {}
    on_cpu = device.type == "cpu"
    kinds = {
        b.index: (b.param_tier, b.state_tier, weights_from_master(b, True, overlap, device_is_host=on_cpu))
        for b in buckets
    }
    for tier, state_tier, derived in dict.fromkeys(kinds.values()):
        mine = [b for b in buckets if kinds[b.index] == (tier, state_tier, derived)]
        home: ShardHome = (
            NvmeShards(engine, sizes, dtype)
            if tier == Tier.NVME
            else MasterShards(stores[tier], stores[state_tier], mine, sizes, dtype)
            if derived
            else MemoryShards(stores[tier], engine, mine, sizes, dtype)
        )
        shards.update({b.index: home for b in mine})
    ahead = gather_ahead([chunk_of(group, b).padded * dtype.itemsize for b in buckets])
    return GatheredWeights(
        module,
        buckets,
        shards,
        group.for_gathers(),
        group.for_gather_headers(),
        stores[Tier.DEVICE],
        dtype,
        device,
        hooks,
        ahead=ahead,
        prefetch=prefetch,
    )
