"""The transfer engine: the only place that touches CUDA streams, events and worker threads.

Every move is a request that returns a :class:`~tiermem.handles.Handle`. Copies between the
memory tiers run on one worker thread per direction (device->host, host->device), so requests in
one direction complete in the order they were made, like a CUDA stream; on a GPU that worker
issues the copy on a side stream and waits on an event, on the CPU it does the copy itself, so
the same asynchrony and ordering are exercised on a machine without an accelerator. Moves that
touch NVMe run on an NVMe lane and go through the NVMe store's own I/O threads; device<->NVMe
moves are staged through a pooled host buffer.

Destination memory is allocated on the caller's thread, so a move that would break a budget
fails at the call with :class:`~tiermem.errors.OutOfTierMemory`, before anything is touched.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Optional

import torch

from tiermem.errors import TierMemError
from tiermem.handles import Handle
from tiermem.memory.registry import Registry, Residency
from tiermem.memory.base import Store
from tiermem.memory.resident import HostStore, _MemoryStore, nbytes_of
from tiermem.types import TensorInfo, Tier

log = logging.getLogger(__name__)


@dataclass
class TransferStats:
    """Counters the report reads: bytes per (src, dst), seconds the lanes were busy, and seconds
    callers stalled waiting, per destination tier."""

    bytes_moved: dict[tuple[Tier, Tier], int] = field(default_factory=lambda: defaultdict(int))
    class_bytes_moved: dict[tuple[object, Tier, Tier], int] = field(default_factory=lambda: defaultdict(int))
    busy_seconds: dict[tuple[Tier, Tier], float] = field(default_factory=lambda: defaultdict(float))
    stall_seconds: dict[Tier, float] = field(default_factory=lambda: defaultdict(float))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_moved(self, src: Tier, dst: Tier, nbytes: int, kind: object = None) -> None:
        with self._lock:
            self.bytes_moved[(src, dst)] += nbytes
            if kind is not None:
                self.class_bytes_moved[(kind, src, dst)] += nbytes

    def add_busy(self, src: Tier, dst: Tier, seconds: float) -> None:
        with self._lock:
            self.busy_seconds[(src, dst)] += seconds

    def stall_sink(self, tier: Tier) -> Callable[[float], None]:
        def sink(seconds: float) -> None:
            with self._lock:
                self.stall_seconds[tier] += seconds
        return sink

    @property
    def total_stall_seconds(self) -> float:
        return sum(self.snapshot()["stall_seconds"].values())

    def snapshot(self) -> dict[str, dict]:
        """Copies of the counters, taken under the lock (lane threads add keys as they run)."""
        with self._lock:
            return {"bytes_moved": dict(self.bytes_moved), "busy_seconds": dict(self.busy_seconds),
                    "stall_seconds": dict(self.stall_seconds), "class_bytes_moved": dict(self.class_bytes_moved)}


class TransferEngine:
    """Moves registered tensors between tiers asynchronously and keeps the registry truthful."""

    def __init__(self, stores: Mapping[Tier, Store], registry: Optional[Registry] = None, *,
                 device: torch.device | str | None = None, tracer=None):
        self.stores = dict(stores)
        self.tracer = tracer
        self.registry = registry if registry is not None else Registry()
        dev_store = self.stores.get(Tier.DEVICE)
        self.device = torch.device(device if device is not None else getattr(dev_store, "device", "cpu"))
        self.stats = TransferStats()
        # One worker per memory direction keeps requests in order, like a CUDA stream; the NVMe
        # lane has several, since each request there mostly waits on the store's I/O threads.
        self._lanes = {name: ThreadPoolExecutor(4 if name == "nvme" else 1, thread_name_prefix=f"tiermem-{name}")
                       for name in ("d2h", "h2d", "nvme", "compute")}
        self._streams = ({name: torch.cuda.Stream(self.device) for name in ("d2h", "h2d")}
                         if self.device.type == "cuda" else {})
        self._pending: dict[str, tuple[Tier, Handle]] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- public requests ----------------------------------------------------------------------
    def register(self, info: TensorInfo, home: Tier) -> Residency:
        if isinstance(home, Tier):
            self._store(home)  # fail now if the policy named a tier this engine has no store for
        return self.registry.register(info, home)

    def put(self, key: str, tensor: torch.Tensor, tier: Optional[Tier] = None, *,
            src_tier: Optional[Tier] = None, wait: bool = True) -> Handle:
        """Store ``tensor`` as the newest value of ``key`` on ``tier`` (default: its home); every
        other copy is dropped. ``src_tier`` (where ``tensor`` lives) counts the bytes as moved.
        With ``wait=False`` the write may still be running when this returns: keep ``tensor``
        unchanged until the handle is done; any later request for ``key`` waits for it."""
        r = self.registry.get(key)
        tier = r.home if tier is None else tier
        self._settle(key)
        for other in list(r.valid):
            if other != tier:
                self._store(other).delete(key)
        r.valid.clear()
        h = self._store(tier).write(key, tensor, r.info.kind)
        if src_tier is not None and src_tier != tier:
            h = self._observe(h, src_tier, tier, tensor, r.info.kind)
        self.registry.write_at(key, tier)
        if wait:
            h.wait()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the caller may reuse `tensor` now
            return Handle.completed(None)
        with self._lock:
            self._pending[key] = (tier, h)
        h.add_done_callback(lambda _f, k=key, hh=h: self._forget(k, hh))
        return h

    def prefetch(self, key: str, dst: Tier = Tier.DEVICE) -> Handle:
        """Make a valid copy of ``key`` resident on ``dst`` (keeping the others)."""
        r = self.registry.get(key)
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:
            if pending[0] == dst:
                return pending[1]
            self._settle(key)
        if dst in r.valid:
            return Handle.completed(None)
        src = r.fastest_valid()
        if src is None:
            raise TierMemError(f"tiermem: {key!r} holds no value yet; put() it before moving it")
        return self._launch(r, src, dst, then_drop=None)

    def evict(self, key: str, tier: Tier = Tier.DEVICE) -> Handle:
        """Release ``key``'s copy on ``tier``, first writing it back to its home if only ``tier``
        holds the newest value."""
        r = self.registry.get(key)
        self._settle(key)
        if tier not in r.valid:
            self._store(tier).delete(key)  # a stale copy may still hold memory
            return Handle.completed(None)
        if r.valid != {tier}:
            self.registry.drop(key, tier)
            self._store(tier).delete(key)
            return Handle.completed(None)
        if tier == r.home:
            raise TierMemError(f"tiermem: cannot evict {key!r} from {tier}, its home and only copy; "
                               f"move its home with the policy instead")
        return self._launch(r, tier, r.home, then_drop=tier)

    def fetch(self, key: str, out: torch.Tensor) -> Handle:
        """Copy the newest value of ``key`` into ``out`` without changing residency."""
        self._settle(key)
        r = self.registry.get(key)
        src = r.fastest_valid()
        if src is None:
            raise TierMemError(f"tiermem: {key!r} holds no value yet; put() it before reading it")
        h = self._store(src).read(key, out)
        h.wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return Handle.completed(out)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, *, src_tier: Tier, dst_tier: Tier,
                   accumulate: bool = False, kind: object = None) -> Handle:
        """Copy ``src`` into ``dst`` (or add it, when ``accumulate``), converting dtype as needed.

        Requests between two different tiers run on that direction's lane, in the order made;
        a request within one tier runs on the caller's thread. ``src`` must not be written until
        the handle is done; the caller may drop its own reference at once. ``kind`` (a
        TensorClass) is what the report counts the bytes as.
        """
        if src_tier == dst_tier:
            (dst.add_(src) if accumulate else dst.copy_(src))
            self.stats.add_moved(src_tier, dst_tier, src.numel() * src.element_size(), kind)
            return Handle.completed(dst)
        lane = "d2h" if src_tier == Tier.DEVICE else "h2d"
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))  # ordering: after src is written
        future = self._lanes[lane].submit(self._copy_or_add, dst, src, lane, ready, accumulate,
                                          src_tier, dst_tier, kind)
        return Handle(future, on_stall=self.stats.stall_sink(dst_tier))

    def store_write(self, tier: Tier, key: str, src: torch.Tensor, *, src_tier: Tier = Tier.HOST,
                    kind: object = None) -> Handle:
        """Write ``src`` (a buffer on ``src_tier``) to ``tier``'s store under ``key`` without
        registry bookkeeping (for buffers the caller manages, e.g. streamed optimizer state);
        bytes, busy time and stalls are counted like any other move."""
        return self._observe(self._store(tier).write(key, src, kind), src_tier, tier, src, kind)

    def store_read(self, tier: Tier, key: str, out: torch.Tensor, *, dst_tier: Tier = Tier.HOST,
                   kind: object = None) -> Handle:
        """Read ``key`` from ``tier``'s store into ``out`` (a buffer on ``dst_tier``)."""
        return self._observe(self._store(tier).read(key, out), tier, dst_tier, out, kind)

    def store_revert(self, tier: Tier, key: str) -> None:
        """Undo the latest write of ``key`` in ``tier``'s store (see NvmeStore.revert)."""
        self._store(tier).revert(key)

    def _observe(self, h: Handle, src: Tier, dst: Tier, t: torch.Tensor, kind: object = None) -> Handle:
        t0 = time.perf_counter()
        nbytes = t.numel() * t.element_size()

        def done(f) -> None:
            if f.exception() is None:
                self._account(src, dst, t0)
                self.stats.add_moved(src, dst, nbytes, kind)
        h.add_done_callback(done)
        return h.observed(self.stats.stall_sink(dst))

    def run_async(self, fn: Callable[[], object], *, name: str = "compute", lane: str = "compute") -> Handle:
        """Run ``fn`` on the engine's compute thread (e.g. a CPU optimizer step that overlaps the
        next forward and backward), or behind the requests already queued on another ``lane``
        ("d2h", "h2d"). Requests on a lane run one at a time, in the order made."""
        def timed():
            t0 = time.perf_counter()
            try:
                return fn()
            finally:
                if self.tracer is not None:
                    self.tracer.add(name, "compute", t0, time.perf_counter())
        return Handle(self._lanes[lane].submit(timed), on_stall=self.stats.stall_sink(Tier.HOST))

    def _copy_or_add(self, dst, src, lane, ready, accumulate, src_tier, dst_tier, kind) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            cross = self.device.type == "cuda" and src.device != dst.device
            if not accumulate and not (cross and src.dtype != dst.dtype):
                self._memcpy(dst, src, lane, ready)
            elif cross:  # convert on the host: a converting copy would allocate a temporary on the device
                with self._staging(f"<staging {id(src)}>", src.shape, src.dtype) as staged:
                    self._memcpy(staged, src, lane, ready)
                    (dst.add_(staged) if accumulate else dst.copy_(staged))
            else:
                dst.add_(src)
        finally:
            self._account(src_tier, dst_tier, t0)
        self.stats.add_moved(src_tier, dst_tier, src.numel() * src.element_size(), kind)
        return dst

    def _account(self, src: Tier, dst: Tier, t0: float) -> None:
        t1 = time.perf_counter()
        self.stats.add_busy(src, dst, t1 - t0)
        if self.tracer is not None:
            self.tracer.add(f"{src.value}->{dst.value}", "transfer", t0, t1)

    def delete(self, key: str) -> None:
        self._settle(key)
        r = self.registry.unregister(key)
        for tier in set(r.valid) | {r.home}:
            self._store(tier).delete(key)

    def synchronize(self) -> None:
        """Wait for every request in flight (errors are left on their own handles)."""
        with self._lock:
            handles = [h for _, h in self._pending.values()]
        for h in handles:
            with contextlib.suppress(Exception):
                h.wait()

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        if self._closed:
            return
        self.synchronize()
        for lane in self._lanes.values():
            lane.shutdown(wait=True)
        self._closed = True

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------
    def _store(self, tier: Tier) -> Store:
        try:
            return self.stores[tier]
        except KeyError:
            fix = ("pass nvme_dir=... to place tensors on NVMe" if tier == Tier.NVME else
                   f"build the engine with a store for {tier}")
            raise TierMemError(f"tiermem: no {tier} store is configured; {fix}") from None

    def _settle(self, key: str) -> None:
        """Wait for an in-flight transfer of ``key`` (its error stays on its own handle)."""
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:
            with contextlib.suppress(Exception):
                pending[1].wait()

    def _launch(self, r: Residency, src: Tier, dst: Tier, then_drop: Optional[Tier]) -> Handle:
        key, info = r.key, r.info
        dst_store = self._store(dst)
        # Allocate the destination now, on the caller's thread: a budget error surfaces here.
        out = (dst_store.allocate(key, info.shape, info.dtype, info.kind)
               if isinstance(dst_store, _MemoryStore) else None)
        ready = None
        if self.device.type == "cuda" and Tier.DEVICE in (src, dst):
            # The copy must not start before the compute stream has finished writing the source.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        lane = "nvme" if Tier.NVME in (src, dst) else ("d2h" if src == Tier.DEVICE else "h2d")
        self.registry.begin(key, src, dst)
        future = self._lanes[lane].submit(self._run, r, src, dst, out, lane, ready, then_drop)
        handle = Handle(future, on_stall=self.stats.stall_sink(dst))
        with self._lock:
            self._pending[key] = (dst, handle)
        future.add_done_callback(lambda _f, k=key, h=handle: self._forget(k, h))
        return handle

    def _forget(self, key: str, handle: Handle) -> None:
        with self._lock:
            if self._pending.get(key, (None, None))[1] is handle:
                del self._pending[key]

    def _run(self, r: Residency, src: Tier, dst: Tier, out: Optional[torch.Tensor], lane: str,
             ready, then_drop: Optional[Tier]) -> None:
        t0 = time.perf_counter()
        key = r.key
        try:
            self._copy(key, r.info, src, dst, out, lane, ready)
        except BaseException:
            self.registry.finish(key, ok=False)
            self._store(dst).delete(key)  # dst held no valid copy; free what we allocated for it
            raise
        finally:
            self._account(src, dst, t0)
        self.registry.finish(key, ok=True)
        self.stats.add_moved(src, dst, r.info.nbytes, r.info.kind)
        if then_drop is not None:
            self.registry.drop(key, then_drop)
            self._store(then_drop).delete(key)

    def _copy(self, key: str, info: TensorInfo, src: Tier, dst: Tier, out: Optional[torch.Tensor],
              lane: str, ready) -> None:
        src_store, dst_store = self._store(src), self._store(dst)
        if out is not None and isinstance(src_store, _MemoryStore):  # memory -> memory
            self._memcpy(out, src_store.get(key), lane, ready)
        elif out is not None:  # NVMe -> memory
            if dst == Tier.DEVICE and self.device.type == "cuda":
                with self._staging(f"<staging {key}>", info.shape, info.dtype) as buf:
                    src_store.read(key, buf).wait()
                    self._memcpy(out, buf, "h2d", ready)
            else:
                src_store.read(key, out.view(-1) if out.dim() else out).wait()
        else:  # memory -> NVMe
            tensor = src_store.get(key)  # type: ignore[attr-defined]
            if src == Tier.DEVICE and self.device.type == "cuda":
                with self._staging(f"<staging {key}>", info.shape, info.dtype) as buf:
                    self._memcpy(buf, tensor, "d2h", ready)
                    dst_store.write(key, buf, info.kind).wait()
            else:
                dst_store.write(key, tensor, info.kind).wait()

    @contextlib.contextmanager
    def _staging(self, tag: str, shape, dtype: torch.dtype) -> Iterator[torch.Tensor]:
        """A pooled (pinned) host buffer of ``shape`` and ``dtype`` for the length of a transfer."""
        host = self.stores[Tier.HOST]
        assert isinstance(host, HostStore)
        nbytes = nbytes_of(shape, dtype)
        base = host.acquire(nbytes, tag)
        try:
            yield base[:nbytes].view(dtype).view(shape)
        finally:
            host.release(tag, base)

    def _memcpy(self, dst: torch.Tensor, src: torch.Tensor, lane: str, ready) -> None:
        stream = self._streams.get(lane)
        if stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)  # ordering: after the compute stream's writes to src
            dst.copy_(src, non_blocking=True)
            for t in (src, dst):
                if t.is_cuda:
                    t.record_stream(stream)  # ordering: the allocator must not reuse t before the copy ends
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()  # ordering: the handle completes only once the bytes have landed
