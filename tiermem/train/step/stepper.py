"""The optimizer step of a TieredModel.

:meth:`Stepper.run`, for the whole model:

1. waits until every gradient of the step is at its home (:mod:`tiermem.train.step.grads`);
2. computes the global gradient norm (per parameter, then over parameters, as
   ``clip_grad_norm_`` does), unscaled by the fp16 loss scale; a non-finite norm means overflow:
   the step is skipped and nothing is touched;
3. runs the fused Adam per bucket where its optimizer state lives (each :class:`StateHome` runs
   the update over its buckets), writing the new low-precision weights in the same pass, which
   go home while Adam runs on the next bucket (:mod:`tiermem.train.homes.uploads`).

# NOTE [A stalled run is loud]
In bf16 and fp32 an overflow is not expected: a skipped step logs a warning with the names of the
parameters whose gradients are not finite, and ``max_skipped_steps`` (default 10) skipped steps
in a row raise a ``tiermem:`` error with that diagnosis, instead of a run that trains nothing
for hours. In fp16 skipping is the loss scaler's normal way to find its scale.

# NOTE [Split step]
A policy may keep some buckets' optimizer state (and their grads) on the device and the rest on
the host or NVMe (``ZeroOffload(device_fraction=f)``). The step then launches the device's Adam
on the device buckets before the CPU's Adam starts on the others: on an accelerator the device
kernels are queued on its stream and return at once (no host synchronisation on that path), so
both processors update at the same time; the device buckets' new weights are written in place,
and only the host-updated weights are uploaded, behind the CPU's Adam. The next forward is queued
on the same device stream, after the device's Adam. A failure in any home later in the step
(an NVMe read or write) leaves every bucket either before or after its update, and the retry
completes the rest (NOTE [A failed step is rolled forward]), so the device's share may go first.
On a machine without an accelerator the
"device" is the CPU: the two parts run one after the other (running them at once would only share
the same cores), with the same kernel, so the numbers are bit-identical to ZeRO-Offload's.

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
from typing import Any, NamedTuple, Optional

import torch

from tiermem.errors import TierMemError, add_note
from tiermem.handles import Handle
from tiermem.observe.trace import Tracer
from tiermem.optim import StochasticRound, formats as optim_format
from tiermem.optim.formats import StateFormat
from tiermem.plan.buckets import Bucket, Slot
from tiermem.train.homes.per_class import Runs, StateHome, StateViews, slots_in, wait_gathered
from tiermem.train.homes.uploads import Outputs, Uploads
from tiermem.train.layout import Layout
from tiermem.train.step.generic_step import GenericRunner
from tiermem.train.step.grads import GradCollector
from tiermem.train.step.groups import check_listed, hyper_of
from tiermem.train.step.in_backward_passes import Passes
from tiermem.train.step.relay import Relay
from tiermem.train.step.scaler import LossScaler
from tiermem.transfer.collectives import Group, Solo
from tiermem.transfer.service import CopyService
from tiermem.types import Tier

log = logging.getLogger(__name__)

#: the seed of bf16 master weights' stochastic rounding: the bits are a function of (this, the
#: parameter's name, its step, the element's index), so runs are reproducible and placement, bucket
#: sizes and ranks never change them (NOTE [Stochastic rounding bits] in tiermem/optim/kernels/sr.py)
SR_SEED = 0


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


class _Resume(NamedTuple):
    """A step that failed part-way, which its retry completes with the same norm and clip (the
    grads of the buckets it updated are gone, so a norm computed again would differ)."""

    norm: torch.Tensor
    clip: float
    arrivals: int  # gradients received when it started: a backward since makes the retry a new step


Plan = list[tuple[Bucket, Runs]]


@dataclass(frozen=True)
class _Update:
    """What one update needs, snapshotted when the step starts (an lr scheduler may change the
    param groups while an overlapped update runs)."""

    plan: list[tuple[Bucket, Runs]]
    hyper: dict[tuple[int, int], dict]  # (bucket index, start of a run) -> its group's hyperparameters
    scale: float
    clip: float
    fill: int  # the gradient buffer this update reads (backward may fill the other one meanwhile)


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
        self.layout, self.homes, self.grads, self.outputs, self.group = layout, layout.homes, grads, outputs, group
        self.engine, self.scaler, self.grad_clip, self.tracer, self.overlap = engine, scaler, grad_clip, tracer, overlap
        self.steps = 0
        self.seconds = 0.0
        self.wait_seconds = 0.0  # of ``seconds``: waiting for the last grads to reach their homes
        self._step_of: dict[str, int] = {}  # canonical parameter name -> updates applied to it
        self._background: Optional[tuple[Handle, Plan, float]] = None  # overlap: the update in flight, what
        # lands when it is done, its norm
        self._failed: Optional[tuple[_Update, Plan, float]] = None  # overlap: what a failed update left to do,
        # what lands once it is done, its norm (NOTE [A failed background update])
        self._unreported: Optional[BaseException] = None  # overlap: its error, until a forward or step raises it
        self.max_skipped = max_skipped  # NOTE [A stalled run is loud]
        self.skipped_in_a_row = 0
        self._norms: tuple[list[str], torch.Tensor] = ([], torch.zeros(0))
        self._unsent: set[int] = set()  # buckets a failed step updated: their weights go home again
        self._between: Optional[str] = None  # why a failed step left weights of two steps (NOTE [A failed
        # step is rolled forward]): reads are refused until its retry
        self._resuming: Optional[_Resume] = None  # a step that failed part-way, for its retry
        self._generic: Optional[GenericRunner] = None  # a generic optimizer's copy (NOTE [Generic optimizers])
        self.passes = passes
        self.window = None if passes is None else passes.window

    # -- between steps -----------------------------------------------------------------------------
    def finish_pending(self) -> None:
        """Every transfer this step started has landed, and a background update is home."""
        self.grads.settle()
        self._land_background()

    def _land_background(self) -> None:
        """overlap: wait for the update in flight, then send home the weights it produced. If it
        failed, its error is kept, with a note saying what to do, for the next forward or step to
        raise (:meth:`_report_failure`; NOTE [A failed background update])."""
        if self._background is None:
            return
        handle, landing, _ = self._background
        self._background = None
        try:
            with self.tracer.span("wait background adam", "stall"):
                self.engine.join(handle)  # ordering: on a GPU the caller's stream waits for Adam's kernels
        except BaseException as e:
            if self._failed is None:  # not a failure the update kept a retry for
                raise
            add_note(
                e,
                f"tiermem: this was the update of step {self.steps} (overlap_step), which ran in the "
                f"background; call tm.step() again to complete it (its gradients were kept), or "
                f"tm.load() a checkpoint",
            )
            self._unreported = e
            return
        for home in self.homes.weight_homes():
            home.begin_update()
        self.outputs.land_background(landing)

    # -- the step --------------------------------------------------------------------------------
    def check_whole(self, call: str) -> None:
        """Refuse ``call`` (a forward, or a checkpoint) while a failed step has left some buckets
        updated and others not: it would use weights of two steps (NOTE [A failed step is rolled
        forward] in tiermem/train/homes/nvme_state.py). Under overlap_step an update that failed in the
        background is reported here if it has ended (NOTE [A failed background update])."""
        if self._background is not None and self._background[0].done() and not self._background[0].succeeded():
            self._land_background()  # keeps its error for the next line
        self._report_failure()
        if self._between is not None:
            raise TierMemError(
                f"tiermem: {call} would use weights of two steps: the last tm.step() failed part "
                f"way ({self._between}) after updating some of the weights; call tm.step() again to "
                f"complete it (its gradients were kept), or tm.load() a checkpoint"
            )

    def _report_failure(self) -> None:
        """overlap: raise, once, the error of an update that failed in the background."""
        error, self._unreported = self._unreported, None
        if error is not None:
            raise error

    def run(self, groups: list[dict]) -> StepResult:
        t0 = time.perf_counter()
        with self.tracer.span("step", "compute", step=self.steps + 1):
            result = self._run(groups)
            self._between = None  # every bucket has had this step's update (or the step changed nothing)
            for home in self.homes.weight_homes():  # the iteration ends, skipped or not
                home.end_update()
        self.seconds += time.perf_counter() - t0
        return result

    def _run(self, groups: list[dict]) -> StepResult:
        t0 = time.perf_counter()
        with self.tracer.span("wait grads", "stall"):
            self.finish_pending()
        self.wait_seconds += time.perf_counter() - t0  # the grads' exposed trip home, for report()
        self._report_failure()  # NOTE [A failed background update]: the retry is the next tm.step()
        self._send_unsent()
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
        scale = self.scaler.scale
        norm = self._global_norm()
        if self.scaler.enabled:
            norm = norm / scale
        if not torch.isfinite(norm):
            return self._skipped(norm)
        self.skipped_in_a_row = 0
        clip = 1.0
        if self.grad_clip is not None:
            clip = torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0).item()
        if self._resuming is not None and self._resuming.arrivals == self.grads.arrivals:
            norm, clip = self._resuming.norm, self._resuming.clip
        group_of = check_listed(groups, [n for n in self.grads.names if self.grads.received(n)])
        self._count_steps()
        runs = {b.index: self._runs(b, group_of) for b in self.layout.step_buckets}
        hyper = [hyper_of(g) for g in groups]  # as the groups are now: an lr scheduler may change them meanwhile
        upd = _Update(
            [(b, [(a, e, st) for a, e, st, _ in runs[b.index]]) for b in self.layout.step_buckets],
            {(index, a): hyper[g] for index, rs in runs.items() for a, _, _, g in rs},
            scale,
            clip,
            self.grads.fill,
        )
        if not any(runs for _, runs in upd.plan):
            pass  # no parameter got a gradient: nothing to update (and no state to stream)
        elif self.overlap:
            after = (upd.plan, norm.item())
            self._background = (self.engine.run_async(lambda: self._update(upd, after), name="adam"), *after)
        else:
            self._resuming = _Resume(norm, clip, self.grads.arrivals)  # for a retry, should the update fail part-way
            if self.window is not None:
                self._update_in_backward(upd)
            else:
                self._update(upd)
            self._resuming = None
        self.scaler.update(found_inf=False)
        self.grads.consumed(swap=self.overlap and self._background is not None)  # a kept graph goes with them
        self.steps += 1
        return StepResult(False, norm.item(), self.scaler.scale, self.steps)

    def _update_in_backward(self, upd: _Update) -> None:
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
            self._update(upd)  # every grad of the step at its accumulation home (no_sync()): no second pass
            return
        upd = _Update(window.ordered(upd.plan), upd.hyper, upd.scale, upd.clip, upd.fill)
        relay = window.relay = Relay()
        self.grads.again(True)
        failed: Optional[BaseException] = None
        try:
            with passes.timed():
                relay.start(lambda: self._update(upd))
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
            if self._between is not None:  # buckets were updated: the rest cannot be (their grads are gone)
                passes.drop_graph()
            raise failed
        for home in self.homes.weight_homes():
            home.begin_update()  # copies the second backward fetched may be of weights updated since

    def _adam(self, upd: _Update, uploads: Uploads, b: Bucket, runs: Runs, state: StateViews) -> None:
        """The fused update of the bucket's state format over ``runs`` of bucket ``b``, its new
        weights sent home behind it (NOTE [State formats] in tiermem/optim/formats.py)."""
        master, fmt = state[0], b.state
        out = uploads.target(b)  # None: the weights are rounded from the master when read
        if out is not None:
            _fill_gaps(out, master, b, runs)  # `out` holds the bucket's complete new weights
        g, free = self.homes.grads[b.index].read(b, upd.fill) if runs else (None, None)
        common: dict[str, Any] = dict(grad_scale=upd.scale, clip_coef=upd.clip)
        try:
            with self.tracer.span(f"adam {b.key}", "adam", numel=b.numel):
                if fmt.kind == "generic":  # the optimizer's own step() (NOTE [Generic optimizers])
                    assert g is not None or not runs
                    if runs and g is not None:
                        mine = [(i, s, upd.hyper[(b.index, start)], step) for i, s, start, step in _slots_of(b, runs)]
                        self._generic_runner(fmt).step(b, mine, state, g, multiplier=upd.clip / upd.scale)
                        if out is not None:  # else the weights are rounded from the master when read
                            for _, s, _, _ in mine:
                                out[s.offset : s.offset + s.numel].copy_(master[s.offset : s.offset + s.numel])
                elif fmt.elementwise and not fmt.stochastic_round:  # any range is a valid call: one per run
                    for start, end, step in runs:
                        assert g is not None  # read, since there are runs
                        optim_format.step(
                            fmt,
                            master[start:end],
                            [t[start:end] for t in state[1:]],
                            g[start:end],
                            step=step,
                            hyper=upd.hyper[(b.index, start)],
                            out=None if out is None else out[start:end],
                            **common,
                        )
                else:  # blocks, factors and rounding keys start at each parameter's element 0: one call per parameter
                    for i, s, start, step in _slots_of(b, runs):
                        assert g is not None  # read, since there are runs
                        pieces = b.pieces(state, i)
                        a, e = s.offset, s.offset + s.numel
                        sr = StochasticRound.for_parameter(SR_SEED, s.name, s.first) if fmt.stochastic_round else None
                        optim_format.step(
                            fmt,
                            pieces[0],
                            pieces[1:],
                            g[a:e],
                            step=step,
                            hyper=upd.hyper[(b.index, start)],
                            out=None if out is None else out[a:e],
                            stochastic_round=sr,
                            shape=s.shape,
                            **common,
                        )
        finally:
            if free is not None:
                free()
        uploads.done(b, out, runs)

    def _generic_runner(self, fmt: StateFormat) -> GenericRunner:
        """The copy of the generic optimizer this model steps, made at its first step."""
        if self._generic is None:
            self._generic = GenericRunner(fmt)
        return self._generic

    def _update(self, upd: _Update, after: Optional[tuple[Plan, float]] = None) -> None:
        """Each state home runs Adam over its buckets, revertible homes first. If the step fails,
        revertible homes undo what they wrote and their device weights are restored from the
        state they went back to, per-parameter step counts are rolled back, and the error
        propagates with the grads kept for a retry (except those already applied in memory).
        ``after`` (overlap_step: what lands once the update is done, and its norm): a failure
        keeps the rest of the update for the retry instead (NOTE [A failed background update])."""
        uploads = self.outputs.session()
        if not self.overlap:
            for weights in self.homes.weight_homes():
                weights.begin_update()  # cached device copies of off-device weights are about to be stale
        done: list[tuple[StateHome, object]] = []
        updated: set[int] = set()  # buckets whose update cannot be undone
        try:
            for home in _launch_order(self.homes.state_homes()):
                mine = [(b, runs) for b, runs in upd.plan if self.homes.state[b.index] is home]
                done.append(
                    (
                        home,
                        home.step(
                            mine, lambda b, runs, st: self._adam(upd, uploads, b, runs, st), self.tracer, updated
                        ),
                    )
                )
            uploads.finish()
        except BaseException as e:
            uploads.finish(quiet=True)
            for home, undo in done:
                home.revert(undo)
            if after is not None:  # overlap: what lands once the update is done, and its norm
                self._keep_for_retry(upd, updated, e, *after)
            else:
                self._roll_back(upd.plan, updated, uploads.landed(), e)
            raise

    def _keep_for_retry(
        self, upd: _Update, updated: set[int], error: BaseException, landing: Plan, norm: float
    ) -> None:
        """overlap: an update (in the background, or its retry) failed. What it did not update is
        kept, with its step numbers, clip and gradient buffer, for the retry; nothing else is
        touched, since a forward and backward of the next step may be running meanwhile (NOTE [A
        failed background update])."""
        rest = [(b, runs) for b, runs in upd.plan if b.index not in updated and runs]
        self._failed = (_Update(rest, upd.hyper, upd.scale, upd.clip, upd.fill), landing, norm)
        if updated or self.group.world > 1:  # under data parallelism another rank may be a step ahead
            self._between = f"{type(error).__name__}: {error}"
        self.group.abort(error)  # NOTE [A failed step stops every rank at once]

    def _complete_failed(self) -> Optional[StepResult]:
        """overlap: the retry of an update that failed (NOTE [A failed background update]): with no
        backward since, what is left runs in the background again, as the update did; else it
        runs here and its weights land, before the next step. Its result; None when no update
        had failed."""
        if self._failed is None:
            return None
        if self.group.world > 1:  # the other ranks are stopped in (or past) the update's collectives
            raise TierMemError(
                f"tiermem: the update of step {self.steps} failed in the background on rank {self.group.rank} "
                f"of {self.group.world}; under data parallelism a failed step stops every rank: restart them "
                f"and tm.load() the last checkpoint"
            )
        upd, landing, norm = self._failed
        if self.grads.has_grads():
            for home in self.homes.weight_homes():
                home.begin_update()
            self._update(upd, (landing, norm))  # a failure again keeps what is left for the next retry
            self._failed = None
            self.outputs.land_background(landing)
        else:
            self._failed = None
            after = (landing, norm)
            self._background = (self.engine.run_async(lambda: self._update(upd, after), name="adam"), *after)
        self._between = None  # the weights at home are all of the step before (no half of it landed)
        return StepResult(False, norm, self.scaler.scale, self.steps)

    def _roll_back(
        self, plan: list[tuple[Bucket, Runs]], updated: set[int], landed: set[int], error: BaseException
    ) -> None:
        """A failed step: buckets already updated (in memory) keep their update and drop their
        grads, so a retry cannot apply them twice; the others get their step counts back (their
        grads stay, for a retry), and their weights are sent home again from the state they hold
        (revertible ones: went back to) if new ones had ``landed``. With some buckets updated,
        reads of the weights are refused until the retry (:meth:`check_whole`)."""
        for b, runs in plan:
            for s in slots_in(b, runs):
                if b.index in updated:
                    self.grads.forget(s.name)
                else:
                    self._step_of[s.name] -= 1
        self._unsent |= updated  # their new weights may not have reached home: the next step sends them
        if updated:
            self._between = f"{type(error).__name__}: {error}"
        elif self._between is None:
            self._resuming = None  # nothing changed, now or in an earlier try: the retry is a step like any other
        restore = [
            b for b, _ in plan if self.homes.state[b.index].revertible or (b.index in landed and b.index not in updated)
        ]
        if self.group.world > 1:
            # Under data parallelism the other ranks are still in this step's collectives (or stop in
            # them): no collective of this rank's may follow (the weights' resend gathers the masters,
            # which another rank's gather of its step could match), and its weights may be of two
            # steps on another rank: every read is refused; the way out is a checkpoint. The other
            # ranks are told, and stop at once (NOTE [A failed step stops every rank at once]).
            self._between = f"{type(error).__name__}: {error}"
            self.group.abort(error)
            add_note(
                error,
                f"tiermem: under data parallelism a step that failed on one rank stops every rank: "
                f"restart them and tm.load() the last checkpoint (rank {self.group.rank} of {self.group.world})",
            )
            return
        if restore:
            try:
                self._send_masters(restore)
            except TierMemError as again:  # the step's own error is the one to raise (under data parallelism
                # the others' is a collective that failed because this rank stopped mid-step)
                self._between = f"{type(error).__name__}: {error}; the new weights it had sent could not be taken back"
                add_note(
                    error,
                    f"tiermem: the new weights this step had sent could not be taken back "
                    f"({type(again).__name__}: {again})",
                )

    def _send_unsent(self) -> None:
        """The weights of buckets a failed step updated, sent home again from their master (NOTE
        [A failed step is rolled forward] in tiermem/train/homes/nvme_state.py)."""
        if not self._unsent:
            return
        for home in self.homes.weight_homes():
            home.begin_update()
        self._send_masters([b for b in self.layout.step_buckets if b.index in self._unsent])
        self._unsent.clear()

    def _send_masters(self, buckets: list[Bucket]) -> None:
        """Each bucket's weights sent home from its fp32 master as its state home holds it."""
        uploads = self.outputs.session()
        for b in buckets:
            out = uploads.target(b)
            if out is None:  # rounded from the master when read: nothing to send
                continue
            out.copy_(self.homes.state[b.index].read(b)[0])
            uploads.done(b, out, [(0, b.numel, 0)])
        uploads.finish()

    def _global_norm(self) -> torch.Tensor:
        # Per-parameter norms in a fixed parameter order, so that the rounding of the total (and
        # so the clip coefficient) never depends on how a policy grouped parameters into buckets;
        # under data parallelism each rank has the norms of its pieces, combined by the group.
        per_slot: dict[str, torch.Tensor] = {} if self.window is None else self.window.step_norms()
        for b in self.layout.step_buckets if self.window is None else ():
            mine = [s for s in b.slots if self.grads.received(s.name)]
            if not mine:
                continue
            g, free = self.homes.grads[b.index].read(b, self.grads.fill)
            try:
                for s in mine:
                    per_slot[s.name] = torch.linalg.vector_norm(g[s.offset : s.offset + s.numel], dtype=torch.float32)
            finally:
                free()
        names = [name for name in self.grads.names if self.grads.received(name)]
        if not names:
            self._norms = ([], torch.zeros(0))
            return torch.zeros((), dtype=torch.float32)
        zero = torch.zeros((), dtype=torch.float32)
        norms = self.group.norms(_on_host([per_slot.get(n, zero) for n in names]))
        self._norms = (names, norms)  # for the diagnosis of a skipped step
        return torch.linalg.vector_norm(norms)

    def _not_finite(self) -> list[str]:
        """The parameters whose gradients (of the last norm) are not finite, in parameter order."""
        names, norms = self._norms
        return [n for n, ok in zip(names, torch.isfinite(norms).tolist()) if not ok]

    def _skipped(self, norm: torch.Tensor) -> StepResult:
        """Overflow or non-finite gradients: nothing is touched. In fp16 that is the loss scale's
        business; in bf16/fp32 it is not expected (NOTE [A stalled run is loud])."""
        self.scaler.update(found_inf=True)
        self.grads.consumed()  # no second backward: a kept graph goes with the grads
        result = StepResult(True, norm.item(), self.scaler.scale, self.steps)
        if self.scaler.enabled:
            return result
        self.skipped_in_a_row += 1
        bad = self._not_finite()
        shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        log.warning(
            "tiermem: gradient norm is %s; step skipped, weights unchanged (%d in a row); not finite: %s",
            norm.item(),
            self.skipped_in_a_row,
            shown,
        )
        if self.max_skipped is not None and self.skipped_in_a_row >= self.max_skipped:
            raise TierMemError(
                f"tiermem: {self.skipped_in_a_row} steps in a row were skipped because the gradients are not "
                f"finite (in {shown}); the weights have not moved since. Lower the learning rate, check the "
                f"inputs and the loss for inf/NaN, or resume from the last checkpoint (raise "
                f"max_skipped_steps= to allow more)"
            )
        return result

    def _count_steps(self) -> None:
        """Every parameter that got a gradient (on any rank) takes one more step."""
        for name in self.grads.names:
            if self.grads.received(name):
                self._step_of[name] = self._step_of.get(name, 0) + 1

    def _runs(self, bucket: Bucket, group_of: dict[str, int]) -> list[tuple[int, int, int, int]]:
        """Contiguous ranges of parameters that got a grad and share a step count and a param
        group: (start, end, step number (1-based, including this update), group index)."""
        runs: list[tuple[int, int, int, int]] = []
        for s in bucket.slots:
            if not self.grads.received(s.name):
                continue
            step, group = self._step_of[s.name], group_of[s.name]
            if runs and runs[-1][1] == s.offset and runs[-1][2:] == (step, group):
                runs[-1] = (runs[-1][0], s.offset + s.numel, step, group)
            else:
                runs.append((s.offset, s.offset + s.numel, step, group))
        return runs

    # -- state for checkpoints --------------------------------------------------------------------
    def param_steps(self) -> dict[str, int]:
        return dict(self._step_of)

    def load_param_steps(self, steps: dict[str, int], total: int) -> None:
        self._step_of = dict(steps)
        self._resuming = None
        self._failed = self._unreported = None  # a failed background update's remains: the checkpoint replaces them
        self._between = None  # every weight comes from the checkpoint
        self.steps = int(total)


def _launch_order(homes: list[StateHome]) -> list[StateHome]:
    """NOTE [Split step]: revertible homes first (a failure there has changed nothing), then the
    homes whose Adam runs on the device (launched, not waited for), then the rest on the CPU in
    their order."""
    return sorted(homes, key=lambda h: (not h.revertible, h.compute_tier != Tier.DEVICE))


def _on_host(norms: list[torch.Tensor]) -> torch.Tensor:
    """The per-parameter norms stacked in their order, with one device-to-host sync per device
    they live on (not one per parameter)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for n in norms:
        by_device.setdefault(n.device, []).append(n)
    if len(by_device) == 1:
        return torch.stack(norms).cpu()
    host = {d: torch.stack(ns).cpu() for d, ns in by_device.items()}
    ordered, seen = [], {d: 0 for d in host}
    for n in norms:
        ordered.append(host[n.device][seen[n.device]])
        seen[n.device] += 1
    return torch.stack(ordered)


def _slots_of(b: Bucket, runs: Runs) -> list[tuple[int, Slot, int, int]]:
    """(slot index, slot, start of its run, step) of each slot that ``runs`` cover."""
    out = []
    for i, s in enumerate(b.slots):
        for a, e, step in runs:
            if a <= s.offset < e:
                out.append((i, s, a, step))
                break
    return out


def _fill_gaps(out: torch.Tensor, master: torch.Tensor, b: Bucket, runs: Runs) -> None:
    """Where Adam will not write (parameters without a grad this step), the weights as they are."""
    pos, end = 0, (b.slots[-1].offset + b.slots[-1].numel) if b.slots else 0
    for a, e, _ in runs:
        if a > pos:
            out[pos:a].copy_(master[pos:a])
        pos = e
    if pos < end:
        out[pos:end].copy_(master[pos:end])
