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
``padded`` elements on every rank, by :class:`~tiermem.train.weights.bucket_gathers.BucketGathers`)
and a parameter's values are a view of it at the slot's offset. The unit is a bucket, not a module: one all-gather of a few MiB rather than one per
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
from collections import Counter
from typing import Iterator, Optional, Sequence

import torch

from tiermem.handles import Handle
from tiermem.plan.buckets import Bucket, Slot
from tiermem.plan.footprint import gather_ahead
from tiermem.plan.placement import weights_from_master
from tiermem.train.homes.sharded import chunk_of
from tiermem.train.homes.update_runs import Runs
from tiermem.train.hooks import HookSet
from tiermem.train.weights.bucket_gathers import BucketGathers
from tiermem.train.weights.offdevice_home import OffDeviceHome
from tiermem.train.weights.weight_shards import Gatherer, MasterShards, MemoryShards, NvmeShards, ShardHome
from tiermem.transfer.collectives import Group
from tiermem.transfer.service import CopyService
from tiermem.types import Tier


class GatheredWeights(OffDeviceHome):
    """The PARAM home of the sharded buckets, and the source of their weights' values: NOTE
    [Weights sharded over the ranks]. ``buckets``: the whole buckets it homes; ``shards``: each
    one's chunk home, by index; ``group``: the gathers' own process group, ``headers`` their
    headers' (NOTE [Announced, then launched]); ``ahead``: the bytes of gathered buckets kept or
    fetched ahead besides the held ones (the same on every rank). A weight is held (and read) by
    its bucket, gathered by :class:`~tiermem.train.weights.bucket_gathers.BucketGathers`."""

    lives = "is sharded over the ranks"
    write_where = " on every rank"

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
        self.dtype, self.device, self.shards = dtype, device, shards
        self.full = {b.key: b for b in buckets}
        self.chunks = {b.index: chunk_of(group, b) for b in buckets}
        self.slots: dict[str, tuple[Bucket, Slot]] = {s.name: (b, s) for b in buckets for s in b.slots}
        self.homes = {name: shards[b.index].tier for name, (b, _) in self.slots.items()}
        units = {name: b.key for name, (b, _) in self.slots.items()}
        super().__init__(module, {name: s.param for name, (_, s) in self.slots.items()}, units, hooks)
        gatherer = Gatherer(group, headers, {b.index: [s.name for s in b.slots] for b in buckets})
        self._gathers = BucketGathers(
            buckets, shards, self.chunks, gatherer, device_store, dtype, self._lock, ahead=ahead, prefetch=prefetch
        )

    @property
    def gathers(self) -> int:
        """Gathers announced so far."""
        return self._gathers.count

    @property
    def on_demand(self) -> Counter[str]:
        """With a trace, the reads that waited for a gather started for them, by bucket key."""
        return self._gathers.on_demand

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
        """New weights are about to be written home: every gathered bucket no one holds is freed."""
        self._gathers.free_all()

    def end_update(self) -> None:
        """The iteration ends on every rank (:meth:`BucketGathers.end_iteration`)."""
        self._gathers.end_iteration()

    # -- reads (NOTE [Weights off the device are a tensor subclass]) --------------------------------
    def _hold(self, unit: str) -> torch.Tensor:
        return self._gathers.acquire(unit)

    def _unhold(self, unit: str) -> None:
        self._gathers.release(unit)

    def _view(self, name: str) -> torch.Tensor:
        b, s = self.slots[name]
        return self._gathers.buffer(b.key)[s.offset : s.offset + s.numel].view(s.shape)

    @contextlib.contextmanager
    def holding(self, keys: Sequence[str], reader: str) -> Iterator[list[torch.Tensor]]:
        """The device tensors of ``keys`` for one op: their buckets held already by a running
        module or block, or acquired for the op (NOTE [Weights sharded over the ranks])."""
        taken: list[str] = []
        try:
            for key in dict.fromkeys(self._unit[k] for k in keys):
                if self._gathers.ready_if_held(key):
                    continue
                self._gathers.acquire(key, counted=True)
                taken.append(key)
            with self._lock:
                reals = [self._view(k) for k in keys]
            yield reals
        finally:
            for key in taken:
                self._gathers.release(key)

    def _send_home(self, dirty: list[str], written: dict[str, torch.Tensor]) -> None:
        """The chunks of the buckets of ``dirty`` (whole on the device, held) go home."""
        with self._lock:
            for key in dict.fromkeys(self._unit[n] for n in dirty):
                b, c = self.full[key], self.chunks[self.full[key].index]
                mine = self._gathers.buffer(key)[c.start : c.start + c.size].to("cpu", copy=True)
                for h in self.shards[b.index].write(b, mine, Tier.HOST):
                    h.wait()
            written.update({n: self._view(n).to("cpu", copy=True) for n in dirty})

    def remove(self) -> None:
        """The model is detached or given back: nothing is read through it any more, and the
        gathered buffers go (:meth:`BucketGathers.drop`)."""
        super().remove()
        self._gathers.drop()


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
