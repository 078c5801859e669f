"""The transfer engine: the only place that touches CUDA streams, events and worker threads.

Every move is a request that returns a :class:`~tiermem.handles.Handle`. Copies between the
memory tiers run on one worker thread per direction (device->host, host->device), so requests in
one direction complete in the order they were made, like a CUDA stream; on a GPU that worker
issues the copy on a side stream and moves on, and a completion thread sees it land (NOTE
[Issued, then done] in :mod:`tiermem.transfer.lanes`); on the CPU it does the copy itself, so the
same asynchrony and ordering are exercised on a machine without an accelerator. A consumer on
the GPU joins a request with :meth:`TransferEngine.join` (its stream waits on the copy's event),
one on the host with ``wait()``. Moves that
touch NVMe run on an NVMe lane and go through the NVMe store's own I/O threads; device<->NVMe
moves are staged through a pooled host buffer.

Destination memory is allocated on the caller's thread, so a move that would break a budget
fails at the call with :class:`~tiermem.errors.OutOfTierMemory`, before anything is touched.

# NOTE [Chained requests]
A request that must wait for another (write to NVMe what a device->host copy brings, copy to
the device what an NVMe read brings, give a buffer back once a write lands) is one handle made by
:meth:`TransferEngine.chain`: ``then()`` runs once ``first`` (one handle or several) has finished
without error, and the chain ends with what ``then`` returned, or, if that is a handle (a request
``then`` issued), with that request's result or error. ``cleanup()`` runs exactly once when the
chain ends, whichever way, before its handle completes. An error anywhere ends the chain with it.
``then`` runs on whichever thread finished ``first`` (a lane, a lane's completion thread, an NVMe
I/O thread, or the caller's own when ``first`` is already done), so it only issues requests, never waits, and never
issues a device copy with plain ``copy_async``: that orders the copy after the *current* stream
of the thread it runs on. A copy that must follow a request is ``copy_async(..., after=handle)``,
which records the ordering against the caller's stream at the call and joins its lane once
``after`` succeeded.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from tiermem.errors import TierMemError
from tiermem.handles import Handle, chain
from tiermem.memory.registry import Registry, Residency
from tiermem.memory.base import Store
from tiermem.memory.resident import HostStore, _MemoryStore, nbytes_of
from tiermem.transfer.copies import Copies
from tiermem.transfer.lanes import GpuWork, Lanes, event
from tiermem.transfer.lease import Lease
from tiermem.transfer.stats import TransferStats
from tiermem.types import TensorInfo, Tier

log = logging.getLogger(__name__)


class TransferEngine:
    """Moves registered tensors between tiers asynchronously and keeps the registry truthful."""

    def __init__(self, stores: Mapping[Tier, Store], registry: Optional[Registry] = None, *,
                 device: torch.device | str | None = None, tracer=None):
        self.stores = dict(stores)
        self.tracer = tracer
        self.registry = registry if registry is not None else Registry()
        dev_store = self.stores.get(Tier.DEVICE)
        self.device = torch.device(device if device is not None else getattr(dev_store, "device", "cpu"))
        self.stats = TransferStats(tracer=tracer)
        self.lanes = Lanes(self.device)
        self._copies = Copies(self.lanes, self.stats, self.lease)
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
        self._landed_on_caller_stream(tier, tensor)
        if src_tier is not None and src_tier != tier:
            h = self._observe(h, src_tier, tier, tensor, r.info.kind)
        self.registry.write_at(key, tier)
        if wait:
            h.wait()
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
        self._store(src).read(key, out).wait()
        self._landed_on_caller_stream(src, out)
        return Handle.completed(out)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, *, src_tier: Tier, dst_tier: Tier,
                   accumulate: bool = False, kind: object = None, after: Optional[Handle] = None) -> Handle:
        """Copy ``src`` into ``dst`` (or add it, when ``accumulate``), converting dtype as needed.

        Requests between two different tiers run on that direction's lane, in the order made;
        a request within one tier runs on the caller's thread. ``src`` must not be written until
        the handle is done; the caller may drop its own reference at once. ``kind`` (a
        TensorClass) is what the report counts the bytes as. ``after``: start only once that
        request succeeded (it fails with its error otherwise), in the lane's order from then on;
        the copy is still ordered after the caller's stream as it is now (NOTE [Chained requests]).
        """
        if src_tier == dst_tier:
            if after is not None:
                raise TierMemError(f"tiermem: copy_async(after=...) chains copies between two tiers, "
                                   f"not within {src_tier}; wait for the request first")
            (dst.add_(src) if accumulate else dst.copy_(src))
            self.stats.count(src_tier, dst_tier, nbytes=src.numel() * src.element_size(), kind=kind)
            return Handle.completed(dst)
        lane = "d2h" if src_tier == Tier.DEVICE else "h2d"
        # Ordering: after what the caller's stream queued (src written, dst's memory free), taken
        # now, on the caller's thread, even when the copy starts later (NOTE [Chained requests]).
        ready = self._ready()

        def issue() -> Handle:
            return self.lanes.request(lane, lambda: self._copies.one(dst, src, lane, ready, accumulate, src_tier,
                                                                      dst_tier, kind),
                                      self.stats.stall_sink(dst_tier))
        if after is None or after.succeeded():  # nothing to wait for: issue it now
            return issue()
        return self.chain(after, issue, stall=dst_tier)

    def copy_many(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor, bool]], *, src_tier: Tier,
                  dst_tier: Tier, kind: object = None) -> Handle:
        """Several :meth:`copy_async` requests, ``(dst, src, accumulate)`` each, as one: one turn
        of the lane and one completion for all (a bucket's gradients), done in the order given.
        Within one tier they run on the caller's thread."""
        if src_tier == dst_tier:
            for dst, src, accumulate in copies:
                self.copy_async(dst, src, src_tier=src_tier, dst_tier=dst_tier, accumulate=accumulate, kind=kind)
            return Handle.completed(None)
        lane = "d2h" if src_tier == Tier.DEVICE else "h2d"
        ready = self._ready()  # ordering: after what the caller's stream queued (NOTE [Chained requests])
        copies = list(copies)
        return self.lanes.request(lane, lambda: self._copies.many(copies, lane, ready, src_tier, dst_tier, kind),
                                  self.stats.stall_sink(dst_tier))

    def store_write(self, tier: Tier, key: str, src: torch.Tensor, *, src_tier: Tier = Tier.HOST,
                    kind: object = None) -> Handle:
        """Write ``src`` (a buffer on ``src_tier``) to ``tier``'s store under ``key`` without
        registry bookkeeping (for buffers the caller manages, e.g. streamed optimizer state);
        bytes, busy time and stalls are counted like any other move."""
        h = self._store(tier).write(key, src, kind)
        self._landed_on_caller_stream(tier, src)
        return self._observe(h, src_tier, tier, src, kind)

    def store_read(self, tier: Tier, key: str, out: torch.Tensor, *, dst_tier: Tier = Tier.HOST,
                   kind: object = None) -> Handle:
        """Read ``key`` from ``tier``'s store into ``out`` (a buffer on ``dst_tier``)."""
        h = self._store(tier).read(key, out)
        self._landed_on_caller_stream(tier, out)
        return self._observe(h, tier, dst_tier, out, kind)

    def store_revert(self, tier: Tier, key: str) -> None:
        """Undo the latest write of ``key`` in ``tier``'s store (see NvmeStore.revert)."""
        self._store(tier).revert(key)

    def _observe(self, h: Handle, src: Tier, dst: Tier, t: torch.Tensor, kind: object = None) -> Handle:
        """Count a store request (busy: from the request to its end, queueing included)."""
        t0 = time.perf_counter()
        nbytes = t.numel() * t.element_size()

        def done(f) -> None:
            if f.exception() is None:
                self.stats.count(src, dst, t0=t0, nbytes=nbytes, kind=kind)
        h.add_done_callback(done)
        return h.observed(self.stats.stall_sink(dst))

    def run_async(self, fn: Callable[[], object], *, name: str = "compute", lane: str = "compute") -> Handle:
        """Run ``fn`` on the engine's compute thread (e.g. a CPU optimizer step that overlaps the
        next forward and backward), or behind the requests already queued on another ``lane``
        ("d2h", "h2d"). Requests on a lane run one at a time, in the order made. On a GPU ``fn``
        runs on the lane's own stream, after what the caller's stream has queued so far; the
        handle completes once what ``fn`` queued there is done, and a GPU consumer may
        :meth:`join` it as soon as ``fn`` returned."""
        def timed():
            t0 = time.perf_counter()
            try:
                return fn()
            finally:
                if self.tracer is not None:
                    self.tracer.add(name, "compute", t0, time.perf_counter())
        return self.lanes.run(lane, timed, self.stats.stall_sink(Tier.HOST))

    def join(self, handle: Handle) -> Any:
        """Wait for ``handle`` as a GPU consumer: once its GPU work is queued, the caller's
        current stream waits on it (``wait_event``) and the host goes on; returns the request's
        value, a device tensor marked used by that stream. Requests without a GPU stage (and
        everything on the CPU) are waited for (NOTE [Issued, then done])."""
        issued = handle.wait_issued() if self.lanes.cuda else None
        if issued is None or issued.failed or issued.event is None:
            return handle.wait()
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(issued.event)  # ordering: the caller's next kernels read what the copy wrote
        value = issued.value
        if isinstance(value, torch.Tensor) and value.is_cuda:
            value.record_stream(stream)  # ordering: not reused before this stream is done with it
        return value

    def lease(self, nbytes: int, key: str, kind: object = None) -> Lease:
        """A pooled host buffer of ``nbytes`` accounted to ``key`` as ``kind``, until its
        ``release()`` (NOTE [Pooled staging]); refused with OutOfTierMemory over the budget."""
        host = self._store(Tier.HOST)
        assert isinstance(host, HostStore), "the host tier's store pools buffers"
        return Lease(host, nbytes, key, kind)

    def behind(self, lane: str) -> Handle:
        """A handle that is done once every request queued on ``lane`` so far has finished; a
        chain on it runs ``then`` on that lane, before the lane takes its next request."""
        return Handle(self.lanes.behind(lane), on_stall=self.stats.stall_sink(Tier.HOST))

    def chain(self, first: Union[Handle, Sequence[Handle]], then: Optional[Callable[[], Any]] = None, *,
              cleanup: Optional[Callable[[], None]] = None, stall: Tier = Tier.HOST) -> Handle:
        """One handle for "``then()`` once ``first`` has finished" (NOTE [Chained requests]).

        ``first``: a handle, or several (the chain starts when all are done; the first error in
        the order given wins). ``then``: no arguments; it may return a handle, which the chain
        then follows; without ``then`` the chain ends with ``first``'s result (a list for
        several). ``cleanup``: runs once when the chain ends, on every path, before its handle
        completes (e.g. ``lease.release``). ``stall``: the tier a wait on the handle counts to.
        """
        return chain(first, then, cleanup=cleanup, on_stall=self.stats.stall_sink(stall))

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
        self.lanes.close()
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
        # The copy must not start before the compute stream has finished writing the source.
        ready = self._ready() if Tier.DEVICE in (src, dst) else None
        lane = "nvme" if Tier.NVME in (src, dst) else ("d2h" if src == Tier.DEVICE else "h2d")
        self.registry.begin(key, src, dst)
        handle = self.lanes.request(lane, lambda: self._run(r, src, dst, out, lane, ready, then_drop),
                                    self.stats.stall_sink(dst))
        with self._lock:
            self._pending[key] = (dst, handle)
        handle.add_done_callback(lambda _f, k=key, h=handle: self._forget(k, h))
        return handle

    def _forget(self, key: str, handle: Handle) -> None:
        with self._lock:
            if self._pending.get(key, (None, None))[1] is handle:
                del self._pending[key]

    def _run(self, r: Residency, src: Tier, dst: Tier, out: Optional[torch.Tensor], lane: str,
             ready, then_drop: Optional[Tier]):
        """Issue a move on its lane; the registry learns of it once it is done."""
        t0 = time.perf_counter()
        key = r.key

        def failed() -> None:
            self.stats.count(src, dst, t0=t0)
            self.registry.finish(key, ok=False)
            self._store(dst).delete(key)  # dst held no valid copy; free what we allocated for it
        try:
            gpu = self._copy(key, r.info, src, dst, out, lane, ready)
        except BaseException:
            failed()
            raise

        def finish() -> None:
            try:
                if gpu is not None:
                    gpu.wait()
            except BaseException:
                failed()
                raise
            self.stats.count(src, dst, t0=t0, seconds=gpu.seconds() if gpu is not None else None,
                             nbytes=r.info.nbytes, kind=r.info.kind)  # a GPU copy: its own time on its stream
            self.registry.finish(key, ok=True)
            if then_drop is not None:
                self.registry.drop(key, then_drop)
                self._store(then_drop).delete(key)
        return gpu, (out if dst == Tier.DEVICE else None), finish

    def _copy(self, key: str, info: TensorInfo, src: Tier, dst: Tier, out: Optional[torch.Tensor],
              lane: str, ready) -> Optional[GpuWork]:
        """Issue the copy; returns its GPU work when it may still run (memory -> memory on a GPU),
        else None: NVMe legs are done on return."""
        src_store, dst_store = self._store(src), self._store(dst)
        if out is not None and isinstance(src_store, _MemoryStore):  # memory -> memory
            return self.lanes.memcpy(out, src_store.get(key), lane, ready)
        if out is not None:  # NVMe -> memory
            if dst == Tier.DEVICE and self.lanes.cuda:
                with self.lease(nbytes_of(info.shape, info.dtype), f"<staging {key}>") as lease:
                    buf = lease.view(info.dtype, info.shape)
                    src_store.read(key, buf).wait()
                    self.lanes.memcpy(out, buf, "h2d", ready).wait()  # ordering: the staging goes back after
            else:
                src_store.read(key, out.view(-1) if out.dim() else out).wait()
        else:  # memory -> NVMe
            tensor = src_store.get(key)  # type: ignore[attr-defined]
            if src == Tier.DEVICE and self.lanes.cuda:
                with self.lease(nbytes_of(info.shape, info.dtype), f"<staging {key}>") as lease:
                    buf = lease.view(info.dtype, info.shape)
                    self.lanes.memcpy(buf, tensor, "d2h", ready).wait()  # ordering: landed before the write
                    dst_store.write(key, buf, info.kind).wait()
            else:
                dst_store.write(key, tensor, info.kind).wait()
        return None

    def _ready(self) -> Optional[torch.cuda.Event]:
        """On a GPU, an event on the calling thread's current stream: a copy that waits on it
        starts after what that stream has queued so far (None on the CPU)."""
        return self.lanes.ready()

    def _landed_on_caller_stream(self, tier: Tier, t: torch.Tensor) -> None:
        """A memory store copies on the caller's stream (``non_blocking``); a copy between host
        and device is waited for here, so the completed handle the store returns is true."""
        if self.lanes.cuda and tier != Tier.NVME and (tier == Tier.DEVICE) != t.is_cuda:
            done = event()
            done.record(torch.cuda.current_stream(self.device))
            done.synchronize()  # ordering: the store's handle is done, so the bytes have landed

