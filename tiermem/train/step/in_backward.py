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
   turns (:class:`~tiermem.train.step.relay.Relay`): the update runs the step's own code (every state
   home's pipeline, its NVMe read-ahead and write-behind, the weights sent home, a failed step
   rolled forward) on a thread that waits whenever the next bucket's gradients have not landed,
   while backward waits for the update of each bucket it completes. Only one of them runs at a
   time, so nothing they share is touched by two threads at once.

The updates are therefore exactly today's, bit for bit, clipping and fp16 overflow included: the
norm and the coefficient come from the same values, and each bucket's Adam reads the same fp32
gradients (tests/test_update_in_backward.py). What it costs is one more backward pass each step
(activations stay alive until the step; they would be alive at the start of backward anyway); what
it saves is every bucket's gradient bytes but a few: the host holds at most the buckets in flight,
counted as "grads of the buckets being updated in backward" in the footprint. The mode pays where
the grads' 4 B/param is what does not fit (ZeroInfinity at the largest sizes, a host whose RAM the
grads would fill); where they fit, the second backward is pure cost, so it is not the default.
``tm.report()`` counts the second passes and their time.

Gradient accumulation over micro-batches: on a step's last micro-batch each bucket is updated as
soon as its gradients are complete, and its gradients are dropped; the earlier micro-batches
accumulate as the default step's do, in the GRAD home the policy gives (host memory, or NVMe;
grads it homes on the device accumulate on the host, where the update reads them), made when a
step first accumulates, after checking the budgets for it (``accumulation_footprint`` in
tiermem/plan/footprint.py: 4 B/param, refused with a ``tiermem:`` error saying what to change,
before anything changes) and kept for the run (its buffers' memory goes back after each step,
the budget's room stays held, as NOTE [Grads come and go] says; never made for a run that does
not accumulate, whose grads at rest stay a window). The bits are the default step's: it computes
home = g1, home += g2, ..., home += gk; here the home holds g1 + ... + g(k-1), added in the same
order, and the window of the last micro-batch starts as a copy of its bucket's values there
(``landing``), then gk is added to it, in both passes. A bucket the last micro-batch gives no
gradient reads its norms and its update from the home. Which backward is a step's last:

- automatically: ``tm.backward()`` keeps its graph as above; a further ``tm.backward()`` before
  the step first runs the kept graph's backward again into the home (``Passes.replay``, in
  tiermem/train/step/in_backward_passes.py; counted in ``tm.report().backward_again``), freeing that
  graph, then runs its own first pass. The price is activation memory: a micro-batch's
  activations live until the next ``tm.backward()``, through the next micro-batch's forward, so
  two micro-batches' activations are alive at that backward's start (and one more backward pass
  per micro-batch but the last);
- inside ``tm.no_sync()`` a backward is known not to be the last: it lands in the home in one
  pass and keeps no graph. A step whose every backward ran inside it updates from the home, with
  no second pass.

A non-finite value in any micro-batch is in the home's sum, so in the last window's norms (or in
the norms read from the home): the step is skipped, the scaler's logic unchanged.

Under data parallelism (NOTE [Data parallel]) the window is the inner home of
:class:`~tiermem.train.homes.sharded.ShardedGrads`, and its buckets are this rank's chunks: every
pass (a first pass, a replay, the second pass) reduce-scatters each bucket as the default step's
backward does, in bucket order on every rank, and the chunk's mean lands in the window (or the
accumulation homes) whole. The first pass takes the norms of every piece of a chunk (which
parameters got a gradient is agreed over the ranks only at the step; a piece no rank's backward
reached holds zeros), the step reads those of the agreed parameters and combines them over the
ranks as the default step does (``global_norm``): one norm, one coefficient, one skip decision
on every rank. A chunk is copied into its buffer, or added, exactly where the default step adds
(``WindowGrads.holds``: the accumulation home's sum, or the window's copy of it), so the bits are
the default data-parallel step's (tests/test_update_in_backward_dp.py). Each rank's grads at rest
are a few of its chunks; the price is the second pass's reduce-scatters (the step sends the
grads twice, a replay once more). The two threads never share a process group, so each group
sees its collectives in one order on every rank, whenever the Relay switches threads (which
differs between ranks in time):

- the thread running backward issues the grads' reduce-scatters (the model's group, in bucket
  order) and, under ZeRO-3, the gathers of the sharded weights backward reads (their own group,
  NOTE [A gather schedule every rank takes alike]);
- the update thread issues only ZeRO-2's all-gathers of new weights (``ShardedWeights.write``,
  on the weights' group, ``group.for_weights()``): one per bucket, in the order the update takes
  the buckets, which is the order the first pass landed them, bucket order on every rank. ZeRO-3
  writes a new chunk at its home and gathers nothing;
- what ranks agree on (the parameters received, the norms, ZeRO-3's end of iteration) is
  all-reduced on the main thread before the second pass or after it, outside the Relay.

Nothing waits in a cycle: the update waits (for a bucket, or an all-gather behind an upload) only
for buckets this rank has landed, and a rank that landed bucket k has issued every reduce-scatter
and gather the others need to land it (every rank issues the same sequence). Under ZeRO-3 a
bucket's new chunk goes home while backward runs, after its reduce-scatter finished: every rank's
backward is done with its weights (later gathers are of other buckets), and the step frees every
gathered copy before the next forward gathers again.

``tm.no_sync()`` under data parallelism: as in the default step, a backward inside it adds its
grads to the device buffers a reduce-scatter reads (ShardedGrads) and sends nothing; the next
backward outside it, or the step, sends their sum once. Here that backward's first pass must
leave those buffers be, since its graph runs again: it adds to a copy of each (``keeps()``: made
at the pass's first use of the buffer, freed once sent), and the pass that runs the graph again
(a replay, or the step's second pass) adds to the buffers themselves and sends them: the sum the
default step sends, once. A replay inside no_sync() sends too (the backward that kept the graph
ran outside it). When the step's last backward ran inside no_sync(), the step sends the sums into
the accumulation homes (``_to_acc``) and updates from there, as in one process. The device holds
what no_sync() holds in the default step, and copies of the buckets in flight in a first pass.

What it does not do (each refused with a ``tiermem:`` error at construction): overlap_step, and
optimizer state on the device (its Adam would read the host's window). Weights a backward changes
while it runs are those of buckets it has finished: autograd has run every node that saved them.

A speculative update (SuperOffload's: update during the first backward, roll back where the
norm says so) would save the second pass, but its undo needs the previous value of every updated
bucket's state until backward ends: as many bytes as the state itself (12 B/param for Adam, 4 for
8-bit Adam with bf16 masters), more than the gradients it frees. The second pass frees them for
the price of compute.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Callable, Optional, Sequence

import torch

from tiermem.errors import OutOfTierMemory, TierMemError, add_note
from tiermem.handles import Handle
from tiermem.plan.buckets import Bucket
from tiermem.train.homes.grad_homes import GradHome
from tiermem.train.step.grad_norm import slot_norms
from tiermem.train.step.relay import Relay, Stopped
from tiermem.transfer.lease import Lease
from tiermem.transfer.service import CopyService
from tiermem.types import TensorClass, Tier


class WindowGrads(GradHome):
    """The GRAD home under ``update_in_backward``: each bucket's gradients of the step's last
    backward in a pooled host buffer while it is needed, never all of them; those of the step's
    earlier micro-batches in accumulation homes made when a step first accumulates (NOTE [Updates
    in backward]). It also keeps the graph of the step's last backward so far (``graph``): the
    gradients it gives again, which go with the others at the step's end or when they are dropped."""

    landing_tier = Tier.HOST  # the window's, and the accumulation homes' (accumulation_tier: host or NVMe)

    def __init__(self, engine: CopyService, accumulation: Callable[[list[Bucket]], dict[int, GradHome]]):
        """``accumulation``: makes the accumulation homes of some buckets, by bucket index, after
        checking the budgets (:func:`tiermem.train.layout.accumulation_homes`)."""
        self.engine = engine
        self._buckets: dict[int, Bucket] = {}
        self._landing: dict[int, tuple[torch.Tensor, Lease]] = {}
        self._arrived: dict[int, int] = defaultdict(int)
        self._ready: dict[int, tuple[torch.Tensor, Lease, Handle]] = {}  # landed, for the update
        self.received: Callable[[str], bool] = lambda name: True  # the collector's (bound at build)
        self.sharded = False  # under data parallelism: its buckets are a rank's chunks (shard buckets)
        #: the first pass's per-parameter fp32 norms, and the buckets it completed, in their order
        self.norms: dict[str, torch.Tensor] = {}
        self.order: dict[int, None] = {}
        self.relay: Optional[Relay] = None  # the second pass's, while it runs
        self._accumulation = accumulation
        self._acc: dict[int, GradHome] = {}  # by bucket: made when a step first accumulates, kept for the run
        self._stored: set[int] = set()  # buckets whose accumulation home holds grads of this step
        self._into_acc = False  # a backward that is not the step's last lands in the accumulation homes
        self.deferred = False  # inside tm.no_sync(): a backward known not to be the step's last
        self.first = False  # a first pass runs (its graph kept): ShardedGrads leaves no_sync()'s sums be
        #: the scaled loss of the step's last backward so far, its graph kept for the step's second pass
        self.graph: Optional[torch.Tensor] = None

    def add(self, buckets: Sequence[Bucket], *, sharded: bool = False) -> None:
        """Home ``buckets``' grads too (at construction; later, parameters unfrozen since).
        ``sharded``: they are this rank's chunks, whose reduce-scattered grads land whole, every
        backward, from :class:`~tiermem.train.homes.sharded.ShardedGrads` (NOTE [Data parallel])."""
        self._buckets.update((b.index, b) for b in buckets)
        self.sharded = self.sharded or sharded

    # -- the accumulation homes ----------------------------------------------------------------------
    def prepare(self) -> None:
        """Make the accumulation homes of the buckets that have none (the first time a step
        accumulates; then those of parameters unfrozen since), or raise, changing nothing, when
        the budgets have no room for them."""
        missing = [b for index, b in self._buckets.items() if index not in self._acc]
        if not missing:
            return
        try:
            self._acc.update(self._accumulation(missing))
        except OutOfTierMemory as e:
            add_note(
                e,
                "tiermem: update_in_backward: a tm.backward() that is not the step's last (another follows "
                "before tm.step(), or it runs inside tm.no_sync()) accumulates into the whole GRAD home, "
                "4 B/param; raise that budget, or call tm.step() after each tm.backward() (a larger batch "
                "instead of micro-batches), or leave update_in_backward off",
            )
            raise

    def accumulate(self, on: bool) -> None:
        """Around a backward that is not the step's last: its gradients land in the accumulation
        homes (:meth:`prepare` made them); what a first pass found is of no use any more."""
        if on:
            self.prepare()
            self.norms.clear()
            self.order.clear()
        self._into_acc = on

    def _homes(self) -> list[GradHome]:
        return list({id(h): h for h in self._acc.values()}.values())

    def _at_home(self, b: Bucket) -> bool:
        """``b``'s gradients of the step are its accumulation home's alone: the step's last
        backward gave it none (or ran inside no_sync())."""
        return b.index in self._stored and b.index not in self.order

    # -- backward ----------------------------------------------------------------------------------
    def _to_acc(self) -> bool:
        """Landings go to the accumulation homes: a backward that is not the step's last runs, or,
        under data parallelism, the step sends what backwards inside ``tm.no_sync()`` left on the
        device (outside any pass)."""
        return self._into_acc or (self.sharded and not self.first and self.relay is None)

    def landing(self, b: Bucket, fill: int) -> torch.Tensor:
        if self._to_acc():
            self._stored.add(b.index)
            return self._acc[b.index].landing(b, fill)
        if b.index not in self._landing:
            try:
                lease = self.engine.lease(b.numel * 4, f"<grads for an update in backward {b.key}>", TensorClass.GRAD)
            except OutOfTierMemory as e:
                add_note(
                    e,
                    f"tiermem: update_in_backward holds {len(self._landing) + len(self._ready)} buckets' gradients "
                    f"besides this one; raise the host budget or lower bucket_size",
                )
                raise
            t = lease.view(torch.float32)[: b.numel]
            if b.index in self._stored:  # earlier micro-batches' sum: this backward's grads are added to it
                try:
                    self._read_home(b, t.copy_)
                except BaseException:
                    lease.release()
                    raise
            self._landing[b.index] = (t, lease)
        return self._landing[b.index][0]

    def keeps(self) -> bool:
        """A first pass runs: its graph runs again, so what backwards inside ``tm.no_sync()`` left
        on the device must stay for that pass (ShardedGrads sends a copy of it)."""
        return self.first

    def holds(self, b: Bucket) -> bool:
        """The buffer :meth:`landing` gives next for ``b`` holds grads of this step, which the
        ones landing are added to: the accumulation home's sum, or the window's copy of it."""
        return b.index in self._stored

    def _read_home(self, b: Bucket, use: Callable[[torch.Tensor], object]) -> None:
        """``use(grads)`` on ``b``'s gradients at its accumulation home (all landed: the backward
        that sent them settled them)."""
        t, free = self._acc[b.index].read(b, 0)
        try:
            use(t)
        finally:
            free()

    def arrived(self, b: Bucket) -> None:
        if self._into_acc:
            self._acc[b.index].arrived(b)
            return
        self._arrived[b.index] += 1
        if self._arrived[b.index] >= len(b.slots):
            self._complete(b)

    def complete(self, b: Bucket) -> None:
        if self._to_acc():
            self._acc[b.index].complete(b)
        elif b.index in self._landing:
            self._complete(b)

    def end_backward(self) -> None:
        for home in self._homes():
            home.end_backward()
        for index in list(self._landing):
            self._complete(self._buckets[index])
        self._arrived.clear()

    def wait(self) -> None:
        for home in self._homes():
            home.wait()

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
                self._norms(b, t)
            finally:
                lease.release()
            self.order.pop(b.index, None)
            self.order[b.index] = None
        elif relay.finished:  # the update stopped (it failed): nothing will read these
            copied.wait()
            lease.release()
        else:
            self._ready[b.index] = (t, lease, copied)
            relay.landed(b.index)

    def _norms(self, b: Bucket, t: torch.Tensor) -> None:
        """The fp32 norms of ``b``'s received parameters, from its gradients ``t`` (as the step's).
        Sharded, of every piece: which parameters got a gradient on some rank is agreed only at
        the step, and a chunk lands whole (a piece no rank's backward reached holds zeros); the
        step reads the norms of the agreed ones alone."""
        self.norms.update(slot_norms(t, [s for s in b.slots if self.sharded or self.received(s.name)]))

    # -- the step ----------------------------------------------------------------------------------
    def step_norms(self) -> dict[str, torch.Tensor]:
        """Every received parameter's fp32 norm: the first pass's, and those of buckets that only
        earlier micro-batches gave gradients, read from their accumulation home."""
        for index in sorted(self._stored):
            b = self._buckets[index]
            if self._at_home(b):
                self._read_home(b, functools.partial(self._norms, b))
        return self.norms

    def all_at_home(self) -> bool:
        """No bucket's gradients wait for a second pass: every one of the step is at its
        accumulation home (the step's last backward ran inside no_sync(), or stopped before any of
        its gradients arrived)."""
        return not self.order

    def read(self, b: Bucket, fill: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """``b``'s gradients of the second pass, once backward has produced them (the update
        waits); those of a bucket the step's last backward gave none, from its accumulation home."""
        if self._at_home(b):
            return self._acc[b.index].read(b, fill)
        if self.relay is None:
            raise TierMemError(
                f"tiermem: bucket {b.key}'s gradients were read outside an update in backward; with "
                f"update_in_backward=True only tm.step() reads them"
            )
        try:
            self.relay.wait_for(b.index)
        except Stopped as e:
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
        return bool(self._landing) or any(home.accumulating() for home in self._homes())

    def defer(self, on: bool) -> None:
        self.deferred = on

    def drop(self) -> None:
        self.release()
        for home in self._homes():
            home.drop()
        self._into_acc = False
        self._forget()

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
        for home in self._homes():
            home.end_step()
        self._forget()

    def _forget(self) -> None:
        """The step's gradients are consumed or dropped: norms, order, accumulated buckets, graph."""
        self._arrived.clear()
        self.norms.clear()
        self.order.clear()
        self._stored.clear()
        self.graph = None

    def ordered(self, plan: list) -> list:
        """``plan`` ((bucket, runs) pairs) in the order the first pass completed its buckets,
        buckets that read no gradient or read them from their accumulation home first."""
        rank = {index: k for k, index in enumerate(self.order)}
        return sorted(plan, key=lambda br: rank.get(br[0].index, -1) if br[1] else -2)
