"""The gathers of sharded buckets on the device (NOTE [Weights sharded over the ranks] in
:mod:`tiermem.train.weights.gathered`): :class:`BucketGathers` decides with its
:class:`~tiermem.transfer.gather_schedule.GatherSchedule` which bucket is gathered, kept or freed,
keeps each gathered bucket's device buffer, and fills it from every rank's chunk (read at the
chunk's home, :mod:`tiermem.train.weights.weight_shards`) through the
:class:`~tiermem.train.weights.weight_shards.Gatherer`'s announced collectives.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from tiermem.plan.buckets import Bucket
from tiermem.train.homes.store_keys import Part, bucket_key
from tiermem.train.weights.weight_shards import Gatherer, ShardHome
from tiermem.transfer.collectives import Chunk, Pending
from tiermem.transfer.gather_schedule import GatherSchedule
from tiermem.types import TensorClass

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


class BucketGathers:
    """The whole ``buckets`` gathered on the device, by bucket key: ``shards`` each one's chunk
    home and ``chunks`` its chunk, by index; their buffers in ``device_store``, in ``dtype``;
    ``ahead``: the bytes of gathered buckets kept or fetched ahead besides the held ones (the same
    on every rank). Every method but :meth:`buffer` takes ``lock`` (its owner's: reads come from
    autograd's threads too)."""

    def __init__(
        self,
        buckets: Sequence[Bucket],
        shards: dict[int, ShardHome],
        chunks: dict[int, Chunk],
        gatherer: Gatherer,
        device_store,
        dtype: torch.dtype,
        lock: threading.RLock,
        *,
        ahead: int,
        prefetch: bool = True,
    ):
        self.full = {b.key: b for b in buckets}
        self.shards, self.chunks, self.gatherer = shards, chunks, gatherer
        self.store, self.dtype, self._lock = device_store, dtype, lock
        self.schedule = GatherSchedule(
            {b.key: chunks[b.index].padded * dtype.itemsize for b in buckets}, ahead, prefetch=prefetch
        )
        self._gathered: dict[str, _Gathered] = {}
        self._queue: list[str] = []  # announced, not launched yet (NOTE [Announced, then launched])
        self.on_demand: Counter[str] = Counter()  # with a trace, reads that waited for a gather started for them
        self.count = 0  # gathers announced so far

    def _key(self, key: str) -> str:
        """The store key of bucket ``key``'s gathered buffer."""
        return str(bucket_key(self.full[key], Part.GATHERED))

    def buffer(self, key: str) -> torch.Tensor:
        """The device buffer of bucket ``key``, gathered (acquired, or held)."""
        return self._gathered[key].buffer

    def acquire(self, key: str, *, counted: bool = False) -> torch.Tensor:
        """Hold bucket ``key`` gathered (``counted``: for one op, counted when it waits for a gather
        started for it) until :meth:`release`; its buffer."""
        with self._lock:
            self._launch(arrived=True)  # what earlier accesses announced goes out, if every rank has said so
            gather, free = self.schedule.acquire(key)
            if counted and key in gather and self.schedule.trace is not None:
                self.on_demand[key] += 1
            self._carry_out(gather, free)
            return self._ready(key)

    def release(self, key: str) -> None:
        with self._lock:
            for k in self.schedule.release(key):
                self._free(k)
            self._launch(arrived=True)

    def ready_if_held(self, key: str) -> bool:
        """Whether bucket ``key`` is held already (then gathered, waited for)."""
        with self._lock:
            if not self.schedule.held[key]:
                return False
            self._ready(key)
            return True

    def free_all(self) -> None:
        """Every gathered bucket no one holds is freed (its gather finished first: it may still be
        reading the chunk)."""
        with self._lock:
            for key in self.schedule.free_all():
                self._free(key)

    def end_iteration(self) -> None:
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

    def drop(self) -> None:
        """The gathered buffers go, without waiting for a gather in flight: a rank may have launched
        one that another, dropping its model at another moment, never will (the collective holds its
        own references to the tensors until it ends, or fails at the group's timeout)."""
        with self._lock:
            self._queue.clear()
            for g in list(self._gathered.values()):
                if g.pending is None and g.announced is None:
                    continue
                with contextlib.suppress(Exception):
                    g.release()
            for key in list(self._gathered):
                self.store.delete(self._key(key))
            self._gathered.clear()

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
            buffer = self.store.allocate(self._key(key), (c.padded,), self.dtype, TensorClass.PARAM)
            announced = self.gatherer.announce(b, self.schedule.pos)
        except BaseException:
            release()
            self.store.delete(self._key(key))
            raise
        self._gathered[key] = _Gathered(buffer, mine[: c.size], announced, None, release)
        self._queue.append(key)
        self.count += 1

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
            self.store.delete(self._key(key))
