"""The update of one step over its buckets: each state home runs the optimizer's kernel over the
buckets whose state it keeps, and each bucket's new weights go home behind it
(:mod:`tiermem.train.homes.uploads`). What to do when the update fails is the caller's
(:mod:`tiermem.train.step.recovery`); this module only reports which buckets it updated.

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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from tiermem.config.kinds import Kind
from tiermem.observe.trace import Tracer
from tiermem.optim import StochasticRound, formats as optim_format
from tiermem.optim.formats import StateFormat
from tiermem.plan.buckets import Bucket, Slot
from tiermem.train.homes.bucket_homes import Homes
from tiermem.train.homes.state_homes import StateHome
from tiermem.train.homes.update_runs import Runs, StateViews
from tiermem.train.homes.uploads import Outputs, Uploads
from tiermem.train.step.generic_step import GenericRunner
from tiermem.types import Tier

#: the seed of bf16 master weights' stochastic rounding: the bits are a function of (this, the
#: parameter's name, its step, the element's index), so runs are reproducible and placement, bucket
#: sizes and ranks never change them (NOTE [Stochastic rounding bits] in tiermem/optim/kernels/sr.py)
SR_SEED = 0

Plan = list[tuple[Bucket, Runs]]

#: called when an update fails, before its error propagates: (the buckets it updated, which
#: cannot be undone; the buckets whose new weights had landed at home; the error)
OnFailure = Callable[[set[int], set[int], BaseException], None]


@dataclass(frozen=True)
class StepUpdate:
    """What one update needs, snapshotted when the step starts (an lr scheduler may change the
    param groups while an overlapped update runs)."""

    plan: Plan
    hyper: dict[tuple[int, int], dict]  # (bucket index, start of a run) -> its group's hyperparameters
    scale: float
    clip: float
    fill: int  # the gradient buffer this update reads (backward may fill the other one meanwhile)
    #: (bucket index, start of a run) -> the record its kernel reads, checked (NOTE [Checked once a step])
    records: dict[tuple[int, int], Any] = field(default_factory=dict)

    def with_plan(self, plan: Plan) -> StepUpdate:
        """The same update over ``plan`` (part of this one's, or in another order)."""
        return StepUpdate(plan, self.hyper, self.scale, self.clip, self.fill, self.records)

    def without(self, updated: set[int]) -> StepUpdate:
        """What is left of this update once the buckets ``updated`` have had theirs."""
        return self.with_plan([(b, runs) for b, runs in self.plan if b.index not in updated and runs])


class BucketUpdates:
    """Runs a :class:`StepUpdate` over the state homes, revertible homes first (NOTE [Split
    step]). ``fresh_weights``: the weight homes are told before each update that their cached
    device copies are about to be stale (without overlap_step; under it the next step does so
    when the update's weights land)."""

    def __init__(self, homes: Homes, outputs: Outputs, tracer: Tracer, *, fresh_weights: bool):
        self.homes, self.outputs, self.tracer, self.fresh_weights = homes, outputs, tracer, fresh_weights
        self._generic: Optional[GenericRunner] = None  # a generic optimizer's copy (NOTE [Generic optimizers])

    def run(self, upd: StepUpdate, on_failure: OnFailure) -> None:
        """Each state home runs its buckets' update. If one fails, the homes that can undo what
        they wrote do so, ``on_failure`` is told what could not be undone, and the error propagates."""
        uploads = self.outputs.session()
        if self.fresh_weights:
            self.homes.begin_update()  # cached device copies of off-device weights are about to be stale
        done: list[tuple[StateHome, object]] = []
        updated: set[int] = set()  # buckets whose update cannot be undone
        step = self._bucket_step(upd, uploads)
        try:
            for home in launch_order(self.homes.state_homes()):
                mine = [(b, runs) for b, runs in upd.plan if self.homes.state[b.index] is home]
                done.append((home, home.step(mine, step, self.tracer, updated)))
            uploads.finish()
        except BaseException as e:
            uploads.finish(quiet=True)
            for home, undo in done:
                home.revert(undo)
            on_failure(updated, uploads.landed(), e)
            raise

    def _bucket_step(self, upd: StepUpdate, uploads: Uploads) -> Callable[[Bucket, Runs, StateViews], None]:
        return lambda b, runs, state: self._adam(upd, uploads, b, runs, state)

    def _adam(self, upd: StepUpdate, uploads: Uploads, b: Bucket, runs: Runs, state: StateViews) -> None:
        """The fused update of the bucket's state format over ``runs`` of bucket ``b``, its new
        weights sent home behind it (NOTE [State formats] in tiermem/optim/formats.py)."""
        out = uploads.target(b)  # None: the weights are rounded from the master when read
        if out is not None:
            fill_gaps(out, state[0], b, runs)  # `out` holds the bucket's complete new weights
        g, free = self.homes.grads[b.index].read(b, upd.fill) if runs else (None, None)
        try:
            with self.tracer.span(f"adam {b.key}", "adam", numel=b.numel):
                if g is not None:
                    self._kernel(upd, b, runs, state, g, out)
        finally:
            if free is not None:
                free()
        uploads.done(b, out, runs)

    def _kernel(
        self, upd: StepUpdate, b: Bucket, runs: Runs, state: StateViews, g: torch.Tensor, out: Optional[torch.Tensor]
    ) -> None:
        """The state format's kernel over ``runs`` of ``b``: the optimizer's own step() for a
        generic one, one call per run where any range is a valid call, else one per parameter."""
        fmt = b.state
        if fmt.kind == Kind.GENERIC:  # the optimizer's own step() (NOTE [Generic optimizers])
            self._generic_step(upd, b, runs, state, g, out)
        elif fmt.elementwise and not fmt.stochastic_round:  # any range is a valid call: one per run
            for start, end, _ in runs:
                record = upd.records[(b.index, start)]
                piece = [t[start:end] for t in state[1:]]
                out_ = None if out is None else out[start:end]
                optim_format.update(fmt, state[0][start:end], piece, g[start:end], record, out=out_)
        else:  # blocks, factors and rounding keys start at each parameter's element 0: one call per parameter
            for i, s, start, _ in slots_of(b, runs):
                _parameter_step(upd, b, i, s, state, g[s.offset : s.offset + s.numel], out, start)

    def _generic_step(
        self, upd: StepUpdate, b: Bucket, runs: Runs, state: StateViews, g: torch.Tensor, out: Optional[torch.Tensor]
    ) -> None:
        """A generic optimizer's own step() over the parameters ``runs`` cover (NOTE [Generic
        optimizers]); their new weights copied into ``out`` when it is given."""
        if self._generic is None:  # the copy of the generic optimizer this model steps, made at its first step
            self._generic = GenericRunner(b.state)
        mine = [(i, s, upd.hyper[(b.index, start)], step) for i, s, start, step in slots_of(b, runs)]
        self._generic.step(b, mine, state, g, multiplier=upd.clip / upd.scale)
        if out is not None:  # else the weights are rounded from the master when read
            master = state[0]
            for _, s, _, _ in mine:
                out[s.offset : s.offset + s.numel].copy_(master[s.offset : s.offset + s.numel])


def _parameter_step(
    upd: StepUpdate,
    b: Bucket,
    i: int,
    s: Slot,
    state: StateViews,
    g: torch.Tensor,
    out: Optional[torch.Tensor],
    start: int,
) -> None:
    """The kernel over parameter ``s`` (slot ``i`` of ``b``) alone, its gradients ``g``."""
    fmt: StateFormat = b.state
    pieces = b.pieces(state, i)
    sr = StochasticRound.for_parameter(SR_SEED, s.name, s.first) if fmt.stochastic_round else None
    out_ = None if out is None else out[s.offset : s.offset + s.numel]
    record = upd.records[(b.index, start)]
    optim_format.update(fmt, pieces[0], pieces[1:], g, record, out=out_, stochastic_round=sr, shape=s.shape)


def checked_records(plan: Plan, hyper_at: dict[tuple[int, int], dict], scale: float, clip: float) -> dict:
    """The record each run of ``plan`` hands its kernel (NOTE [Checked once a step]): its group's
    hyperparameters (``hyper_at``, the dict of each run) made into the record of its bucket's kernel
    and checked once per group, kernel and step count, before any bucket is updated (a value set by
    hand or by an lr scheduler that the kernel's rules refuse is a ``tiermem:`` error here). A generic
    optimizer's runs have none (it reads its groups' dicts)."""
    made: dict[tuple[int, Kind, int], Any] = {}
    records: dict[tuple[int, int], Any] = {}
    for b, runs in plan:
        fmt: StateFormat = b.state
        if fmt.kind == Kind.GENERIC:
            continue
        for start, _, step in runs:
            hyper = hyper_at[(b.index, start)]
            key = (id(hyper), fmt.kind, step)
            if key not in made:
                made[key] = optim_format.hyper_record(fmt, hyper, step=step, grad_scale=scale, clip_coef=clip)
            records[(b.index, start)] = made[key]
    return records


def launch_order(homes: list[StateHome]) -> list[StateHome]:
    """NOTE [Split step]: revertible homes first (a failure there has changed nothing), then the
    homes whose Adam runs on the device (launched, not waited for), then the rest on the CPU in
    their order."""
    return sorted(homes, key=lambda h: (not h.revertible, h.compute_tier != Tier.DEVICE))


def slots_of(b: Bucket, runs: Runs) -> list[tuple[int, Slot, int, int]]:
    """(slot index, slot, start of its run, step) of each slot that ``runs`` cover."""
    out = []
    for i, s in enumerate(b.slots):
        for a, e, step in runs:
            if a <= s.offset < e:
                out.append((i, s, a, step))
                break
    return out


def fill_gaps(out: torch.Tensor, master: torch.Tensor, b: Bucket, runs: Runs) -> None:
    """Where Adam will not write (parameters without a grad this step), the weights as they are."""
    pos, end = 0, (b.slots[-1].offset + b.slots[-1].numel) if b.slots else 0
    for a, e, _ in runs:
        if a > pos:
            out[pos:a].copy_(master[pos:a])
        pos = e
    if pos < end:
        out[pos:end].copy_(master[pos:end])
