"""Gradients leaving the device during backward, bucket by bucket, to their GRAD home.

:meth:`GradCollector.on_grad` is every trainable parameter's post-accumulate-grad hook: it hands
the gradient to the engine, which copies it into the fp32 buffer its home gives (converting, or
adding on later micro-batches of the same step) while backward continues, and frees the device
gradient once the copy has read it. The collector remembers which parameters got a gradient in
this step (a parameter that got none is not updated, as in ``torch.optim``) and which buffer
backward fills (two alternate under overlap_step).
"""
from __future__ import annotations

import itertools

import torch

from tiermem.errors import OutOfTierMemory
from tiermem.handles import Handle, wait_all, wait_all_quietly
from tiermem.plan.buckets import Bucket, Slot
from tiermem.train.homes import Homes
from tiermem.transfer.collectives import Group, Solo
from tiermem.types import TensorClass, Tier


class GradCollector:
    def __init__(self, homes: Homes, slot_of: dict[int, tuple[Bucket, Slot]], engine, device_ledger, *,
                 group: Group = Solo()):
        self.homes, self.slot_of, self.engine, self.device_ledger = homes, slot_of, engine, device_ledger
        self.group = group
        self.names = [s.name for _, s in sorted(slot_of.values(), key=lambda bs: bs[1].order)]  # one order, every rank
        self.fill = 0  # which gradient buffer backward fills (always 0 without overlap_step)
        self._got: set[str] = set()  # parameters that received a grad this step
        self._in_flight: list[tuple[Handle, str]] = []  # grad copies in flight, with their ledger tags
        self._copy_ids = itertools.count()
        self.arrivals = 0  # gradients received since the model was built (a backward that got none changed nothing)

    # -- during backward ------------------------------------------------------------------------
    def on_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: ship this parameter's grad to its bucket's GRAD home."""
        grad = param.grad
        if grad is None:
            return
        self.arrivals += 1
        bucket, slot = self.slot_of[id(param)]
        home = self.homes.grads[bucket.index]
        acc = home.landing(bucket, self.fill)[slot.offset:slot.offset + slot.numel]
        key = slot.name
        tag = f"<grad in flight {slot.name} #{next(self._copy_ids)}>"  # one tag per copy: micro-batches overlap
        self._reserve(tag, grad.numel() * grad.element_size())
        try:
            h = self.engine.copy_async(acc, grad.reshape(-1), src_tier=Tier.DEVICE, dst_tier=home.landing_tier,
                                       accumulate=key in self._got, kind=TensorClass.GRAD)
        except BaseException:
            self.device_ledger.release(tag)
            raise  # the grad stays on the parameter
        h.add_done_callback(lambda _f, t=tag: self.device_ledger.release(t))
        self._in_flight.append((h, tag))
        self._got.add(key)
        param.grad = None  # the device grad is freed once the copy has read it
        home.arrived(bucket)

    def _reserve(self, tag: str, nbytes: int) -> None:
        try:
            self.device_ledger.reserve(tag, nbytes, TensorClass.GRAD)
        except OutOfTierMemory:  # the device budget is tight: let the grads in flight land first
            self.wait_copies()
            self.device_ledger.reserve(tag, nbytes, TensorClass.GRAD)

    def end_backward(self) -> None:
        """Backward has returned: every home completes the buckets still open."""
        for home in self.homes.grad_homes():
            home.end_backward()

    # -- before the step -------------------------------------------------------------------------
    def wait_copies(self) -> None:
        """Wait for the gradient copies in flight; their device bytes are free afterwards."""
        if self._in_flight:
            handles, self._in_flight = self._in_flight, []
            try:
                wait_all([h for h, _ in handles])
            finally:
                for _, tag in handles:  # the done-callback may not have run yet when wait returns
                    self.device_ledger.release(tag)

    def settle(self) -> None:
        """Every grad of this step is at home. If some did not arrive (a copy or a flush to NVMe
        failed), this step's grads are dropped with the error, never stepped on as a mix."""
        try:
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
        handles, self._in_flight = self._in_flight, []
        wait_all_quietly([h for h, _ in handles])
        for _, tag in handles:
            self.device_ledger.release(tag)
        self._got.clear()
        for home in self.homes.grad_homes():
            home.drop()

    # -- the step's view ---------------------------------------------------------------------------
    def has_grads(self) -> bool:
        return bool(self._got)

    def received(self, name: str) -> bool:
        return name in self._got

    def forget(self, name: str) -> None:
        """``name`` was updated by a step that then failed: a retry must not apply its grad again."""
        self._got.discard(name)

    def consumed(self, *, swap: bool = False) -> None:
        """The step used (or skipped) the grads; with ``swap`` the next backward fills the other
        buffer while an update in the background still reads this one."""
        self._got.clear()
        for home in self.homes.grad_homes():
            home.end_step()
        if swap:
            self.fill ^= 1
