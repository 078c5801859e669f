"""Gradients leaving the device during backward, bucket by bucket, to their GRAD home.

:meth:`GradCollector.on_grad` is every trainable parameter's post-accumulate-grad hook: it holds
the gradient until every parameter of its bucket has one, then hands the bucket's gradients to
the engine as one request (one turn of the copy lane, one completion), which copies each into the
fp32 buffer its home gives (converting, or adding on later micro-batches of the same step) while
backward continues, and frees the device gradients once the copy has read them. A bucket that a
backward leaves incomplete (a parameter got no gradient) goes at the end of that backward. The
collector remembers which parameters got a gradient in this step (a parameter that got none is
not updated, as in ``torch.optim``) and which buffer backward fills (two alternate under
overlap_step).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import torch

from tiermem.errors import OutOfTierMemory
from tiermem.handles import wait_all, wait_all_quietly
from tiermem.memory.ledger import InFlight, Ledger
from tiermem.plan.buckets import Bucket, Slot
from tiermem.train.homes.bucket_homes import Homes
from tiermem.transfer.collectives import Group, Solo
from tiermem.transfer.service import CopyService
from tiermem.types import TensorClass, Tier


@dataclass
class _Held:
    """A gradient waiting for the rest of its bucket."""

    param: torch.Tensor  # the parameter
    grad: torch.Tensor
    acc: torch.Tensor  # where it lands
    key: str
    first: bool  # the step's first gradient of this parameter: copied, not added
    tag: str  # its device bytes in the ledger


class GradCollector:
    def __init__(
        self,
        homes: Homes,
        slot_of: dict[int, tuple[Bucket, Slot]],
        engine: CopyService,
        device_ledger: Ledger,
        *,
        in_flight: Optional[InFlight] = None,
        group: Group = Solo(),
    ):
        """``in_flight``: where the copies in flight are kept, which the device ledger waits for
        when short (given to its store at construction); by default one of its own."""
        self.homes, self.slot_of, self.engine, self.device_ledger = homes, slot_of, engine, device_ledger
        self.group = group
        self.in_flight = InFlight() if in_flight is None else in_flight  # one copy per bucket, with its tags
        self.names = [s.name for _, s in sorted(slot_of.values(), key=lambda bs: bs[1].order)]  # one order, every rank
        self.fill = 0  # which gradient buffer backward fills (always 0 without overlap_step)
        self._got: set[str] = set()  # parameters that received a grad this step
        self._copy_ids = itertools.count()
        self._held: dict[int, tuple[Bucket, dict[str, _Held]]] = {}  # bucket index -> gradients not yet sent, by name
        self.arrivals = 0  # gradients received since the model was built (a backward that got none changed nothing)
        self._again: Optional[set[str]] = None  # a backward over a kept graph (NOTE [Updates in backward]):
        # the parameters whose grads are in its buffers so far (earlier micro-batches' and its own)
        self._stored: set[str] = set()  # parameters whose grads of this step are at the accumulation home
        # under update_in_backward (earlier micro-batches')

    def add(self, slots: list[Slot]) -> None:
        """Parameters unfrozen since construction (their slots, already in ``slot_of``), after
        the others in the one order every rank uses (NOTE [Freezing and unfreezing])."""
        self.names.extend(s.name for s in sorted(slots, key=lambda s: s.order))

    # -- during backward ------------------------------------------------------------------------
    def on_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: ship this parameter's grad to its bucket's GRAD home."""
        grad = param.grad
        if grad is None:
            return
        if self._again is None:  # a step's second pass is not a backward of its own
            self.arrivals += 1
        bucket, slot = self.slot_of[id(param)]
        home = self.homes.grads[bucket.index]
        acc = home.landing(bucket, self.fill)[slot.offset : slot.offset + slot.numel]
        key = slot.name
        tag = f"<grad in flight {slot.name} #{next(self._copy_ids)}>"  # one tag per copy: micro-batches overlap
        self._reserve(tag, grad.numel() * grad.element_size())
        held = self._held.setdefault(bucket.index, (bucket, {}))[1]
        if key in held:  # the same parameter again before its bucket filled
            self._send(bucket.index)
            held = self._held.setdefault(bucket.index, (bucket, {}))[1]
        if self._again is not None:  # over a kept graph: added to earlier micro-batches', never to the first pass's
            first = key not in self._again
            self._again.add(key)
        else:
            first = key not in self._got
            self._got.add(key)
        held[key] = _Held(param, grad.reshape(-1), acc, key, first, tag)
        param.grad = None  # the device grad is freed once its bucket's copy has read it
        if len(held) >= len(bucket.slots):
            self._send(bucket.index)  # before arrived(): a home may act on the complete bucket
        home.arrived(bucket)

    def _send(self, index: int) -> None:
        """Hand the held gradients of bucket ``index`` to the engine, as one request."""
        bucket, by_name = self._held.pop(index)
        held = list(by_name.values())
        tags = [h.tag for h in held]
        try:
            handle = self.engine.copy_many(
                [(h.acc, h.grad, not h.first) for h in held],
                src_tier=Tier.DEVICE,
                dst_tier=self.homes.grads[bucket.index].landing_tier,
                kind=TensorClass.GRAD,
            )
        except BaseException:
            for h in held:  # nothing was sent: the grads go back on their parameters
                self.device_ledger.release(h.tag)
                h.param.grad = h.grad.view(h.param.shape)
                if h.first and self._again is None:
                    self._got.discard(h.key)
            raise
        handle.add_done_callback(lambda _f: self._release(tags))
        self.in_flight.add(handle, lambda: self._release(tags))

    def _send_all(self) -> None:
        for index in list(self._held):
            self._send(index)

    def _reserve(self, tag: str, nbytes: int) -> None:
        try:
            self.device_ledger.reserve(tag, nbytes, TensorClass.GRAD)
        except OutOfTierMemory:  # the device budget is tight: let the grads in flight land first
            self._send_all()
            self.wait_copies()
            self.device_ledger.reserve(tag, nbytes, TensorClass.GRAD)

    def end_backward(self) -> None:
        """Backward has returned: every home completes the buckets still open."""
        self._send_all()
        for home in self.homes.grad_homes():
            home.end_backward()

    def again(self, on: bool) -> None:
        """Around a backward over the graph a first pass kept (NOTE [Updates in backward]): the
        grads it sends are copied into their buffers where no earlier micro-batch's grads are,
        added to those where they are, and add no parameter to those received (the first pass
        did)."""
        self._again = set(self._stored) if on else None

    def accumulated(self) -> None:
        """Every gradient received so far has landed at the accumulation home (NOTE [Updates in
        backward]): a backward over a kept graph adds its own to those."""
        self._stored = set(self._got)

    # -- before the step -------------------------------------------------------------------------
    def wait_copies(self) -> None:
        """Wait for the gradient copies in flight; their device bytes are free afterwards."""
        copies = self.in_flight.take()
        try:
            wait_all([h for h, _ in copies])
        finally:
            for _, release in copies:
                release()

    def _release(self, tags: list[str]) -> None:
        """The ledger tags of a grad copy that has landed or failed. The done-callback may not
        have run yet when a wait returns, or may run after this: releasing twice is harmless."""
        for tag in tags:
            self.device_ledger.release(tag)

    def settle(self) -> None:
        """Every grad of this step is at home. If some did not arrive (a copy or a flush to NVMe
        failed), this step's grads are dropped with the error, never stepped on as a mix."""
        try:
            self._send_all()  # a backward that stopped early held some
            self.wait_copies()
            for home in self.homes.grad_homes():
                if home.accumulating():  # a backward that stopped early left buckets open
                    home.end_backward()
                home.wait()
            self._agree()
        except BaseException:
            self.drop()
            raise

    def _agree(self) -> None:
        """Every rank updates the parameters that got a gradient on any rank (one mask, all-reduced)."""
        self._got = self.group.agree(self._got, self.names)

    def drop(self) -> None:
        """Forget this step's grads (after an error left some missing): transfers in flight are
        drained, nothing will be stepped on."""
        self.discard_in_flight()
        self._got.clear()
        self._stored.clear()
        for home in self.homes.grad_homes():
            home.drop()

    def discard_in_flight(self) -> None:
        """Grads held or in flight are forgotten (their copies drained), the record of which
        parameters received one is kept."""
        for _, held in self._held.values():
            for h in held.values():
                self.device_ledger.release(h.tag)
        self._held.clear()
        copies = self.in_flight.take()
        wait_all_quietly([h for h, _ in copies])
        for _, release in copies:
            release()

    # -- the step's view ---------------------------------------------------------------------------
    def has_grads(self) -> bool:
        return bool(self._got)

    def received(self, name: str) -> bool:
        return name in self._got

    def forget(self, name: str) -> None:
        """``name`` was updated by a step that then failed: a retry must not apply its grad again."""
        self._got.discard(name)
        self._stored.discard(name)

    def consumed(self, *, swap: bool = False) -> None:
        """The step used (or skipped) the grads; with ``swap`` the next backward fills the other
        buffer while an update in the background still reads this one."""
        self._got.clear()
        self._stored.clear()
        for home in self.homes.grad_homes():
            home.end_step()
        if swap:
            self.fill ^= 1
