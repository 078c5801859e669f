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

import logging
import time
from concurrent.futures import Future
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from tiermem.errors import TierMemError
from tiermem.handles import Handle, chain
from tiermem.memory.base import Store
from tiermem.memory.resident import HostStore
from tiermem.observe.trace import Tracer
from tiermem.transfer.copies import Copies
from tiermem.transfer.lanes import Issue, Lanes, event
from tiermem.transfer.lease import Lease
from tiermem.transfer.stats import TransferStats
from tiermem.types import TensorClass, Tier

log = logging.getLogger(__name__)


class TransferEngine:
    """The keyless copy service (:class:`~tiermem.transfer.service.CopyService`): copies between
    tiers, store requests and background work, each a handle, in its lane's order. Keyed residency
    (register a tensor, move it by key) is :class:`~tiermem.transfer.residency.KeyedResidency`,
    built on this."""

    def __init__(
        self, stores: Mapping[Tier, Store], *, device: torch.device | str | None = None, tracer: Optional[Tracer] = None
    ):
        self.stores = dict(stores)
        self.tracer = tracer
        dev_store = self.stores.get(Tier.DEVICE)
        self.device = torch.device(device if device is not None else getattr(dev_store, "device", "cpu"))
        self.stats = TransferStats(tracer=tracer)
        self.lanes = Lanes(self.device)
        self._copies = Copies(self.lanes, self.stats, self.lease)
        self._closed = False

    # -- requests ---------------------------------------------------------------------------------
    def copy_async(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        src_tier: Tier,
        dst_tier: Tier,
        accumulate: bool = False,
        kind: Optional[TensorClass] = None,
        after: Optional[Handle] = None,
    ) -> Handle:
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
                raise TierMemError(
                    f"tiermem: copy_async(after=...) chains copies between two tiers, "
                    f"not within {src_tier}; wait for the request first"
                )
            (dst.add_(src) if accumulate else dst.copy_(src))
            self.stats.count(src_tier, dst_tier, nbytes=src.numel() * src.element_size(), kind=kind)
            return Handle.completed(dst)
        lane = "d2h" if src_tier == Tier.DEVICE else "h2d"
        # Ordering: after what the caller's stream queued (src written, dst's memory free), taken
        # now, on the caller's thread, even when the copy starts later (NOTE [Chained requests]).
        ready = self.ready()

        def issue() -> Handle:
            return self.lanes.request(
                lane,
                lambda: self._copies.one(dst, src, lane, ready, accumulate, src_tier, dst_tier, kind),
                self.stats.stall_sink(dst_tier),
            )

        if after is None or after.succeeded():  # nothing to wait for: issue it now
            return issue()
        return self.chain(after, issue, stall=dst_tier)

    def copy_many(
        self,
        copies: Sequence[tuple[torch.Tensor, torch.Tensor, bool]],
        *,
        src_tier: Tier,
        dst_tier: Tier,
        kind: Optional[TensorClass] = None,
    ) -> Handle:
        """Several :meth:`copy_async` requests, ``(dst, src, accumulate)`` each, as one: one turn
        of the lane and one completion for all (a bucket's gradients), done in the order given.
        Within one tier they run on the caller's thread."""
        if src_tier == dst_tier:
            for dst, src, accumulate in copies:
                self.copy_async(dst, src, src_tier=src_tier, dst_tier=dst_tier, accumulate=accumulate, kind=kind)
            return Handle.completed(None)
        lane = "d2h" if src_tier == Tier.DEVICE else "h2d"
        ready = self.ready()  # ordering: after what the caller's stream queued (NOTE [Chained requests])
        copies = list(copies)
        return self.lanes.request(
            lane,
            lambda: self._copies.many(copies, lane, ready, src_tier, dst_tier, kind),
            self.stats.stall_sink(dst_tier),
        )

    def store_write(
        self, tier: Tier, key: str, src: torch.Tensor, *, src_tier: Tier = Tier.HOST, kind: Optional[TensorClass] = None
    ) -> Handle:
        """Write ``src`` (a buffer on ``src_tier``) to ``tier``'s store under ``key`` without
        registry bookkeeping (for buffers the caller manages, e.g. streamed optimizer state);
        bytes, busy time and stalls are counted like any other move."""
        h = self.store(tier).write(key, src, kind)
        self.landed(tier, src)
        return self.observe(h, src_tier, tier, src, kind)

    def store_read(
        self, tier: Tier, key: str, out: torch.Tensor, *, dst_tier: Tier = Tier.HOST, kind: Optional[TensorClass] = None
    ) -> Handle:
        """Read ``key`` from ``tier``'s store into ``out`` (a buffer on ``dst_tier``)."""
        h = self.store(tier).read(key, out)
        self.landed(tier, out)
        return self.observe(h, tier, dst_tier, out, kind)

    def request(self, lane: str, issue: Issue, *, stall: Tier) -> Handle:
        """Run ``issue`` on ``lane`` (a move between stores that the caller builds, e.g. by key):
        the handle completes once its GPU work is done and its ``finish`` ran (NOTE [Issued, then
        done] in :mod:`tiermem.transfer.lanes`); a wait on it counts to ``stall``."""
        return self.lanes.request(lane, issue, self.stats.stall_sink(stall))

    def observe(self, h: Handle, src: Tier, dst: Tier, t: torch.Tensor, kind: Optional[TensorClass] = None) -> Handle:
        """Count a store request (busy: from the request to its end, queueing included)."""
        t0 = time.perf_counter()
        nbytes = t.numel() * t.element_size()

        def done(f: Future[Any]) -> None:
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

        def timed() -> object:
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

    def lease(self, nbytes: int, key: str, kind: Optional[TensorClass] = None) -> Lease:
        """A pooled host buffer of ``nbytes`` accounted to ``key`` as ``kind``, until its
        ``release()`` (NOTE [Pooled staging]); refused with OutOfTierMemory over the budget."""
        host = self.store(Tier.HOST)
        assert isinstance(host, HostStore), "the host tier's store pools buffers"
        return Lease(host, nbytes, key, kind)

    def behind(self, lane: str) -> Handle:
        """A handle that is done once every request queued on ``lane`` so far has finished; a
        chain on it runs ``then`` on that lane, before the lane takes its next request."""
        return Handle(self.lanes.behind(lane), on_stall=self.stats.stall_sink(Tier.HOST))

    def chain(
        self,
        first: Union[Handle, Sequence[Handle]],
        then: Optional[Callable[[], Any]] = None,
        *,
        cleanup: Optional[Callable[[], None]] = None,
        stall: Tier = Tier.HOST,
    ) -> Handle:
        """One handle for "``then()`` once ``first`` has finished" (NOTE [Chained requests]).

        ``first``: a handle, or several (the chain starts when all are done; the first error in
        the order given wins). ``then``: no arguments; it may return a handle, which the chain
        then follows; without ``then`` the chain ends with ``first``'s result (a list for
        several). ``cleanup``: runs once when the chain ends, on every path, before its handle
        completes (e.g. ``lease.release``). ``stall``: the tier a wait on the handle counts to.
        """
        return chain(first, then, cleanup=cleanup, on_stall=self.stats.stall_sink(stall))

    def close(self) -> None:
        if self._closed:
            return
        self.lanes.close()  # waits for what the lanes have queued
        self._closed = True

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- for what is built on the engine (keyed residency) --------------------------------------
    def store(self, tier: Tier) -> Store:
        """The store of ``tier``, or a ``tiermem:`` error saying how to configure one."""
        try:
            return self.stores[tier]
        except KeyError:
            fix = (
                "pass nvme_dir=... to place tensors on NVMe"
                if tier == Tier.NVME
                else f"build the engine with a store for {tier}"
            )
            raise TierMemError(f"tiermem: no {tier} store is configured; {fix}") from None

    def ready(self) -> Optional[torch.cuda.Event]:
        """On a GPU, an event on the calling thread's current stream: a copy that waits on it
        starts after what that stream has queued so far (None on the CPU)."""
        return self.lanes.ready()

    def landed(self, tier: Tier, t: torch.Tensor) -> None:
        """A memory store copies on the caller's stream (``non_blocking``); a copy between host
        and device is waited for here, so the completed handle the store returns is true."""
        if self.lanes.cuda and tier != Tier.NVME and (tier == Tier.DEVICE) != t.is_cuda:
            done = event()
            done.record(torch.cuda.current_stream(self.device))
            done.synchronize()  # ordering: the store's handle is done, so the bytes have landed
