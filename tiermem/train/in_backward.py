"""Updates in backward (``TieredModel(update_in_backward=True)``): the grads at rest are a window.

# NOTE [Updates in backward]
Today's step needs every gradient of the step at its home before the first update: the global
norm (clipping) and the finiteness check (a step with an inf or NaN anywhere is skipped whole)
read them all. That home is 4 B/param, on the host or on NVMe, and for the largest models it is
what does not fit. With ``update_in_backward=True`` no bucket's gradients outlive its update:

1. ``tm.backward(loss)`` runs backward keeping the graph (``retain_graph=True``). Each bucket's
   gradients land in a pooled host buffer (:class:`WindowGrads`), which gives its parameters'
   norms (the same fp32 norms of the same fp32 values that the step computes today) and goes back
   to the pool at once.
2. ``tm.step()`` combines those norms as today: the global norm, the clip coefficient, the
   finiteness check. A non-finite norm skips the step (fp16's scaler, NOTE [A stalled run is
   loud]) without a second backward. Otherwise it runs backward again over the graph it kept
   (the same graph and the same loss scale: the same gradients), and each bucket is updated as
   soon as its gradients have landed, with the coefficient the first pass decided, its buffer
   freed after its update. The update of a bucket and the backward that produces the next one take
   turns (:class:`Relay`): the update runs the step's own code (every state home's pipeline, its
   NVMe read-ahead and write-behind, the weights sent home, a failed step rolled forward) on a
   thread that waits whenever the next bucket's gradients have not landed, while backward waits
   for the update of each bucket it completes. Only one of them runs at a time, so nothing they
   share is touched by two threads at once.

The updates are therefore exactly today's, bit for bit, clipping and fp16 overflow included: the
norm and the coefficient come from the same values, and each bucket's Adam reads the same fp32
gradients (tests/test_update_in_backward.py). What it costs is one more backward pass each step
(activations stay alive until the step; they would be alive at the start of backward anyway); what
it saves is every bucket's gradient bytes but a few: the host holds at most the buckets in flight,
counted as "grads in flight for updates in backward" in the footprint. The mode pays where the
grads' 4 B/param is what does not fit (ZeroInfinity at the largest sizes, a host whose RAM the
grads would fill); where they fit, the second backward is pure cost, so it is not the default.
``tm.report()`` counts the second passes and their time.

What it does not do (each refused with a ``tiermem:`` error at construction or at the call):
gradient accumulation over micro-batches (every backward is a step's last; leave the mode off to
accumulate), overlap_step, data parallelism, optimizer state on the device (its Adam would read
the host's window). Weights a backward changes while it runs are those of buckets it has finished:
autograd has run every node that saved them.

A speculative update (SuperOffload's: update during the first backward, roll back where the
norm says so) would save the second pass, but its undo needs the previous value of every updated
bucket's state until backward ends: as many bytes as the state itself (12 B/param for Adam, 4 for
8-bit Adam with bf16 masters), more than the gradients it frees. The second pass frees them for
the price of compute.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Callable, Optional, Sequence

import torch

from tiermem.errors import OutOfTierMemory, TierMemError
from tiermem.handles import Handle
from tiermem.plan.buckets import Bucket
from tiermem.train.homes import GradHome
from tiermem.transfer.lease import Lease
from tiermem.transfer.service import CopyService
from tiermem.types import TensorClass, Tier


class _Stopped(Exception):
    """Backward ended (or failed) before a bucket the update waits for landed."""


class Relay:
    """Two threads taking turns: the one running backward ("main") and the update
    (NOTE [Updates in backward]). The update runs until it waits for a bucket that has not landed; backward runs until
    it completes the bucket the update waits for. Exactly one of them runs at any time."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._turn = "main"
        self._landed: set[int] = set()
        self._waiting: Optional[int] = None
        self._closed = False  # backward is over: no more buckets will land
        self.finished = False
        self.error: Optional[BaseException] = None

    def start(self, update: Callable[[], None]) -> None:
        """Run ``update`` on its own thread until it first waits for a bucket (or ends)."""
        thread = threading.Thread(target=self._run, args=(update,), name="tiermem-update-in-backward", daemon=True)
        with self._cv:
            self._turn = "update"
            thread.start()
            self._cv.wait_for(lambda: self._turn == "main")

    def _run(self, update: Callable[[], None]) -> None:
        try:
            update()
        except BaseException as e:  # noqa: BLE001 - raised by the thread running backward, once backward is over
            self.error = e
        finally:
            with self._cv:
                self.finished = True
                self._turn = "main"
                self._cv.notify_all()

    # -- the update's side ---------------------------------------------------------------------------
    def wait_for(self, index: int) -> None:
        """Until bucket ``index`` has landed: backward runs meanwhile."""
        with self._cv:
            while index not in self._landed:
                if self._closed:
                    raise _Stopped(f"backward ended before bucket {index}'s gradients landed")
                self._waiting, self._turn = index, "main"
                self._cv.notify_all()
                self._cv.wait_for(lambda: self._turn == "update")
            self._waiting = None
            self._landed.discard(index)

    # -- backward's side -----------------------------------------------------------------------------
    def landed(self, index: int) -> None:
        """Bucket ``index``'s gradients are on their way: the update takes it when it waits for it."""
        with self._cv:
            self._landed.add(index)
            if self._waiting == index and not self.finished:
                self._turn = "update"
                self._cv.notify_all()
                self._cv.wait_for(lambda: self._turn == "main")

    def close(self) -> None:
        """Backward is over (or failed): the update runs to its end, or fails waiting for a
        bucket that will not land."""
        with self._cv:
            self._closed = True
            if not self.finished:
                self._turn = "update"
                self._cv.notify_all()
                self._cv.wait_for(lambda: self.finished)


class WindowGrads(GradHome):
    """The GRAD home under ``update_in_backward``: each bucket's gradients in a pooled host buffer
    while it is needed, never all of them (NOTE [Updates in backward])."""

    landing_tier = Tier.HOST

    def __init__(self, engine: CopyService):
        self.engine = engine
        self._buckets: dict[int, Bucket] = {}
        self._landing: dict[int, tuple[torch.Tensor, Lease]] = {}
        self._arrived: dict[int, int] = defaultdict(int)
        self._ready: dict[int, tuple[torch.Tensor, Lease, Handle]] = {}  # landed, for the update
        self.received: Callable[[str], bool] = lambda name: True  # the collector's (bound at build)
        #: the first pass's per-parameter fp32 norms, and the order its buckets completed in
        self.norms: dict[str, torch.Tensor] = {}
        self.order: list[int] = []
        self.relay: Optional[Relay] = None  # the second pass's, while it runs

    def add(self, buckets: Sequence[Bucket]) -> None:
        """Home ``buckets``' grads too (at construction; later, parameters unfrozen since)."""
        self._buckets.update((b.index, b) for b in buckets)

    def landing(self, b: Bucket, fill: int) -> torch.Tensor:
        if b.index not in self._landing:
            try:
                lease = self.engine.lease(b.numel * 4, f"<grads for an update in backward {b.key}>", TensorClass.GRAD)
            except OutOfTierMemory as e:
                e.add_note(
                    f"tiermem: update_in_backward holds {len(self._landing) + len(self._ready)} buckets' gradients "
                    f"besides this one; raise the host budget or lower bucket_size"
                )
                raise
            self._landing[b.index] = (lease.view(torch.float32)[: b.numel], lease)
        return self._landing[b.index][0]

    def arrived(self, b: Bucket) -> None:
        self._arrived[b.index] += 1
        if self._arrived[b.index] >= len(b.slots):
            self._complete(b)

    def complete(self, b: Bucket) -> None:
        if b.index in self._landing:
            self._complete(b)

    def end_backward(self) -> None:
        for index in list(self._landing):
            self._complete(self._buckets[index])
        self._arrived.clear()

    def _complete(self, b: Bucket) -> None:
        """Every gradient of ``b`` in this backward is queued on the copy lane: the first pass
        takes their norms, the second hands the bucket to the update."""
        t, lease = self._landing.pop(b.index)
        self._arrived[b.index] = 0
        copied = self.engine.behind("d2h")  # the lane runs in order: done once b's copies are
        relay = self.relay
        if relay is None:  # the first pass
            try:
                copied.wait()
                for s in b.slots:
                    if self.received(s.name):
                        self.norms[s.name] = torch.linalg.vector_norm(
                            t[s.offset : s.offset + s.numel], dtype=torch.float32
                        )
            finally:
                lease.release()
            self.order.append(b.index)
        elif relay.finished:  # the update stopped (it failed): nothing will read these
            copied.wait()
            lease.release()
        else:
            self._ready[b.index] = (t, lease, copied)
            relay.landed(b.index)

    def read(self, b: Bucket, fill: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """``b``'s gradients of the second pass, once backward has produced them (the update waits)."""
        if self.relay is None:
            raise TierMemError(
                f"tiermem: bucket {b.key}'s gradients were read outside an update in backward; with "
                f"update_in_backward=True only tm.step() reads them"
            )
        try:
            self.relay.wait_for(b.index)
        except _Stopped as e:
            raise TierMemError(
                f"tiermem: update_in_backward: the second backward gave no gradient for bucket {b.key}, "
                f"which the first gave ({e}); the step's forward must not change between tm.backward() "
                f"and tm.step()"
            ) from None
        t, lease, copied = self._ready.pop(b.index)
        try:
            copied.wait()
        except BaseException:
            lease.release()
            raise
        return t, lease.release

    def accumulating(self) -> bool:
        return bool(self._landing)

    def drop(self) -> None:
        self.release()
        self.end_step()

    def release(self) -> None:
        """The buffers held go back to the pool (the first pass's norms stay)."""
        for _, lease in self._landing.values():
            lease.release()
        for _, lease, _ in self._ready.values():
            lease.release()
        self._landing.clear()
        self._ready.clear()
        self._arrived.clear()

    def end_step(self) -> None:
        self._arrived.clear()
        self.norms.clear()
        self.order.clear()

    def ordered(self, plan: list) -> list:
        """``plan`` ((bucket, runs) pairs) in the order the first pass completed its buckets,
        buckets without a gradient first (they read none)."""
        rank = {index: k for k, index in enumerate(self.order)}
        return sorted(plan, key=lambda br: rank.get(br[0].index, -1) if br[1] else -2)
