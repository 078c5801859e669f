"""overlap_step's update: the update of step k runs on the engine's compute thread while the forward
and backward of step k+1 run, and its new weights land when step k+1 starts; and the retry of one
that failed.

# NOTE [A failed background update]
Under overlap_step the update of step k runs in the background while the forward and backward of
step k+1 run on the weights of step k-1, and its new weights wait in each bucket's ``param_out``
until step k+1 lands them (:mod:`tiermem.train.homes.uploads`): nothing the update does reaches the
weights a forward reads. If it fails (an NVMe read or write), the buckets whose state landed keep
it (NOTE [A failed step is rolled forward]); the rest of the update (its buckets, step numbers,
clip, gradient buffer) is kept for a retry, and nothing else is touched from the background (the
next step's backward may be filling the other gradient buffer). The error is raised once, with a
note saying to call ``tm.step()`` again or ``tm.load()`` a checkpoint, by the next ``tm.step()``,
forward, ``tm.save()``, ``tm.state_dict()``, ``tm.detach()`` or ``tm.resident()`` once the update
has ended (``tm.load()`` drops it with what it left to do). Forwards, checkpoints, state dicts and
``detach()`` are then refused while some buckets hold state of step k and others not
(:meth:`Stepper.check_whole`), as after a failed step without overlap. The retry
(``tm.step()``): with no backward since, the rest of the update runs in the background again, as
the first try did, so the next forward runs on the weights of step k-1 as it would have; when the
next step's backward already ran (the failure came while it did), the rest runs at once, every
weight of step k lands, and then step k+1 is taken. Either way the run gives the bits of one that
never failed (tests/test_failed_steps.py). The step's count, loss scale and gradient norm are
those the update started with. Under data parallelism there is no retry: the other ranks are
stopped in (or past) the update's collectives, so forwards are refused and ``tm.step()`` raises,
saying to restart the ranks and ``tm.load()`` the last checkpoint.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Optional

from tiermem.errors import TierMemError, add_note
from tiermem.handles import Handle
from tiermem.observe.trace import Tracer
from tiermem.train.homes.bucket_homes import Homes
from tiermem.train.homes.uploads import Outputs
from tiermem.train.step.recovery import Recovery, UpdateFailed
from tiermem.train.step.updates import BucketUpdates, Plan, StepUpdate
from tiermem.transfer.collectives import Group
from tiermem.transfer.service import CopyService


class InFlight(NamedTuple):
    """The update running in the background, what lands once it is done, and its norm."""

    handle: Handle
    landing: Plan
    norm: float


class Background:
    """overlap_step: the update in flight on the engine's compute thread, its landing at the next
    step, and the retry of one that failed (NOTE [A failed background update])."""

    def __init__(
        self,
        updates: BucketUpdates,
        recovery: Recovery,
        engine: CopyService,
        homes: Homes,
        outputs: Outputs,
        tracer: Tracer,
        group: Group,
    ):
        self.updates, self.recovery, self.engine, self.homes = updates, recovery, engine, homes
        self.outputs, self.tracer, self.group = outputs, tracer, group
        self.in_flight: Optional[InFlight] = None

    def start(self, upd: StepUpdate, landing: Plan, norm: float) -> None:
        """Run ``upd`` in the background; ``landing`` lands at the next step."""
        self.in_flight = InFlight(
            self.engine.run_async(lambda: self._run(upd, landing, norm), name="adam"), landing, norm
        )

    def _run(self, upd: StepUpdate, landing: Plan, norm: float) -> None:
        """The update; if it fails, its rest is kept for the retry."""
        self.updates.run(upd, lambda updated, _, e: self.recovery.keep_for_retry(upd, updated, e, landing, norm))

    def ended_badly(self) -> bool:
        """The update in flight has ended, and failed."""
        return self.in_flight is not None and self.in_flight.handle.done() and not self.in_flight.handle.succeeded()

    def land(self, steps: int) -> None:
        """Wait for the update in flight (of step ``steps``), then send home the weights it
        produced. If it failed, its error is kept, with a note saying what to do, for the next
        forward or step to raise (:meth:`Recovery.report`)."""
        if self.in_flight is None:
            return
        handle, landing, _ = self.in_flight
        self.in_flight = None
        try:
            with self.tracer.span("wait background adam", "stall"):
                self.engine.join(handle)  # ordering: on a GPU the caller's stream waits for Adam's kernels
        except BaseException as e:
            failure = self.recovery.failure
            if not isinstance(failure, UpdateFailed):  # not a failure the update kept a retry for
                raise
            add_note(
                e,
                f"tiermem: this was the update of step {steps} (overlap_step), which ran in the "
                f"background; call tm.step() again to complete it (its gradients were kept), or "
                f"tm.load() a checkpoint",
            )
            self.recovery.failure = replace(failure, error=e)
            return
        self.homes.begin_update()
        self.outputs.land_background(landing)

    def retry(self, failed: UpdateFailed, steps: int, *, now: bool) -> None:
        """The retry of the update of step ``steps`` that ``failed``: with no backward since,
        what is left runs in the background again, as the update did; ``now`` (a backward ran
        since), it runs here and its weights land, before the next step."""
        if self.group.world > 1:  # the other ranks are stopped in (or past) the update's collectives
            raise TierMemError(
                f"tiermem: the update of step {steps} failed in the background on rank {self.group.rank} "
                f"of {self.group.world}; under data parallelism a failed step stops every rank: restart them "
                f"and tm.load() the last checkpoint"
            )
        if now:
            self.homes.begin_update()
            self._run(failed.rest, failed.landing, failed.norm)  # a failure again keeps what is left for the next retry
            self.recovery.failure = None  # the weights at home are all of the step before (no half of it landed)
            self.outputs.land_background(failed.landing)
        else:
            self.recovery.failure = None
            self.start(failed.rest, failed.landing, failed.norm)
