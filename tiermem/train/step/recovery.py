"""Failed-step recovery: what a step that failed part way left behind, the reads it refuses
until its retry, and what the retry reuses (NOTE [A failed step is rolled forward] in
tiermem/train/homes/nvme_state.py; under overlap_step NOTE [A failed background update] in
tiermem/train/step/background.py).

A failed step is one value, :data:`Failure`: nothing (the last step completed, or its failure
changed nothing), a :class:`StepFailed` (a step failed part way) or an :class:`UpdateFailed`
(overlap_step: the update failed in the background); each says what the retry needs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Optional, Union

import torch

from tiermem.errors import TierMemError, add_note
from tiermem.plan.buckets import Bucket
from tiermem.train.homes.bucket_homes import Homes
from tiermem.train.homes.update_runs import slots_in
from tiermem.train.homes.uploads import Outputs
from tiermem.train.step.grads import GradCollector
from tiermem.train.step.updates import Plan, StepUpdate
from tiermem.transfer.collectives import Group


class Retry(NamedTuple):
    """A step that failed part way, which its retry completes with the same norm and clip (the
    grads of the buckets it updated are gone, so a norm computed again would differ)."""

    norm: torch.Tensor
    clip: float
    arrivals: int  # gradients received when it started: a backward since makes the retry a new step


@dataclass(frozen=True)
class StepFailed:
    """A step (without overlap_step) failed after updating some buckets, or under data
    parallelism: the weights at home may be of two steps."""

    why: str  # the error, for the message that refuses a read
    retry: Optional[Retry]  # None: the retry is a step like any other


@dataclass(frozen=True)
class UpdateFailed:
    """overlap_step: the update failed in the background; the rest of it is kept for the retry."""

    rest: StepUpdate  # its buckets not updated, with their step numbers, clip and gradient buffer
    landing: Plan  # what lands once the update is done
    norm: float
    why: Optional[str]  # set when the weights at home may be of two steps: reads are refused
    error: Optional[BaseException] = None  # its error, until a forward or step raises it (once)


Failure = Union[None, StepFailed, UpdateFailed]


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class Recovery:
    """The failure state of a model's steps, and the roll-back of a failed one."""

    def __init__(self, buckets: list[Bucket], homes: Homes, grads: GradCollector, outputs: Outputs, group: Group):
        self.buckets, self.homes, self.grads, self.outputs, self.group = buckets, homes, grads, outputs, group
        self.failure: Failure = None
        self.unsent: set[int] = set()  # buckets a failed step updated: their weights go home again

    # -- reads ------------------------------------------------------------------------------------
    def between(self) -> Optional[str]:
        """Why the weights at home may be of two steps (reads are refused until the retry); None
        when they are all of one."""
        return None if self.failure is None else self.failure.why

    def check_whole(self, call: str) -> None:
        """Refuse ``call`` while a failed step has left some buckets updated and others not."""
        why = self.between()
        if why is not None:
            raise TierMemError(
                f"tiermem: {call} would use weights of two steps: the last tm.step() failed part "
                f"way ({why}) after updating some of the weights; call tm.step() again to "
                f"complete it (its gradients were kept), or tm.load() a checkpoint"
            )

    def report(self) -> None:
        """overlap: raise, once, the error of an update that failed in the background."""
        f = self.failure
        if isinstance(f, UpdateFailed) and f.error is not None:
            self.failure = replace(f, error=None)
            raise f.error

    def retry(self, arrivals: int) -> Optional[Retry]:
        """The norm and clip of the step that failed part way, when this step is its retry (no
        gradient arrived since)."""
        f = self.failure
        if isinstance(f, StepFailed) and f.retry is not None and f.retry.arrivals == arrivals:
            return f.retry
        return None

    def step_ended(self) -> None:
        """A step returned: every bucket has had its update (or it changed nothing). Only a step's
        own failure goes: one of the update it started in the background, which that update's
        thread may be writing meanwhile, stays (NOTE [A failed background update])."""
        if isinstance(self.failure, StepFailed):
            self.failure = None

    # -- a failed update --------------------------------------------------------------------------
    def keep_for_retry(
        self, upd: StepUpdate, updated: set[int], error: BaseException, landing: Plan, norm: float
    ) -> None:
        """overlap: an update (in the background, or its retry) failed. What it did not update is
        kept, with its step numbers, clip and gradient buffer, for the retry; nothing else is
        touched, since a forward and backward of the next step may be running meanwhile (NOTE [A
        failed background update])."""
        why = self.between()  # a retry that updated nothing leaves the weights as its first try did
        if updated or self.group.world > 1:  # under data parallelism another rank may be a step ahead
            why = _describe(error)
        self.failure = UpdateFailed(upd.without(updated), landing, norm, why)
        self.group.abort(error)  # NOTE [A failed step stops every rank at once]

    def roll_back(
        self,
        plan: Plan,
        updated: set[int],
        landed: set[int],
        error: BaseException,
        attempt: Retry,
        step_of: dict[str, int],
    ) -> None:
        """A failed step: buckets already updated (in memory) keep their update and drop their
        grads, so a retry cannot apply them twice; the others get their step counts back in
        ``step_of`` (their grads stay, for a retry), and their weights are sent home again from the
        state they hold (revertible ones: went back to) if new ones had ``landed``. With some
        buckets updated, reads of the weights are refused until the retry (:meth:`check_whole`).
        ``attempt``: the norm and clip the retry reuses."""
        for b, runs in plan:
            for s in slots_in(b, runs):
                if b.index in updated:
                    self.grads.forget(s.name)
                else:
                    step_of[s.name] -= 1
        self.unsent |= updated  # their new weights may not have reached home: the next step sends them
        why = _describe(error) if updated else self.between()
        retry = attempt if why is not None else None  # nothing changed, now or in an earlier try: a step like any other
        restore = [
            b for b, _ in plan if self.homes.state[b.index].revertible or (b.index in landed and b.index not in updated)
        ]
        if self.group.world > 1:
            # Under data parallelism the other ranks are still in this step's collectives (or stop in
            # them): no collective of this rank's may follow (the weights' resend gathers the masters,
            # which another rank's gather of its step could match), and its weights may be of two
            # steps on another rank: every read is refused; the way out is a checkpoint. The other
            # ranks are told, and stop at once (NOTE [A failed step stops every rank at once]).
            self.failure = StepFailed(_describe(error), retry)
            self.group.abort(error)
            add_note(
                error,
                f"tiermem: under data parallelism a step that failed on one rank stops every rank: "
                f"restart them and tm.load() the last checkpoint (rank {self.group.rank} of {self.group.world})",
            )
            return
        self.failure = None if why is None else StepFailed(why, retry)
        if restore:
            try:
                self.send_masters(restore)
            except TierMemError as again:  # the step's own error is the one to raise (under data parallelism
                # the others' is a collective that failed because this rank stopped mid-step)
                self.failure = StepFailed(
                    f"{_describe(error)}; the new weights it had sent could not be taken back", retry
                )
                add_note(
                    error,
                    f"tiermem: the new weights this step had sent could not be taken back "
                    f"({type(again).__name__}: {again})",
                )

    # -- weights sent again -----------------------------------------------------------------------
    def send_unsent(self) -> None:
        """The weights of buckets a failed step updated, sent home again from their master (NOTE
        [A failed step is rolled forward] in tiermem/train/homes/nvme_state.py)."""
        if not self.unsent:
            return
        self.homes.begin_update()
        self.send_masters([b for b in self.buckets if b.index in self.unsent])
        self.unsent.clear()

    def send_masters(self, buckets: list[Bucket]) -> None:
        """Each bucket's weights sent home from its fp32 master as its state home holds it."""
        uploads = self.outputs.session()
        for b in buckets:
            out = uploads.target(b)
            if out is None:  # rounded from the master when read: nothing to send
                continue
            out.copy_(self.homes.state[b.index].read(b)[0])
            uploads.done(b, out, [(0, b.numel, 0)])
        uploads.finish()
