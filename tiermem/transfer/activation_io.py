"""The round trip of an offloaded activation: device -> host (-> NVMe) during forward, back
during backward, and its buffers freed once autograd is done with it.

Only :mod:`tiermem.train.activations` uses this; it decides *what* moves, this module moves it.
Every leg is an engine request and every "after" is an engine chain (NOTE [Chained requests]);
the engine counts the bytes, the busy time and the stalls.

# NOTE [Activation lifecycle]
A record is one storage saved for backward, whichever of its views autograd saved.
send (forward): the storage's device bytes are reserved, a host buffer is leased from the pool
and a DEVICE->HOST copy is queued on the engine's d2h lane. The record holds the device storage
until that copy lands, then drops it (so torch can free it) and releases its device bytes. For
NVMe the leased buffer is staging: a chain writes it to NVMe once the copy landed and gives it
back to the pool once the write lands. ``stored`` is the handle of that whole send.
fetch (backward): DEVICE <- HOST, or DEVICE <- HOST <- NVME through a leased staging buffer, into
fresh device bytes (reserved at the fetch, given back at once if it fails: a failed backward
leaves the device ledger as it was, even while its graph is still referenced); each saved view
is rebuilt over them with its own dtype, size, stride and offset, so the views of one storage
(q, k and v of one qkv projection) share one copy. The fetch is chained after ``stored``, so it
reads what was written; if the copy to the host has not landed yet, the fetch keeps the device
storage instead. Waiting on a fetch's handle counts as stall on the device tier.
retire (autograd dropped the packed object: the node ran, or the graph was freed unused): once
nothing of the record is in flight its host buffer returns to the pool, its device bytes are
released, and its NVMe file is deleted, in a batch on the engine's compute lane at ``flush()``.
``settle()`` (the end of ``TieredModel.backward``) waits for retired records still in flight, so
after backward everything of its graph is back in the pools.

# NOTE [Record state]
Fetches of one record come from the backward that unpacks its graph; landings, retirements
(autograd's threads, a GC pass) and frees (the end of a chain) may come from any thread. The
mover's lock makes each step of a record atomic: who keeps the device storage (the landing or a
fetch that came first), that a record is fetched at most once and never after it retired, and
which requests a retirement waits for. It is held only to read and set fields and to issue
requests, never across a wait or a device reservation (a full device ledger may reclaim, which
waits on the lanes); it is reentrant because a GC pass may retire a record on a thread that holds
it.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from tiermem.errors import OutOfTierMemory
from tiermem.handles import Handle, wait_all_quietly
from tiermem.memory.base import Store
from tiermem.memory.ledger import Ledger
from tiermem.transfer.lease import Lease
from tiermem.transfer.service import CopyService
from tiermem.types import TensorClass, Tier

log = logging.getLogger(__name__)

_ACT = TensorClass.ACTIVATION


@dataclass
class ActivationStats:
    """What the activation hooks decided and did, counted over the model's life (bytes moved,
    busy time and stalls are the engine's: ``TieredModel.report()``)."""

    saved: int = 0  # tensors saved for backward during training forwards
    weights: int = 0  # of which parameters or buffers (or views of them): never moved
    wrapped: int = 0  # wrapper subclasses placed through their inner tensors (NOTE [Wrapper subclasses])
    unplaced: Counter[str] = field(default_factory=Counter)  # class -> wrapper subclasses that cannot be placed
    offloaded: Counter[Tier] = field(default_factory=Counter)  # Tier -> storages sent there
    offloaded_bytes: Counter[Tier] = field(default_factory=Counter)  # Tier -> bytes of the storages sent there
    by_module: Counter[str] = field(default_factory=Counter)  # module name -> storages offloaded
    fetched_ahead: int = 0  # fetches started by the unpack of a record saved later
    fetched_on_demand: int = 0  # fetches started by their own unpack
    still_on_device: int = 0  # fetches that found the device storage not yet dropped


class Record:
    """One offloaded storage (every saved view of it shares the record); see NOTE [Activation
    lifecycle]. Bytes move as they lie in the storage, so views come back exactly as they were."""

    __slots__ = (
        "n",
        "tier",
        "index",
        "nbytes",
        "key",
        "back_key",
        "nvme_key",
        "device",
        "lease",
        "stored",
        "fetch",
        "keep",
        "retired",
    )

    def __init__(self, n: int, tier: Tier, nbytes: int, index: int, prefix: str):
        self.n, self.tier, self.index, self.nbytes = n, tier, index, nbytes
        self.key, self.nvme_key = f"<activation {n}>", f"{prefix}.{n}"  # ledger key, NVMe key
        self.back_key = f"<activation {n} back>"  # device bytes of the copy fetched for backward
        self.device: Optional[torch.Tensor] = None  # the storage's bytes, until their copy lands
        self.lease: Optional[Lease] = None  # the host buffer (home, or NVMe staging)
        self.stored: Optional[Handle] = None  # done once the bytes sit at their tier
        self.fetch: Optional[Handle] = None  # the device bytes coming back
        self.keep = False  # the fetch came before the copy landed: keep the device bytes
        self.retired = False


class ActivationMover:
    """Sends, fetches and frees offloaded activations; thread-safe (NOTE [Record state])."""

    def __init__(self, stores: dict[Tier, Store], engine: CopyService, stats: ActivationStats, prefix: str):
        self.stores, self.engine, self.stats, self.prefix = stores, engine, stats, prefix
        self.device = torch.device(engine.device)
        self.dev: Ledger = stores[Tier.DEVICE].ledger
        self._lock = threading.RLock()  # NOTE [Record state]
        self._ids = itertools.count()
        self._doomed: list[str] = []  # NVMe keys of retired records, deleted in a batch
        self._freeing: list[Handle] = []  # retired records waiting for their transfers to end
        self.closed = False

    # -- forward --------------------------------------------------------------------------------
    def send(self, storage: torch.UntypedStorage, tier: Tier, index: int, what: str) -> Record:
        """Start moving ``storage`` (on the device) to ``tier``."""
        rec = Record(next(self._ids), tier, storage.nbytes(), index, self.prefix)
        reserve_device(self.dev, rec.key, rec.nbytes, what)
        try:
            lease = rec.lease = self._lease(rec.key, rec.nbytes)
        except BaseException:
            self.dev.release(rec.key)
            raise
        rec.device, host = _bytes(storage), lease.view()
        try:
            copy = self.engine.copy_async(host, rec.device, src_tier=Tier.DEVICE, dst_tier=Tier.HOST, kind=_ACT)
        except BaseException:
            rec.device = None
            self.dev.release(rec.key)
            lease.release()
            raise
        landed = self.engine.chain(copy, cleanup=lambda: self._landed(rec))
        if tier is Tier.HOST:
            rec.stored = landed
        else:  # the leased buffer was staging: to NVMe once the copy landed, then back to the pool
            write, key = self.engine.store_write, rec.nvme_key
            rec.stored = self.engine.chain(
                landed, lambda: write(Tier.NVME, key, host, kind=_ACT), cleanup=lease.release
            )
        return rec

    def _landed(self, rec: Record) -> None:
        """The DEVICE->HOST copy ended (on the d2h lane): drop the device storage unless a fetch
        already took it."""
        with self._lock:  # atomic with fetch's look at rec.device
            if rec.keep:
                return
            rec.device = None  # torch may free the device tensor now
        self.dev.release(rec.key)

    # -- backward -------------------------------------------------------------------------------
    def fetch(self, rec: Record, *, ahead: bool) -> Optional[Handle]:
        """Start bringing ``rec`` back (once); ``ahead``: speculative, so give up quietly when a
        budget has no room or the record already retired."""
        with self._lock:
            if rec.fetch is not None or rec.retired:
                return rec.fetch
            if rec.device is not None:  # its copy has not landed: keep the device tensor
                rec.keep = True
                rec.fetch = Handle.completed(rec.device)
                self.stats.still_on_device += 1
                return rec.fetch
        staging = handle = None
        try:  # outside the lock: NOTE [Record state]
            reserve_device(self.dev, rec.back_key, rec.nbytes, "an offloaded activation coming back")
            if rec.tier is Tier.NVME:
                staging = self._lease(f"{rec.key} staging", rec.nbytes)
            out = torch.empty(rec.nbytes, dtype=torch.uint8, device=self.device)
            with self._lock:
                if not rec.retired:  # else a GC pass dropped its graph meanwhile: nothing will unpack it
                    handle = rec.fetch = self._bring_back(rec, out, staging)
        except BaseException as e:
            self._unfetch(rec, staging)
            if ahead and isinstance(e, OutOfTierMemory):
                return None  # it comes when its own unpack asks
            raise
        if handle is None:
            self._unfetch(rec, staging)
            return None
        handle.add_done_callback(lambda f: self._fetch_ended(rec, f))
        if ahead:
            self.stats.fetched_ahead += 1
        else:
            self.stats.fetched_on_demand += 1
        return handle

    def _fetch_ended(self, rec: Record, future: Future[Any]) -> None:
        """A failed fetch gives its device bytes back now, not when its graph goes (a failed
        backward's graph may be kept for long: by the loss, or the error's traceback)."""
        if future.exception() is not None:
            self.dev.release(rec.back_key)

    def _unfetch(self, rec: Record, staging: Optional[Lease]) -> None:
        """Give back what a fetch that did not start took."""
        self.dev.release(rec.back_key)
        if staging is not None:
            staging.release()

    def _bring_back(self, rec: Record, out: torch.Tensor, staging: Optional[Lease]) -> Handle:
        """Issue the requests that bring ``rec`` back into ``out``, after its send (NOTE [Chained
        requests])."""
        assert rec.stored is not None, "brought back before it was sent"
        if staging is None:
            assert rec.lease is not None, "on the host: it has its buffer there"
            return self.engine.copy_async(
                out, rec.lease.view(), src_tier=Tier.HOST, dst_tier=Tier.DEVICE, kind=_ACT, after=rec.stored
            )
        host, store_read, key = staging.view(), self.engine.store_read, rec.nvme_key
        read = self.engine.chain(rec.stored, lambda: store_read(Tier.NVME, key, host, kind=_ACT))
        copy = self.engine.copy_async(out, host, src_tier=Tier.HOST, dst_tier=Tier.DEVICE, kind=_ACT, after=read)
        return self.engine.chain(copy, cleanup=staging.release, stall=Tier.DEVICE)

    # -- retire ---------------------------------------------------------------------------------
    def retire(self, rec: Record) -> None:
        with self._lock:
            rec.retired = True
            pending = [h for h in (rec.stored, rec.fetch) if h is not None and not h.done()]
        if not pending:
            self._free(rec)
            return
        freed = self.engine.chain(pending, cleanup=lambda: self._free(rec), stall=Tier.DEVICE)
        with self._lock:
            self._freeing = [h for h in self._freeing if not h.done()]
            self._freeing.append(freed)

    def _free(self, rec: Record) -> None:
        with self._lock:
            rec.device = rec.fetch = None
            rec.stored = None  # its callbacks refer to rec: let the cycle go without the GC
            if rec.tier is Tier.NVME and not self.closed:
                self._doomed.append(rec.nvme_key)
        self.dev.release(rec.key)
        self.dev.release(rec.back_key)
        if rec.lease is not None:
            rec.lease.release()

    def settle(self) -> None:
        """Wait until every retired record is freed: a copy still queued when backward was done
        with its tensor (the lane fell behind) lands first. Time waiting counts as stall; the
        errors were the fetches' to raise."""
        with self._lock:
            freeing, self._freeing = self._freeing, []
        wait_all_quietly(freeing)
        self.flush()

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
    def _lease(self, key: str, nbytes: int) -> Lease:
        try:
            return self.engine.lease(nbytes, key, _ACT)
        except OutOfTierMemory as e:
            raise OutOfTierMemory(
                tier=e.tier,
                key="an offloaded activation",
                asked=nbytes,
                used=e.used,
                allowed=e.allowed,
                hint="raise Budgets(host=...), raise ActivationOffload's min_bytes so fewer activations "
                "move, or send them to Tier.NVME",
            ) from None


def reserve_device(ledger: Ledger, key: str, nbytes: int, what: str) -> None:
    """Account activation bytes on the device; over budget, the ledger's error says what the
    device holds and what to change (NOTE [Activations that do not fit] in tiermem/memory/ledger.py)."""
    ledger.reserve(key, nbytes, _ACT, label=what)


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """All of ``storage`` as a flat uint8 tensor (it keeps the storage alive)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def view_of(
    data: torch.Tensor, dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...], offset: int
) -> torch.Tensor:
    """A tensor of ``dtype`` laid over the bytes of ``data`` as a saved view lay over its storage."""
    return torch.empty(0, dtype=dtype, device=data.device).set_(data.untyped_storage(), offset, size, stride)
