"""The round trip of an offloaded activation: device -> host (-> NVMe) during forward, back
during backward, and its buffers freed once autograd is done with it.

Only :mod:`tiermem.train.activations` uses this; it decides *what* moves, this module moves it, through
the engine's lanes (``copy_async``) and the NVMe store's handles.

# NOTE [Activation lifecycle]
A record is one storage saved for backward, whichever of its views autograd saved.
send (forward): the storage's device bytes are reserved, a pooled host buffer is acquired and a
DEVICE->HOST copy is queued on the engine's d2h lane. The record holds the device storage until
that copy lands, then drops it (so torch can free it) and releases its device bytes. For NVMe
the host buffer is staging: it returns to the pool once the NVMe write lands.
fetch (backward): DEVICE <- HOST, or DEVICE <- HOST <- NVME through a pooled staging buffer,
into fresh device bytes; each saved view is rebuilt over them with its own dtype, size, stride
and offset, so the views of one storage (q, k and v of one qkv projection) share one copy. A
fetch is queued only after the record's send chain finished, so it reads what was written; if
the copy to the host has not landed yet, the fetch keeps the device storage instead. Waiting on
a fetch's handle counts as stall on the device tier.
retire (autograd dropped the packed object: the node ran, or the graph was freed unused): once
nothing of the record is in flight its host buffer returns to the pool, its device bytes are
released, and its NVMe file is deleted, in a batch on the engine's compute lane at ``flush()``.
``settle()`` (the end of ``TieredModel.backward``) waits for retired records still in flight, so
after backward everything of its graph is back in the pools.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from tiermem.memory.ledger import Ledger
from tiermem.errors import OutOfTierMemory
from tiermem.handles import Handle
from tiermem.types import TensorClass, Tier

log = logging.getLogger(__name__)

_ACT = TensorClass.ACTIVATION
_DEVICE_HINT = ("reduce the batch size or sequence length, offload activations "
                "(tiermem.policies.ActivationOffload), or raise Budgets(device=...)")


@dataclass
class ActivationStats:
    """What the activation hooks did, counted over the model's life."""

    saved: int = 0  # tensors saved for backward during training forwards
    weights: int = 0  # of which parameters or buffers (or views of them): never moved
    offloaded: Counter = field(default_factory=Counter)  # Tier -> storages sent there
    offloaded_bytes: Counter = field(default_factory=Counter)  # Tier -> bytes sent there
    by_module: Counter = field(default_factory=Counter)  # module name -> storages offloaded
    fetched_ahead: int = 0  # fetches started by the unpack of a record saved later
    fetched_on_demand: int = 0  # fetches started by their own unpack
    still_on_device: int = 0  # fetches that found the device storage not yet dropped


class Record:
    """One offloaded storage (every saved view of it shares the record); see NOTE [Activation
    lifecycle]. Bytes move as they lie in the storage, so views come back exactly as they were."""

    __slots__ = ("n", "tier", "index", "nbytes", "key", "back_key", "nvme_key", "device", "base", "stored",
                 "fetch", "fetch_future", "keep", "retired", "freed")

    def __init__(self, n: int, tier: Tier, nbytes: int, index: int, prefix: str):
        self.n, self.tier, self.index, self.nbytes = n, tier, index, nbytes
        self.key, self.nvme_key = f"<activation {n}>", f"{prefix}.{n}"  # ledger key, NVMe key
        self.back_key = f"<activation {n} back>"  # device bytes of the copy fetched for backward
        self.device: Optional[torch.Tensor] = None  # the storage's bytes, until their copy lands
        self.base: Optional[torch.Tensor] = None  # the pooled host buffer (home, or NVMe staging)
        self.stored: Optional[Future] = Future()  # done once the bytes sit at their tier
        self.fetch: Optional[Handle] = None  # the device bytes coming back
        self.fetch_future: Optional[Future] = None
        self.keep = False  # the fetch came before the copy landed: keep the device bytes
        self.retired = False
        self.freed: Optional[Future] = None  # retired with transfers in flight: done once freed


class ActivationMover:
    """Sends, fetches and frees offloaded activations; thread-safe (lanes call back into it)."""

    def __init__(self, stores: dict, engine, stats: ActivationStats, prefix: str):
        self.stores, self.engine, self.stats, self.prefix = stores, engine, stats, prefix
        self.device = torch.device(engine.device)
        self.dev: Ledger = stores[Tier.DEVICE].ledger
        self.host = stores[Tier.HOST]
        self._stall = engine.stats.stall_sink(Tier.DEVICE)
        self._lock = threading.RLock()  # callbacks may run at once on the thread holding it
        self._ids = itertools.count()
        self._doomed: list[str] = []  # NVMe keys of retired records, deleted in a batch
        self._retiring: set[Record] = set()  # retired, waiting for their transfers to end
        self.closed = False

    # -- forward --------------------------------------------------------------------------------
    def send(self, storage: torch.UntypedStorage, tier: Tier, index: int, what: str) -> Record:
        """Start moving ``storage`` (on the device) to ``tier``."""
        rec = Record(next(self._ids), tier, storage.nbytes(), index, self.prefix)
        # Reservations are made without holding self._lock: a full device ledger may call its
        # reclaim hook, which can wait on the lanes, whose callbacks take the lock.
        reserve_device(self.dev, rec.key, rec.nbytes, what)
        try:
            rec.base = self._acquire_host(rec.key, rec.nbytes)
        except BaseException:
            self.dev.release(rec.key)
            raise
        rec.device = _bytes(storage)
        copy = self.engine.copy_async(rec.base[:rec.nbytes], rec.device, src_tier=Tier.DEVICE, dst_tier=Tier.HOST,
                                      kind=_ACT)
        copy.add_done_callback(lambda f: self._landed(rec, f))
        return rec

    def _landed(self, rec: Record, f: Future) -> None:
        """The DEVICE->HOST copy finished (on the d2h lane)."""
        with self._lock:  # atomic with fetch's look at rec.device
            if not rec.keep:
                rec.device = None  # torch may free the device tensor now
                self.dev.release(rec.key)
        err = f.exception()
        if err is not None:
            rec.stored.set_exception(err)
        elif rec.tier is Tier.HOST:
            rec.stored.set_result(None)
        else:
            t0 = time.perf_counter()
            _chain(lambda: self.stores[Tier.NVME].write(rec.nvme_key, rec.base[:rec.nbytes], _ACT), rec.stored,
                   lambda: self._written(rec, t0), cleanup=lambda: self._drop_base(rec))

    def _written(self, rec: Record, t0: float) -> None:
        """The NVMe write landed: count it, give the staging buffer back."""
        self._moved(Tier.HOST, Tier.NVME, rec.nbytes, t0)
        self._drop_base(rec)
        rec.stored.set_result(None)

    # -- backward -------------------------------------------------------------------------------
    def fetch(self, rec: Record, *, ahead: bool) -> Optional[Handle]:
        """Start bringing ``rec`` back (once); ``ahead``: speculative, so give up quietly when the
        device budget has no room or the record already retired."""
        with self._lock:
            if rec.fetch is not None or rec.retired:
                return rec.fetch
            if rec.device is not None:  # its copy has not landed: keep the device tensor
                rec.keep = True
                rec.fetch = Handle.completed(rec.device)
                self.stats.still_on_device += 1
                return rec.fetch
            done = rec.fetch_future = Future()
            rec.fetch = Handle(done, on_stall=self._stall)
        try:  # outside the lock, see send()
            reserve_device(self.dev, rec.back_key, rec.nbytes, "an offloaded activation coming back")
        except OutOfTierMemory as e:
            with self._lock:
                rec.fetch = rec.fetch_future = None
            done.set_exception(e)  # a retirement may be waiting on it
            if ahead:
                return None  # it comes when its own unpack asks
            raise
        out = torch.empty(rec.nbytes, dtype=torch.uint8, device=self.device)
        if ahead:
            self.stats.fetched_ahead += 1
        else:
            self.stats.fetched_on_demand += 1
        _after([rec.stored], lambda err: done.set_exception(err) if err else self._bring_back(rec, out, done))
        return rec.fetch

    def _bring_back(self, rec: Record, out: torch.Tensor, done: Future) -> None:
        if rec.tier is Tier.HOST:
            _chain(lambda: self.engine.copy_async(out, rec.base[:rec.nbytes], src_tier=Tier.HOST, kind=_ACT,
                                                  dst_tier=Tier.DEVICE), done, lambda: done.set_result(out))
            return
        key = f"{rec.key} staging"
        try:
            staging = self._acquire_host(key, rec.nbytes)
        except BaseException as e:  # noqa: BLE001 - surfaces at unpack, on the fetch's handle
            done.set_exception(e)
            return
        release = lambda: self.host.release(key, staging)  # noqa: E731
        t0 = time.perf_counter()

        def upload() -> None:
            self._moved(Tier.NVME, Tier.HOST, rec.nbytes, t0)
            _chain(lambda: self.engine.copy_async(out, staging[:rec.nbytes], src_tier=Tier.HOST, kind=_ACT,
                                                  dst_tier=Tier.DEVICE),
                   done, lambda: (release(), done.set_result(out)), cleanup=release)

        _chain(lambda: self.stores[Tier.NVME].read(rec.nvme_key, staging[:rec.nbytes]), done, upload,
               cleanup=release)

    # -- retire ---------------------------------------------------------------------------------
    def retire(self, rec: Record) -> None:
        with self._lock:
            rec.retired = True
            pending = [f for f in (rec.stored, rec.fetch_future) if f is not None and not f.done()]
            if pending:
                rec.freed = Future()
                self._retiring.add(rec)
        _after(pending, lambda _err: self._free(rec))

    def _free(self, rec: Record) -> None:
        with self._lock:
            rec.device = rec.fetch = rec.fetch_future = None
            rec.stored = None  # its callbacks refer to rec: let the cycle go without the GC
            self.dev.release(rec.key)
            self.dev.release(rec.back_key)
            if rec.tier is Tier.NVME and not self.closed:
                self._doomed.append(rec.nvme_key)
            self._retiring.discard(rec)
        self._drop_base(rec)
        if rec.freed is not None:
            rec.freed.set_result(None)

    def settle(self) -> None:
        """Wait until every retired record is freed: a copy still queued when backward was done
        with its tensor (the lane fell behind) lands first. Time waiting counts as stall."""
        with self._lock:
            waiting = [rec.freed for rec in self._retiring]
        for freed in waiting:
            Handle(freed, on_stall=self._stall).wait()
        self.flush()

    def _drop_base(self, rec: Record) -> None:
        with self._lock:
            base, rec.base = rec.base, None
        if base is not None:
            self.host.release(rec.key, base)

    def flush(self) -> None:
        """Delete the NVMe files of retired records, on the engine's compute lane."""
        with self._lock:
            keys, self._doomed = self._doomed, []
        if not keys or self.closed:
            return
        store = self.stores[Tier.NVME]

        def delete() -> None:
            for key in keys:
                try:
                    store.delete(key)
                except OSError as e:  # StoreError too: a leftover file is not worth failing a step
                    log.warning("tiermem: could not delete offloaded activation %r: %s", key, e)
                except RuntimeError as e:  # the interpreter is exiting: the store's threads are gone
                    log.debug("tiermem: offloaded activation %r left on disk: %s", key, e)
        self.engine.run_async(delete, name="delete activations")

    # -- helpers --------------------------------------------------------------------------------
    def _moved(self, src: Tier, dst: Tier, nbytes: int, t0: float) -> None:
        """Count an NVMe leg in the report (busy: from the request to its end, queueing included)."""
        self.engine.stats.add_moved(src, dst, nbytes, _ACT)
        self.engine.stats.add_busy(src, dst, time.perf_counter() - t0)

    def _acquire_host(self, key: str, nbytes: int) -> torch.Tensor:
        try:
            return self.host.acquire(nbytes, key, _ACT)
        except OutOfTierMemory as e:
            raise OutOfTierMemory(
                tier=e.tier, key="an offloaded activation", asked=nbytes, used=e.used, allowed=e.allowed,
                hint="raise Budgets(host=...), raise ActivationOffload's min_bytes so fewer activations "
                     "move, or send them to Tier.NVME") from None


def reserve_device(ledger: Ledger, key: str, nbytes: int, what: str) -> None:
    """Account activation bytes on the device; over budget, say what to change."""
    try:
        ledger.reserve(key, nbytes, _ACT)
    except OutOfTierMemory as e:
        raise OutOfTierMemory(tier=e.tier, key=what, asked=nbytes, used=e.used, allowed=e.allowed,
                              hint=_DEVICE_HINT) from None


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """All of ``storage`` as a flat uint8 tensor (it keeps the storage alive)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def view_of(data: torch.Tensor, dtype: torch.dtype, size: tuple, stride: tuple, offset: int) -> torch.Tensor:
    """A tensor of ``dtype`` laid over the bytes of ``data`` as a saved view lay over its storage."""
    return torch.empty(0, dtype=dtype, device=data.device).set_(data.untyped_storage(), offset, size, stride)


def _after(futures: list[Future], fn: Callable[[Optional[BaseException]], None]) -> None:
    """Call ``fn(first error or None)`` once every future is done (at once if none is pending)."""
    if not futures:
        fn(None)
        return
    left, lock, errors = [len(futures)], threading.Lock(), []

    def one(f: Future) -> None:
        err = f.exception()
        with lock:
            if err is not None:
                errors.append(err)
            left[0] -= 1
            last = left[0] == 0
        if last:
            fn(errors[0] if errors else None)
    for f in futures:
        f.add_done_callback(one)


def _chain(start: Callable[[], Handle], done: Future, then: Callable[[], Any], *,
           cleanup: Optional[Callable[[], Any]] = None) -> None:
    """Start a request; when it succeeds run ``then``; when it (or ``then``) fails run
    ``cleanup`` and fail ``done`` with the error, so whoever waits on ``done`` sees it."""
    def fail(err: BaseException) -> None:
        if cleanup is not None:
            cleanup()
        if not done.done():
            done.set_exception(err)

    def finished(f: Future) -> None:
        err = f.exception()
        if err is not None:
            fail(err)
            return
        try:
            then()
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            fail(e)
    try:
        handle = start()
    except BaseException as e:  # noqa: BLE001 - handed to the waiter
        fail(e)
        return
    handle.add_done_callback(finished)
