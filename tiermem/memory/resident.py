"""The two memory tiers: tensors on the compute device, and a reusable pool of host buffers.

Both hand out resident tensors with ``get(key)``; ``write``/``read`` are plain copies issued with
``non_blocking=True`` so that, on a GPU, the engine's stream context decides where they run and
the engine's events decide when they are done. On the CPU they complete before returning.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import defaultdict
from typing import Iterator, Optional, Sequence

import psutil
import torch

from tiermem.errors import OutOfTierMemory
from tiermem.handles import Handle
from tiermem.memory import deferred
from tiermem.memory.aligned import aligned_empty, can_pin, host_buffer, pin_in_place, round_up, unpin
from tiermem.memory.base import Store, check_same_layout, unknown_key
from tiermem.memory.ledger import Ledger, Reclaimer
from tiermem.types import TensorClass, Tier

log = logging.getLogger(__name__)


DEVICE_MARGIN_FRACTION = 0.05  # of the card's memory, kept out of the default device budget...
DEVICE_MARGIN_MIN = 1 << 30  # ...but never less than 1 GiB


def device_margin(total: int) -> int:
    """What the default device budget leaves unmanaged: cuBLAS/cuDNN workspaces, kernels'
    temporaries, the caching allocator's rounding and fragmentation."""
    return max(DEVICE_MARGIN_MIN, int(total * DEVICE_MARGIN_FRACTION))


def default_device_budget(device: torch.device) -> int:
    """On a GPU: what is free now (``mem_get_info``, so the CUDA context and other processes are
    already out), plus what torch's caching allocator holds (tensors tiermem is about to adopt,
    such as a model already moved there, and cached blocks it can reuse), minus
    :func:`device_margin`. On the CPU: the available memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(free) + int(torch.cuda.memory_reserved(device)) - device_margin(int(total)))
    return int(psutil.virtual_memory().available)


def default_host_budget() -> int:
    return int(psutil.virtual_memory().available)


def nbytes_of(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= int(s)
    return n


class MemoryStore(Store):
    """Keyed tensors in memory (device, host) with byte accounting, handed out by ``get``.
    Subclasses supply ``_alloc``/``_free`` of raw uint8 buffers; ``allocate`` views them with the
    wanted dtype and shape."""

    def __init__(self, tier: Tier, budget: int, *, reclaimers: Sequence[Reclaimer] = ()):
        self.tier = tier
        self.ledger = Ledger(tier, budget, reclaimers=reclaimers)
        self._tensors: dict[str, torch.Tensor] = {}
        self._bases: dict[str, Optional[torch.Tensor]] = {}  # None: adopted, not ours to pool
        self._vacated: set[str] = set()  # keys whose room the ledger holds, with no tensor (hold_room, vacate)
        self._lock = threading.RLock()  # the engine's lanes allocate and free from their threads

    def _alloc(self, key: str, nbytes: int, kind: Optional[TensorClass]) -> torch.Tensor:
        raise NotImplementedError

    def _free(self, key: str, base: torch.Tensor) -> None:
        self.ledger.release(key)

    def allocate(
        self, key: str, shape: Sequence[int], dtype: torch.dtype, kind: Optional[TensorClass] = None
    ) -> torch.Tensor:
        """An uninitialised tensor resident on this tier under ``key`` (replacing any old one)."""
        with self._lock:
            if key in self._vacated:  # its room is held: the reservation below replaces it, never dropped first
                self._vacated.discard(key)
            else:
                self.delete(key)
            nbytes = nbytes_of(shape, dtype)
            base = self._alloc(key, nbytes, kind)
            t = base[:nbytes].view(dtype).view(tuple(shape))
            self._bases[key], self._tensors[key] = base, t
            return t

    def adopt(self, key: str, tensor: torch.Tensor, kind: Optional[TensorClass] = None) -> torch.Tensor:
        """Account a tensor that already lives here (e.g. a module's parameter) under ``key``."""
        with self._lock:
            self.delete(key)
            self.ledger.reserve(key, tensor.numel() * tensor.element_size(), kind)
            self._bases[key], self._tensors[key] = None, tensor
            return tensor

    def alias(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, a view of memory this store already counts under another key, also under
        ``key``, its bytes not counted again (``delete(key)`` forgets the view, freeing nothing)."""
        with self._lock:
            self.delete(key)
            self._bases[key], self._tensors[key] = None, tensor  # no bytes reserved: release() frees none
            return tensor

    def get(self, key: str) -> torch.Tensor:
        try:
            return self._tensors[key]
        except KeyError:
            raise unknown_key(key, self.tier) from None

    def write(self, key: str, src: torch.Tensor, kind: Optional[TensorClass] = None) -> Handle:
        dst = self._tensors.get(key)
        if dst is None or dst.dtype != src.dtype or dst.shape != src.shape:
            dst = self.allocate(key, src.shape, src.dtype, kind)
        dst.copy_(src, non_blocking=True)
        return Handle.completed(dst)

    def read(self, key: str, out: torch.Tensor) -> Handle:
        src = self.get(key)
        check_same_layout(key, src.dtype, src.numel(), out, self.tier)
        out.view(src.shape).copy_(src, non_blocking=True)
        return Handle.completed(out)

    def delete(self, key: str) -> None:
        with self._lock:
            if key in self._vacated:
                self._vacated.discard(key)
                self.ledger.release(key)
                return
            if self._tensors.pop(key, None) is None:
                return
            base = self._bases.pop(key)
            if base is None:
                self.ledger.release(key)
            else:
                self._free(key, base)

    # -- room held without memory (NOTE [Grads come and go] in tiermem/train/homes/grad_homes.py) -----------
    def hold_room(self, key: str, shape: Sequence[int], dtype: torch.dtype, kind: Optional[TensorClass] = None) -> None:
        """Count the bytes ``allocate(key, shape, dtype)`` takes against the budget now, taking no
        memory: room held for a tensor allocated later (``allocate(key)`` takes it; ``delete(key)``
        gives it up)."""
        with self._lock:
            self.delete(key)
            self.ledger.reserve(key, self._taken(nbytes_of(shape, dtype)), kind)
            self._vacated.add(key)

    def vacate(self, key: str) -> bool:
        """Give the memory of ``key``'s tensor back to the system, its bytes still counted against
        the budget as room held for the next ``allocate(key)`` (:meth:`hold_room`); the tensor
        handed out must not be used afterwards. Returns False, keeping the tensor, where that would
        cost more than it saves: a pinned host buffer (pinning again is what costs), an adopted tensor."""
        with self._lock:
            base = self._bases.get(key)
            if base is None or not self._may_vacate(base):
                return False
            del self._tensors[key], self._bases[key]  # the memory goes once the last view of it does
            self._vacated.add(key)
            return True

    @property
    def room(self) -> int:
        """Bytes the ledger counts for keys with no memory behind them now (held room)."""
        with self._lock:
            return sum(self.ledger.held(key) for key in self._vacated)

    def _taken(self, nbytes: int) -> int:
        """What the ledger counts for a tensor of ``nbytes``."""
        return nbytes

    def _may_vacate(self, base: torch.Tensor) -> bool:
        return True

    def release_all(self) -> None:
        for key in list(self._vacated):
            self.delete(key)
        super().release_all()

    def __contains__(self, key: object) -> bool:
        return key in self._tensors

    def keys(self) -> Iterator[str]:
        return iter(list(self._tensors))


class DeviceStore(MemoryStore):
    """Tensors on the compute device. Without an accelerator the device is the CPU and the budget
    is enforced by accounting alone, so every code path runs on a CPU-only machine."""

    def __init__(
        self, device: torch.device | str, budget: Optional[int] = None, *, reclaimers: Sequence[Reclaimer] = ()
    ):
        """``reclaimers``: asked before a reservation is refused, so requests in flight can land
        and a cache on the device (prefetched weights) can make room (NOTE [Reclaimers at construction])."""
        self.device = torch.device(device)
        super().__init__(
            Tier.DEVICE, default_device_budget(self.device) if budget is None else budget, reclaimers=reclaimers
        )

    def _alloc(self, key: str, nbytes: int, kind: Optional[TensorClass]) -> torch.Tensor:
        self.ledger.reserve(key, nbytes, kind)
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except RuntimeError as e:  # the device itself is out of memory: give the reservation back
            self.ledger.release(key)
            raise OutOfTierMemory(
                tier=Tier.DEVICE,
                key=key,
                asked=nbytes,
                used=self.ledger.used,
                allowed=self.ledger.allowed,
                hint=f"the device refused it ({e}); lower Budgets(device=...) below what "
                f"is really free there, or place less on the device",
            ) from e


class HostStore(MemoryStore):
    """Host memory as a pool of page-aligned buffers, pinned when an accelerator exists.

    Freed buffers are kept by size and handed out again, so a training step that allocates the
    same sizes every time neither re-allocates nor re-pins. Cached free buffers count against the
    budget too; they are dropped first when an allocation would not fit, and :meth:`trim` gives
    them back to the system. Each buffer is pinned in place, exactly the bytes the ledger counts
    (NOTE [Exact pinned memory]). Optimizer state is never copied to or from the accelerator, so
    its buffers are not pinned (pinned memory is scarce and slow to allocate).
    """

    _POOL_KEY = "<free host buffers>"

    def __init__(self, budget: Optional[int] = None, *, pin: Optional[bool] = None):
        super().__init__(Tier.HOST, default_host_budget() if budget is None else budget)
        self.pin = can_pin() if pin is None else pin
        self._free_bufs: dict[tuple[int, bool], list[torch.Tensor]] = defaultdict(list)  # (bytes, pinned)
        self._free_bytes = 0
        self.allocations = 0  # buffers ever allocated; reuse keeps this flat across steps
        # data_ptr -> (buffer, pinned in place) for every pinned buffer of this pool, in use or free;
        # not in place: from torch's pinned cache, which unpins it itself
        self._pinned: dict[int, tuple[torch.Tensor, bool]] = {}
        self._register = True  # pin in place with cudaHostRegister, until CUDA refuses once
        # dropped without close(): unpinned too, on the release worker (NOTE [Finalizers only enqueue]:
        # unpinning submits to the pinning thread's pool, which a GC pass inside submit() would deadlock)
        weakref.finalize(self, _dropped, self._pinned)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of host memory this pool holds pinned (in use and cached)."""
        with self._lock:
            return sum(b.numel() for b, _ in self._pinned.values())

    def acquire(self, nbytes: int, key: str, kind: Optional[TensorClass] = None) -> torch.Tensor:
        """A page-aligned (pinned where possible) uint8 buffer of at least ``nbytes``, accounted to ``key``."""
        size = round_up(max(nbytes, 1))
        with self._lock:
            return self._acquire_locked(size, key, kind)

    def _acquire_locked(self, size: int, key: str, kind: Optional[TensorClass]) -> torch.Tensor:
        pin = self.pin and kind is not TensorClass.OPTIM_STATE
        cached = self._free_bufs.get((size, pin))
        if cached:
            buf = cached.pop()
            self._set_free_bytes(self._free_bytes - size)
            self.ledger.reserve(key, size, kind)
            return buf
        try:
            self.ledger.reserve(key, size, kind)
        except OutOfTierMemory:
            if not self._free_bytes:
                raise
            self.trim()  # cached buffers of other sizes make room before we give up
            self.ledger.reserve(key, size, kind)
        try:
            buf, registered = self._new_buffer(size, pin)
        except RuntimeError as e:  # e.g. the pinned-memory limit: give the reservation back
            self.ledger.release(key)
            raise OutOfTierMemory(
                tier=Tier.HOST,
                key=key,
                asked=size,
                used=self.ledger.used,
                allowed=self.ledger.allowed,
                hint=f"the allocation failed ({e}); raise the memlock limit (ulimit -l) "
                f"or lower Budgets(host=...) to what this machine can give",
            ) from e
        self.allocations += 1
        if pin:
            self._pinned[buf.data_ptr()] = (buf, registered)
        return buf

    def _new_buffer(self, size: int, pin: bool) -> tuple[torch.Tensor, bool]:
        """A fresh buffer of ``size`` bytes, and whether it is pinned in place (NOTE [Exact pinned
        memory]); once CUDA refused to register host memory, this pool asks no more."""
        if pin and self._register:
            buf = host_buffer(size, pin=False)
            refused = pin_in_place(buf)
            if refused is None:
                deferred.start()  # the worker that unpins this pool if it is dropped without close()
                return buf, True
            log.warning(
                "tiermem: %s; this pool's pinned buffers come from torch's pinned cache instead "
                "(rounded up to powers of two, returned to the system only by torch)",
                refused,
            )
            self._register = False
        if pin:
            return aligned_empty(size, pin=True), False
        return host_buffer(size, pin=False), False

    def release(self, key: str, buf: torch.Tensor) -> None:
        """Give a buffer from :meth:`acquire` back to the pool."""
        with self._lock:
            self.ledger.release(key)
            self._free_bufs[(buf.numel(), buf.data_ptr() in self._pinned)].append(buf)
            self._set_free_bytes(self._free_bytes + buf.numel())

    def _taken(self, nbytes: int) -> int:
        return round_up(max(nbytes, 1))

    def _may_vacate(self, base: torch.Tensor) -> bool:
        return base.data_ptr() not in self._pinned  # unpinned: unmapped once no view of it is left

    def close(self) -> None:
        self.trim()  # the pool's buffers (pinned, on a GPU machine) go back to the system

    def trim(self) -> int:
        """Give every cached free buffer back to the system (unpinned, unmapped); returns the
        bytes released."""
        with self._lock:
            n = self._free_bytes
            for bufs in self._free_bufs.values():
                for buf in bufs:
                    if self._pinned.pop(buf.data_ptr(), (None, False))[1]:
                        unpin(buf)
            self._free_bufs.clear()
            self._set_free_bytes(0)
            return n

    def _set_free_bytes(self, n: int) -> None:
        self._free_bytes = n
        self.ledger.release(self._POOL_KEY)
        if n:
            self.ledger.reserve(self._POOL_KEY, n)  # shrinking or re-adding what was held: always fits

    def _alloc(self, key: str, nbytes: int, kind: Optional[TensorClass]) -> torch.Tensor:
        return self.acquire(nbytes, key, kind)

    def _free(self, key: str, base: torch.Tensor) -> None:
        self.release(key, base)


def _dropped(pinned: dict[int, tuple[torch.Tensor, bool]]) -> None:
    """A pool's finalizer: what it pinned in place is unpinned on the release worker (which the
    first such pin started); a pool that pinned nothing in place queues nothing, so a job that
    would do nothing never waits, holding torch's pinned buffers, for a worker that never started."""
    if any(in_place for _, in_place in pinned.values()):
        deferred.defer(_unpin_all, pinned)


def _unpin_all(pinned: dict[int, tuple[torch.Tensor, bool]]) -> None:
    for buf, in_place in pinned.values():
        if not in_place:
            continue
        try:
            unpin(buf)
        except Exception as e:  # noqa: BLE001 - at exit the CUDA runtime may be gone already
            log.debug("tiermem: could not unpin a host buffer: %s", e)
    pinned.clear()
