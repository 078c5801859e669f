"""The optimizer step of a TieredModel.

:meth:`Stepper.run`, for the whole model:

1. waits until every gradient of the step is at its home (:mod:`tiermem.train.step.grads`);
2. computes the global gradient norm (per parameter, then over parameters, as
   ``clip_grad_norm_`` does), unscaled by the fp16 loss scale; a non-finite norm means overflow:
   the step is skipped and nothing is touched (:mod:`tiermem.train.step.grad_norm`);
3. runs the fused Adam per bucket where its optimizer state lives (each :class:`StateHome` runs
   the update over its buckets: :mod:`tiermem.train.step.updates`), writing the new low-precision
   weights in the same pass, which go home while Adam runs on the next bucket
   (:mod:`tiermem.train.homes.uploads`); under overlap_step in the background
   (:mod:`tiermem.train.step.background`).

A step that fails part way is rolled forward by its retry (:mod:`tiermem.train.step.recovery`).

Like ``torch.optim``, a parameter that received no gradient in a step is not updated, and each
parameter keeps its own step count (bias correction). Each parameter's hyperparameters are those
of the param group that lists it when the step starts (NOTE [Param groups] in tiermem/config/specs.py):
a bucket's update runs in ranges that share a step count and a group. The step talks to homes only (NOTE
[Homes]): it never asks which tier a bucket's grads, state or weights are on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from tiermem.errors import TierMemError
from tiermem.observe.trace import Tracer
from tiermem.plan.buckets import Bucket
from tiermem.train.homes.bucket_homes import wait_gathered
from tiermem.train.homes.uploads import Outputs
from tiermem.train.layout import Layout
from tiermem.train.step.background import Background
from tiermem.train.step.grad_norm import Norms, Skips, bucket_norms, clip_coefficient, global_norm
from tiermem.train.step.grads import GradCollector
from tiermem.train.step.groups import check_listed, hyper_of
from tiermem.train.step.in_backward_passes import Passes
from tiermem.train.step.recovery import Recovery, Retry, UpdateFailed
from tiermem.train.step.relay import Relay
from tiermem.train.step.scaler import LossScaler
from tiermem.train.step.updates import BucketUpdates, StepUpdate, checked_records
from tiermem.transfer.collectives import Group, Solo
from tiermem.transfer.service import CopyService

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    """What ``tm.step()`` did.

    Attributes:
        skipped: True when the gradients held an inf or NaN (or no backward ran since the last step)
            and nothing was updated.
        grad_norm: the global L2 norm of the unscaled gradients, before clipping.
        loss_scale: the loss scale of the next backward (1.0 unless fp16).
        step: the number of updates applied so far.
    """

    skipped: bool  # True when the gradients overflowed (inf/NaN) and nothing was updated
    grad_norm: float  # global L2 norm of the (unscaled) gradients, before clipping
    loss_scale: float  # the loss scale for the next backward (1.0 unless fp16)
    step: int  # updates applied so far


class Stepper:
    """Runs the step. With ``overlap=True`` (one-step delayed update) the Adam of step k runs on
    the engine's compute thread while forward and backward of step k+1 run; backward then fills
    the second gradient buffer, and step k+1 first sends home step k's weights. A gradient is thus
    computed with weights one update older than in the plain loop."""

    def __init__(
        self,
        layout: Layout,
        grads: GradCollector,
        outputs: Outputs,
        engine: CopyService,
        scaler: LossScaler,
        *,
        grad_clip: Optional[float],
        tracer: Tracer,
        overlap: bool = False,
        group: Group = Solo(),
        max_skipped: Optional[int] = 10,
        passes: Optional[Passes] = None,
    ):
        """``passes``: the backward passes under update_in_backward, and their GRAD home (NOTE
        [Updates in backward])."""
        self.layout, self.homes, self.grads, self.group = layout, layout.homes, grads, group
        self.scaler, self.grad_clip, self.tracer, self.overlap = scaler, grad_clip, tracer, overlap
        self.steps = 0
        self.seconds = 0.0
        self.wait_seconds = 0.0  # of ``seconds``: waiting for the last grads to reach their homes
        self._step_of: dict[str, int] = {}  # canonical parameter name -> updates applied to it
        self.skips = Skips(max_skipped)  # NOTE [A stalled run is loud]
        self.updates = BucketUpdates(self.homes, outputs, tracer, fresh_weights=not overlap)
        self.recovery = Recovery(layout.step_buckets, self.homes, grads, outputs, group)
        self.background = Background(self.updates, self.recovery, engine, self.homes, outputs, tracer, group)
        self.passes = passes
        self.window = None if passes is None else passes.window

    @property
    def skipped_in_a_row(self) -> int:
        """Steps skipped in a row because their gradients were not finite."""
        return self.skips.in_a_row

    # -- between steps -----------------------------------------------------------------------------
    def finish_pending(self) -> None:
        """Every transfer this step started has landed, and a background update is home."""
        self.grads.settle()
        self.background.land(self.steps)

    def check_whole(self, call: str) -> None:
        """Refuse ``call`` (a forward, or a checkpoint) while a failed step has left some buckets
        updated and others not: it would use weights of two steps (NOTE [A failed step is rolled
        forward] in tiermem/train/homes/nvme_state.py). Under overlap_step an update that failed in the
        background is reported here if it has ended (NOTE [A failed background update])."""
        if self.background.ended_badly():
            self.background.land(self.steps)  # keeps its error for the next line
        self.recovery.report()
        self.recovery.check_whole(call)

    # -- the step --------------------------------------------------------------------------------
    def run(self, groups: list[dict]) -> StepResult:
        t0 = time.perf_counter()
        with self.tracer.span("step", "compute", step=self.steps + 1):
            result = self._run(groups)
            self.recovery.step_ended()
            for home in self.homes.weight_homes():  # the iteration ends, skipped or not
                home.end_update()
        self.seconds += time.perf_counter() - t0
        return result

    def _run(self, groups: list[dict]) -> StepResult:
        t0 = time.perf_counter()
        with self.tracer.span("wait grads", "stall"):
            self.finish_pending()
        self.wait_seconds += time.perf_counter() - t0  # the grads' exposed trip home, for report()
        self.recovery.report()  # NOTE [A failed background update]: the retry is the next tm.step()
        self.recovery.send_unsent()
        completed = self._complete_failed()
        if completed is not None and not self.grads.has_grads():
            return completed  # the failed update is done, and no backward ran since it started
        if not self.grads.has_grads():  # no backward since the last step (on any rank): a no-op, not counted
            log.warning(
                "tiermem: step() with no gradient since the last step (no backward?): nothing updated, "
                "the step is not counted"
            )
            return StepResult(True, 0.0, self.scaler.scale, self.steps)
        wait_gathered(self.homes, self.grads.fill)
        received = [name for name in self.grads.names if self.grads.received(name)]  # the step's one pass
        scale = self.scaler.scale
        norms = self._norms(received)
        norm = norms.total / scale if self.scaler.enabled else norms.total
        if not torch.isfinite(norm):
            return self._skipped(norm, norms)
        self.skips.stepped()
        clip = clip_coefficient(self.grad_clip, norm)
        retry = self.recovery.retry(self.grads.arrivals)
        if retry is not None:  # the retry of a step that failed part way: its norm and clip
            norm, clip = retry.norm, retry.clip
        self._launch(self._snapshot(groups, received, scale, clip), norm)
        self.scaler.update(found_inf=False)
        self.grads.consumed(swap=self.overlap and self.background.in_flight is not None)  # a kept graph goes too
        self.steps += 1
        return StepResult(False, norm.item(), self.scaler.scale, self.steps)

    def _norms(self, received: list[str]) -> Norms:
        """The step's gradient norms (``received``: the parameters that got a gradient, in order)."""
        if self.window is not None:
            per_slot = self.window.step_norms()
        else:
            per_slot = bucket_norms(self.layout.step_buckets, self.homes, self.grads.fill, self.grads.received)
        return global_norm(per_slot, received, self.group)

    def _snapshot(self, groups: list[dict], received: list[str], scale: float, clip: float) -> StepUpdate:
        """The update of this step: each parameter that got a gradient takes one more step, in
        ranges of its bucket that share a step count and a param group."""
        group_of = check_listed(groups, received)
        for name in received:
            self._step_of[name] = self._step_of.get(name, 0) + 1
        hyper = [hyper_of(g) for g in groups]  # as the groups are now: an lr scheduler may change them meanwhile
        plan, hyper_at = [], {}
        for b in self.layout.step_buckets:
            runs = self._runs(b, group_of)
            plan.append((b, [(a, e, step) for a, e, step, _ in runs]))
            hyper_at.update({(b.index, a): hyper[g] for a, _, _, g in runs})
        try:  # NOTE [Checked once a step]: a refused value changes nothing, step counts included
            records = checked_records(plan, hyper_at, scale, clip)
        except BaseException:
            for name in received:
                self._step_of[name] -= 1
            raise
        return StepUpdate(plan, hyper_at, scale, clip, self.grads.fill, records)

    def _runs(self, bucket: Bucket, group_of: dict[str, int]) -> list[tuple[int, int, int, int]]:
        """Contiguous ranges of parameters that got a grad (those in ``group_of``) and share a step
        count and a param group: (start, end, step number (1-based, including this update), group index)."""
        runs: list[tuple[int, int, int, int]] = []
        for s in bucket.slots:
            group = group_of.get(s.name)
            if group is None:
                continue
            step = self._step_of[s.name]
            if runs and runs[-1][1] == s.offset and runs[-1][2:] == (step, group):
                runs[-1] = (runs[-1][0], s.offset + s.numel, step, group)
            else:
                runs.append((s.offset, s.offset + s.numel, step, group))
        return runs

    def _launch(self, upd: StepUpdate, norm: torch.Tensor) -> None:
        """Run ``upd``: in the background under overlap_step, else here (under update_in_backward
        as the step's second backward lands each bucket's gradients)."""
        if not any(runs for _, runs in upd.plan):
            return  # no parameter got a gradient: nothing to update (and no state to stream)
        if self.overlap:
            self.background.start(upd, upd.plan, norm.item())
            return
        attempt = Retry(norm, upd.clip, self.grads.arrivals)  # for a retry, should the update fail part-way
        if self.window is not None:
            self._update_in_backward(upd, attempt)
        else:
            self._update(upd, attempt)

    def _update(self, upd: StepUpdate, attempt: Retry) -> None:
        """The update; if it fails, it is rolled back (:meth:`Recovery.roll_back`) and its error
        propagates."""
        self.updates.run(
            upd,
            lambda updated, landed, e: self.recovery.roll_back(upd.plan, updated, landed, e, attempt, self._step_of),
        )

    def _update_in_backward(self, upd: StepUpdate, attempt: Retry) -> None:
        """The update, bucket by bucket, as the step's second backward lands each bucket's
        gradients (NOTE [Updates in backward]); at once where they are all at their accumulation home."""
        passes = self.passes
        assert passes is not None
        window = passes.window
        if not passes.kept:
            if not window.all_at_home():
                raise TierMemError(
                    "tiermem: update_in_backward: the graph of this step's backward is gone (a step that "
                    "failed part way cannot be completed: the updated buckets' gradients were never kept); "
                    "tm.load() the last checkpoint"
                )
            self._update(upd, attempt)  # every grad of the step at its accumulation home (no_sync()): no second pass
            return
        upd = upd.with_plan(window.ordered(upd.plan))
        relay = window.relay = Relay()
        self.grads.again(True)
        failed: Optional[BaseException] = None
        try:
            with passes.timed():
                relay.start(lambda: self._update(upd, attempt))
                try:
                    with self.tracer.span("backward again", "compute"):
                        passes.again()
                except BaseException as e:  # noqa: BLE001 - raised below, after the update (waiting for a bucket) rolled back
                    failed = e
                relay.close()
        finally:
            window.relay = None
            self.grads.again(False)
        failed = failed or relay.error
        if failed is not None:
            self.grads.discard_in_flight()
            window.release()
            if self.recovery.between() is not None:  # buckets were updated: the rest cannot be (their grads are gone)
                passes.drop_graph()
            raise failed
        self.homes.begin_update()  # copies the second backward fetched may be of weights updated since

    def _complete_failed(self) -> Optional[StepResult]:
        """overlap: the retry of an update that failed (NOTE [A failed background update]). Its
        result; None when no update had failed."""
        failed = self.recovery.failure
        if not isinstance(failed, UpdateFailed):
            return None
        self.background.retry(failed, self.steps, now=self.grads.has_grads())
        return StepResult(False, failed.norm, self.scaler.scale, self.steps)

    def _skipped(self, norm: torch.Tensor, norms: Norms) -> StepResult:
        """Overflow or non-finite gradients: nothing is touched. In fp16 that is the loss scale's
        business; in bf16/fp32 it is not expected (NOTE [A stalled run is loud])."""
        self.scaler.update(found_inf=True)
        self.grads.consumed()  # no second backward: a kept graph goes with the grads
        result = StepResult(True, norm.item(), self.scaler.scale, self.steps)
        if not self.scaler.enabled:
            self.skips.skipped(norm.item(), norms)
        return result

    # -- state for checkpoints --------------------------------------------------------------------
    def param_steps(self) -> dict[str, int]:
        return dict(self._step_of)

    def load_param_steps(self, steps: dict[str, int], total: int) -> None:
        self._step_of = dict(steps)
        self.recovery.failure = None  # every weight comes from the checkpoint; a failed update's remains go
        self.steps = int(total)
