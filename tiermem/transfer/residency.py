"""Keyed residency: registered tensors, each with a home tier, moved between tiers by key while
the registry stays truthful about which tiers hold a valid copy.

This is the half of the transfer layer that knows keys. Its one user is the residency scheduler
(:mod:`tiermem.transfer.schedule`, its moves in :mod:`tiermem.transfer.fetch_evict`), on behalf of the weights that live off the device
(:mod:`tiermem.train.weights.param_offload`). Everything else (homes, the gradient collector, the step)
moves bytes it owns through the keyless copy service, :class:`~tiermem.transfer.engine.TransferEngine`,
which this class issues its moves through too: the engine's lanes, staging buffers and counters.

A move allocates its destination on the caller's thread, so a move that would break a budget
fails at the call with :class:`~tiermem.errors.OutOfTierMemory`, before anything is touched;
the copy then runs on its lane ("nvme" when a leg is on NVMe, else the direction's), and the
registry learns of it once it has landed.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from concurrent.futures import Future
from typing import Any, Optional

import torch

from tiermem.errors import TierMemError
from tiermem.handles import Handle
from tiermem.memory.base import Store
from tiermem.memory.registry import Registry, Residency
from tiermem.memory.resident import MemoryStore, nbytes_of
from tiermem.transfer.engine import TransferEngine
from tiermem.transfer.lanes import GpuWork, IssueResult, Ready
from tiermem.types import TensorInfo, Tier


class KeyedResidency:
    """Moves registered tensors between tiers asynchronously and keeps the registry truthful."""

    def __init__(self, engine: TransferEngine, registry: Optional[Registry] = None):
        self.engine = engine
        self.registry = registry if registry is not None else Registry()
        self._pending: dict[str, tuple[Tier, Handle]] = {}
        self._lock = threading.Lock()

    def store(self, tier: Tier) -> Store:
        """The store of ``tier`` (a ``tiermem:`` error if the engine has none)."""
        return self.engine.store(tier)

    # -- requests ---------------------------------------------------------------------------------
    def register(self, info: TensorInfo, home: Tier) -> Residency:
        if isinstance(home, Tier):
            self.engine.store(home)  # fail now if the policy named a tier this engine has no store for
        return self.registry.register(info, home)

    def put(
        self,
        key: str,
        tensor: torch.Tensor,
        tier: Optional[Tier] = None,
        *,
        src_tier: Optional[Tier] = None,
        wait: bool = True,
    ) -> Handle:
        """Store ``tensor`` as the newest value of ``key`` on ``tier`` (default: its home); every
        other copy is dropped. ``src_tier`` (where ``tensor`` lives) counts the bytes as moved.
        With ``wait=False`` the write may still be running when this returns: keep ``tensor``
        unchanged until the handle is done; any later request for ``key`` waits for it."""
        r = self.registry.get(key)
        tier = r.home if tier is None else tier
        self._drop_copies(r, but=tier)
        h = self.store(tier).write(key, tensor, r.info.kind)
        self.engine.landed(tier, tensor)
        if src_tier is not None and src_tier != tier:
            h = self.engine.observe(h, src_tier, tier, tensor, r.info.kind)
        self.registry.write_at(key, tier)
        if wait:
            h.wait()
            return Handle.completed(None)
        with self._lock:
            self._pending[key] = (tier, h)
        h.add_done_callback(functools.partial(self._forget, key))
        return h

    def share(self, key: str, tensor: torch.Tensor) -> None:
        """``tensor``, memory on ``key``'s home tier that another key of that store already counts
        (a view of it), becomes ``key``'s value there: no copy, no byte counted twice (NOTE [One
        copy of bf16 master weights] in tiermem/train/weights/param_offload.py); every other copy is dropped."""
        r = self.registry.get(key)
        self._drop_copies(r, but=r.home)  # alias() replaces the home copy itself
        store = self.store(r.home)
        assert isinstance(store, MemoryStore), "only memory can be shared"
        store.alias(key, tensor)
        self.registry.write_at(key, r.home)

    def _drop_copies(self, r: Residency, *, but: Tier) -> None:
        """Before a new value of ``r.key`` goes to ``but``: every move of it settled, every copy
        elsewhere deleted, none valid (the store of ``but`` replaces its own)."""
        self._settle(r.key)
        for other in list(r.valid):
            if other != but:
                self.store(other).delete(r.key)
        r.valid.clear()

    def read_home(self, key: str, out: torch.Tensor) -> Handle:
        """Start reading ``key``'s value at its home tier into ``out`` (host memory), after any
        write of it already issued (a store keeps each key's requests in order)."""
        r = self.registry.get(key)
        return self.engine.store_read(r.home, key, out, kind=r.info.kind)

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
            self.store(tier).delete(key)  # a stale copy may still hold memory
            return Handle.completed(None)
        if r.valid != {tier}:
            self.registry.drop(key, tier)
            self.store(tier).delete(key)
            return Handle.completed(None)
        if tier == r.home:
            raise TierMemError(
                f"tiermem: cannot evict {key!r} from {tier}, its home and only copy; "
                f"move its home with the policy instead"
            )
        return self._launch(r, tier, r.home, then_drop=tier)

    def home_value(self, key: str) -> torch.Tensor:
        """The tensor that holds ``key``'s value at its home, a memory tier, once its moves are
        settled: the home itself, not a copy (a write into it changes the value at home)."""
        self._settle(key)
        r = self.registry.get(key)
        store = self.store(r.home)
        if r.home not in r.valid or not isinstance(store, MemoryStore):
            raise TierMemError(
                f"tiermem: {key!r} holds no value in memory at its home ({r.home}); it cannot be read in place"
            )
        return store.get(key)

    def fetch(self, key: str, out: torch.Tensor) -> Handle:
        """Copy the newest value of ``key`` into ``out`` without changing residency."""
        self._settle(key)
        r = self.registry.get(key)
        src = r.fastest_valid()
        if src is None:
            raise TierMemError(f"tiermem: {key!r} holds no value yet; put() it before reading it")
        self.store(src).read(key, out).wait()
        self.engine.landed(src, out)
        return Handle.completed(out)

    def delete(self, key: str) -> None:
        self._settle(key)
        r = self.registry.unregister(key)
        for tier in set(r.valid) | {r.home}:
            self.store(tier).delete(key)

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

    # -- internals --------------------------------------------------------------------------------
    def _settle(self, key: str) -> None:
        """Wait for an in-flight transfer of ``key`` (its error stays on its own handle)."""
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:
            with contextlib.suppress(Exception):
                pending[1].wait()

    def _forget(self, key: str, done: Future[Any]) -> None:
        """A done-callback: ``key``'s transfer that ``done`` completes is no longer pending. It is
        given the future, not the handle: a handle in its own future's callbacks would be a
        reference cycle, keeping the transfer's buffer alive until a full garbage collection."""
        with self._lock:
            entry = self._pending.get(key)
            if entry is not None and entry[1].wraps(done):
                del self._pending[key]

    def _launch(self, r: Residency, src: Tier, dst: Tier, then_drop: Optional[Tier]) -> Handle:
        key, info = r.key, r.info
        dst_store = self.store(dst)
        # Allocate the destination now, on the caller's thread: a budget error surfaces here.
        out = dst_store.allocate(key, info.shape, info.dtype, info.kind) if isinstance(dst_store, MemoryStore) else None
        # The copy must not start before the compute stream has finished writing the source.
        ready = self.engine.ready() if Tier.DEVICE in (src, dst) else None
        lane = "nvme" if Tier.NVME in (src, dst) else ("d2h" if src == Tier.DEVICE else "h2d")
        self.registry.begin(key, src, dst)
        handle = self.engine.request(lane, lambda: self._run(r, src, dst, out, lane, ready, then_drop), stall=dst)
        with self._lock:
            self._pending[key] = (dst, handle)
        handle.add_done_callback(functools.partial(self._forget, key))
        return handle

    def _run(
        self,
        r: Residency,
        src: Tier,
        dst: Tier,
        out: Optional[torch.Tensor],
        lane: str,
        ready: Ready,
        then_drop: Optional[Tier],
    ) -> IssueResult:
        """Issue a move on its lane; the registry learns of it once it is done."""
        t0 = time.perf_counter()
        key, stats = r.key, self.engine.stats

        def failed() -> None:
            stats.count(src, dst, t0=t0)
            self.registry.finish(key, ok=False)
            self.store(dst).delete(key)  # dst held no valid copy; free what we allocated for it

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
            stats.count(
                src,
                dst,
                t0=t0,
                seconds=gpu.seconds() if gpu is not None else None,
                nbytes=r.info.nbytes,
                kind=r.info.kind,
            )  # a GPU copy: its own time on its stream
            self.registry.finish(key, ok=True)
            if then_drop is not None:
                self.registry.drop(key, then_drop)
                self.store(then_drop).delete(key)

        return gpu, (out if dst == Tier.DEVICE else None), finish

    def _copy(
        self, key: str, info: TensorInfo, src: Tier, dst: Tier, out: Optional[torch.Tensor], lane: str, ready: Ready
    ) -> Optional[GpuWork]:
        """Issue the copy; returns its GPU work when it may still run (memory -> memory on a GPU),
        else None: NVMe legs are done on return."""
        src_store, dst_store = self.store(src), self.store(dst)
        lanes, cuda = self.engine.lanes, self.engine.lanes.cuda
        if out is not None and isinstance(src_store, MemoryStore):  # memory -> memory
            return lanes.memcpy(out, src_store.get(key), lane, ready)
        if out is not None:  # NVMe -> memory
            if dst == Tier.DEVICE and cuda:
                with self.engine.lease(nbytes_of(info.shape, info.dtype), f"<staging {key}>") as lease:
                    buf = lease.view(info.dtype, info.shape)
                    src_store.read(key, buf).wait()
                    work = lanes.memcpy(out, buf, "h2d", ready)
                    if work is not None:
                        work.wait()  # ordering: the staging goes back after
            else:
                src_store.read(key, out.view(-1) if out.dim() else out).wait()
            return None
        # memory -> NVMe
        if not isinstance(src_store, MemoryStore):
            raise TierMemError(f"tiermem: cannot move {key!r} from {src} to {dst}: one side must be a memory tier")
        tensor = src_store.get(key)
        if src == Tier.DEVICE and cuda:
            with self.engine.lease(nbytes_of(info.shape, info.dtype), f"<staging {key}>") as lease:
                buf = lease.view(info.dtype, info.shape)
                work = lanes.memcpy(buf, tensor, "d2h", ready)
                if work is not None:
                    work.wait()  # ordering: landed before the write
                dst_store.write(key, buf, info.kind).wait()
        else:
            dst_store.write(key, tensor, info.kind).wait()
        return None
