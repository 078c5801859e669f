"""The optimizer step of a TieredModel, and the torch Optimizer face it shows to lr schedulers.

During backward, :meth:`Stepper.on_grad` (a post-accumulate-grad hook) hands each parameter's
gradient to the engine, which copies it into the fp32 accumulation buffer at the GRAD tier
(converting, or adding on later micro-batches) while backward continues, and frees the device
gradient. :meth:`Stepper.run` then, for the whole model:

1. waits for the gradient copies;
2. computes the global gradient norm (per parameter, then over parameters, as
   ``clip_grad_norm_`` does), unscaled by the fp16 loss scale; a non-finite norm means overflow:
   the step is skipped and nothing is touched;
3. runs the fused Adam per bucket where the optimizer state lives, writing the new low-precision
   weights in the same pass, and uploads them to the device while Adam runs on the next bucket.

Like ``torch.optim``, a parameter that received no gradient in a step is not updated, and each
parameter keeps its own step count (bias correction).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from tiermem.errors import OutOfTierMemory, TierMemError
from tiermem.handles import Handle, wait_all, wait_all_quietly
from tiermem.train.layout import Layout, compute_tier
from tiermem.train.uploads import Uploads, slots_in
from tiermem.train.scaler import LossScaler
from tiermem.types import TensorClass, Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    skipped: bool  # True when the gradients overflowed (inf/NaN) and nothing was updated
    grad_norm: float  # global L2 norm of the (unscaled) gradients, before clipping
    loss_scale: float  # the loss scale for the next backward (1.0 unless fp16)
    step: int  # updates applied so far


class Stepper:
    """Runs the step. With ``overlap=True`` (one-step delayed update) the Adam of step k runs on
    the engine's compute thread while forward and backward of step k+1 run; backward then fills
    the second gradient buffer, and step k+1 first uploads step k's weights. A gradient is thus
    computed with weights one update older than in the plain loop."""

    def __init__(self, layout: Layout, engine, scaler: LossScaler, device_store, *,
                 grad_clip: Optional[float], tracer, overlap: bool = False):
        self.layout, self.engine, self.scaler = layout, engine, scaler
        self.device_ledger = device_store.ledger
        self.grad_clip = grad_clip
        self.tracer = tracer
        self.overlap = overlap
        from tiermem.optim import adam_step  # the fused CPU Adam; imported when a model is built
        self._adam_step = adam_step
        self.steps = 0
        self.seconds = 0.0
        self._got: set[tuple[int, int]] = set()  # (bucket, slot) that received a grad this step
        self._step_of: dict[str, int] = {}  # canonical parameter name -> updates applied to it
        self._grad_handles: list[tuple[Handle, str]] = []  # grad copies in flight, with ledger tags
        self._copy_ids = itertools.count()
        self._by_order = sorted(((b, s) for b in layout.buckets for s in b.slots), key=lambda bs: bs[1].order)
        self.param_offload = None  # set by TieredModel when some weights live off the device
        self._fill = 0  # which gradient buffer backward fills (always 0 without overlap)
        self._background: Optional[tuple[Handle, list]] = None  # overlap: the update in flight

    # -- during backward ------------------------------------------------------------------------
    def on_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: ship this parameter's grad to its bucket's GRAD tier."""
        bucket, slot = self.layout.slot_of[id(param)]
        grad = param.grad
        if grad is None:
            return
        key = (bucket.index, slot.offset)
        on_nvme = bucket.grad_tier == Tier.NVME  # NOTE [Gradients on NVMe]: they land on the host first
        acc = (self.layout.nvme_grads.landing(bucket) if on_nvme else
               self.layout.buffers[bucket.index].grad_buffer(self._fill))[slot.offset:slot.offset + slot.numel]
        tag = f"<grad in flight {slot.name} #{next(self._copy_ids)}>"  # one tag per copy: micro-batches overlap
        nbytes = grad.numel() * grad.element_size()
        try:
            self.device_ledger.reserve(tag, nbytes, TensorClass.GRAD)
        except OutOfTierMemory:  # the device budget is tight: let the grads in flight land first
            self.finish_grads()
            self.device_ledger.reserve(tag, nbytes, TensorClass.GRAD)
        try:
            h = self.engine.copy_async(acc, grad.reshape(-1), src_tier=Tier.DEVICE,
                                       dst_tier=Tier.HOST if on_nvme else bucket.grad_tier,
                                       accumulate=key in self._got, kind=TensorClass.GRAD)
        except BaseException:
            self.device_ledger.release(tag)
            raise  # the grad stays on the parameter
        h.add_done_callback(lambda _f, t=tag: self.device_ledger.release(t))
        self._grad_handles.append((h, tag))
        self._got.add(key)
        param.grad = None  # the device grad is freed once the copy has read it
        if on_nvme:
            self.layout.nvme_grads.arrived(bucket)

    def end_backward(self) -> None:
        """Backward has returned: buckets of grads on NVMe that are still open are flushed."""
        if self.layout.nvme_grads is not None:
            self.layout.nvme_grads.end_backward({b.index: b for b in self.layout.buckets})

    def finish_grads(self) -> None:
        """Wait for the gradient copies in flight; their device bytes are free afterwards."""
        if self._grad_handles:
            handles, self._grad_handles = self._grad_handles, []
            try:
                wait_all([h for h, _ in handles])
            finally:
                for _, tag in handles:  # the done-callback may not have run yet when wait returns
                    self.device_ledger.release(tag)

    def finish_pending(self) -> None:
        """Wait for every transfer this stepper started, and land a background update. If some
        grads did not arrive (a copy or a flush to NVMe failed), this step's grads are dropped
        with the error, never stepped on as a mix: the caller runs backward again."""
        nvme = self.layout.nvme_grads
        try:
            self.finish_grads()
            if nvme is not None:
                if nvme.open():  # a backward that stopped early left buckets accumulating
                    self.end_backward()
                nvme.wait()
        except BaseException:
            self.drop_grads()
            raise
        self._land_background()

    def drop_grads(self) -> None:
        """Forget this step's grads (after an error left some missing): transfers in flight
        are drained, nothing will be stepped on."""
        handles, self._grad_handles = self._grad_handles, []
        wait_all_quietly([h for h, _ in handles])
        for _, tag in handles:
            self.device_ledger.release(tag)
        self._got.clear()
        nvme = self.layout.nvme_grads
        if nvme is not None:
            with contextlib.suppress(BaseException):
                nvme.end_backward({b.index: b for b in self.layout.buckets})
            with contextlib.suppress(BaseException):
                nvme.wait()  # drain: no flush keeps writing behind the error
            nvme.end_step()

    # -- the step --------------------------------------------------------------------------------
    def run(self, groups: list[dict]) -> StepResult:
        t0 = time.perf_counter()
        with self.tracer.span("step", "compute", step=self.steps + 1):
            result = self._run(groups)
            if self.param_offload is not None:  # the iteration ends, skipped or not
                self.param_offload.end_update()
        self.seconds += time.perf_counter() - t0
        return result

    def _run(self, groups: list[dict]) -> StepResult:
        with self.tracer.span("wait grads", "stall"):
            self.finish_pending()
        grads = self._grads_at_state_tier()
        scale = self.scaler.scale
        norm = self._global_norm(grads) / scale if self.scaler.enabled else self._global_norm(grads)
        if not torch.isfinite(norm):
            self.scaler.update(found_inf=True)
            self._got.clear()
            self._grads_consumed()
            if not self.scaler.enabled:
                log.warning("tiermem: gradient norm is %s; step skipped, weights unchanged", norm.item())
            return StepResult(True, norm.item(), self.scaler.scale, self.steps)
        clip = 1.0
        if self.grad_clip is not None:
            clip = torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0).item()
        plan = [(b, self._runs(b)) for b in self.layout.buckets]
        hyper = [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay", "adamw")} for g in groups]
        if not any(runs for _, runs in plan):
            pass  # no parameter got a gradient: nothing to update (and no state to stream)
        elif self.overlap:  # snapshot taken: a scheduler may change the groups while this runs
            handle = self.engine.run_async(lambda: self._update(plan, grads, hyper, scale, clip), name="adam")
            self._background = (handle, plan)
            self._fill ^= 1  # the next backward fills the other gradient buffer
        else:
            self._update(plan, grads, hyper, scale, clip)
        self.scaler.update(found_inf=False)
        self._got.clear()
        self._grads_consumed()
        self.steps += 1
        return StepResult(False, norm.item(), self.scaler.scale, self.steps)

    def _grads_consumed(self) -> None:
        if self.layout.nvme_grads is not None:
            self.layout.nvme_grads.end_step()

    def _update(self, plan, grads, hyper, scale: float, clip: float) -> None:
        """Fused Adam per bucket; new low-precision weights go to the device (through the
        double-buffered staging, uploaded while Adam runs on the next bucket), or, with
        overlap, to ``param_out`` for the next step to upload. Buckets with state on NVMe go
        first, through the pipeline of :mod:`tiermem.train.nvme_state`: if it fails, nothing else has
        changed yet, their device weights are restored from the state on disk, per-parameter
        step counts are rolled back, and the error propagates with the grads kept for a retry."""
        uploads = Uploads(self)

        def adam(b, runs, state) -> None:
            master, exp_avg, exp_avg_sq = state
            out = uploads.target(b)
            h, g = hyper[b.group], grads[b.index]
            free = None
            if g is None and runs:  # grads on NVMe: read back for this bucket only
                g, free = self.layout.nvme_grads.read(b)
            try:
                with self.tracer.span(f"adam {b.key}", "adam", numel=b.numel):
                    for start, end, step in runs:
                        self._adam_step(master[start:end], exp_avg[start:end], exp_avg_sq[start:end],
                                        g[start:end], step=step, lr=h["lr"], beta1=h["betas"][0],
                                        beta2=h["betas"][1], eps=h["eps"], weight_decay=h["weight_decay"],
                                        adamw=h["adamw"], grad_scale=scale, clip_coef=clip, out=out[start:end],
                                        check_finite=False)
            finally:
                if free is not None:
                    free()
            uploads.done(b, out, runs)

        if self.param_offload is not None and not self.overlap:
            self.param_offload.begin_update()  # device copies of off-device weights are about to be stale
        on_nvme = [(b, runs) for b, runs in plan if b.state_tier == Tier.NVME]
        written: list[str] = []
        updated: set[int] = set()  # buckets whose state in memory was updated (cannot be undone)
        try:
            if on_nvme:
                written = self.layout.nvme_state.step(on_nvme, adam, self.tracer)
            for b, runs in plan:
                if b.state_tier != Tier.NVME:
                    buf = self.layout.buffers[b.index]
                    adam(b, runs, (buf.master, buf.exp_avg, buf.exp_avg_sq))
                    updated.add(b.index)
            uploads.finish()
        except BaseException:
            uploads.finish(quiet=True)
            if on_nvme:
                self.layout.nvme_state.revert(written)
            self._roll_back([b for b, _ in on_nvme], plan, updated)
            raise

    def _roll_back(self, nvme_buckets, plan, updated: set[int]) -> None:
        """A failed step: buckets left as they were get their step counts back (their grads stay,
        for a retry); buckets already updated in memory keep theirs and drop their grads, so a
        retry cannot apply them twice; NVMe buckets' weights are restored from the reverted state."""
        for b, runs in plan:
            for s in slots_in(b, runs):
                if b.index in updated:
                    self._got.discard((b.index, s.offset))
                else:
                    self._step_of[s.name] -= 1
        if not nvme_buckets:
            return
        uploads = Uploads(self)

        def restore(b, master) -> None:
            out = uploads.target(b)
            out.copy_(master)
            uploads.done(b, out, [(0, b.numel, 0)])
        self.layout.nvme_state.restore_params(nvme_buckets, restore)
        uploads.finish()

    def _upload(self, b, src: torch.Tensor, runs) -> list[Handle]:
        """New weights to their home: the device buffer (async), or, for weights homed off the
        device, their home tier (NOTE [Parameters off the device])."""
        if b.param_tier != Tier.DEVICE:  # overlaps Adam on the next bucket, like an upload
            return [self.param_offload.write_home(s.name, src[s.offset:s.offset + s.numel].view(s.shape), wait=False)
                    for s in slots_in(b, runs)]
        param = self.layout.buffers[b.index].param
        return [self.engine.copy_async(param[a:e], src[a:e], src_tier=compute_tier(b), dst_tier=Tier.DEVICE,
                                       kind=TensorClass.PARAM)
                for a, e, _ in runs]

    def _land_background(self) -> None:
        """overlap: wait for the update in flight, then upload the weights it produced."""
        if self._background is None:
            return
        handle, plan = self._background
        self._background = None
        with self.tracer.span("wait background adam", "stall"):
            handle.wait()
        if self.param_offload is not None:
            self.param_offload.begin_update()
        wait_all([h for b, runs in plan for h in self._upload(b, self.layout.buffers[b.index].param_out, runs)])

    def _grads_at_state_tier(self) -> dict[int, torch.Tensor]:
        """Each bucket's grads where its optimizer state lives (copied there if they are not)."""
        grads, copies = {}, []
        for b in self.layout.buckets:
            buf = self.layout.buffers[b.index]
            if b.grad_tier == Tier.NVME:
                grads[b.index] = None  # read back when needed: NOTE [Gradients on NVMe]
                continue
            acc = buf.grad_buffer(self._fill)
            if buf.grad_in is None:
                grads[b.index] = acc
            else:
                copies.append(self.engine.copy_async(buf.grad_in, acc, src_tier=b.grad_tier, kind=TensorClass.GRAD,
                                                     dst_tier=compute_tier(b)))
                grads[b.index] = buf.grad_in
        wait_all(copies)
        return grads

    def _global_norm(self, grads: dict[int, torch.Tensor]) -> torch.Tensor:
        # Per-parameter norms in a fixed parameter order, so that the rounding of the total (and
        # so the clip coefficient) never depends on how a policy grouped parameters into buckets.
        per_slot = {}
        for b in self.layout.buckets:
            g, free = grads[b.index], None
            if g is None:
                if not any((b.index, s.offset) in self._got for s in b.slots):
                    continue
                g, free = self.layout.nvme_grads.read(b)
            try:
                for s in b.slots:
                    if (b.index, s.offset) in self._got:
                        per_slot[(b.index, s.offset)] = torch.linalg.vector_norm(
                            g[s.offset:s.offset + s.numel], dtype=torch.float32)
            finally:
                if free is not None:
                    free()
        norms = [per_slot[(b.index, s.offset)] for b, s in self._by_order if (b.index, s.offset) in per_slot]
        if not norms:
            return torch.zeros((), dtype=torch.float32)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for n in norms:  # one device-to-host sync per device, not per parameter
            by_device.setdefault(n.device, []).append(n)
        if len(by_device) == 1:
            return torch.linalg.vector_norm(torch.stack(norms)).cpu()
        host = {d: torch.stack(ns).cpu() for d, ns in by_device.items()}
        ordered, seen = [], {d: 0 for d in host}
        for n in norms:
            ordered.append(host[n.device][seen[n.device]])
            seen[n.device] += 1
        return torch.linalg.vector_norm(torch.stack(ordered))

    def _runs(self, bucket) -> list[tuple[int, int, int]]:
        """Contiguous ranges of parameters that got a grad and share a step count, with the step
        number (1-based, including this update) to use; bumps each parameter's count."""
        runs: list[tuple[int, int, int]] = []
        for s in bucket.slots:
            if (bucket.index, s.offset) not in self._got:
                continue
            step = self._step_of.get(s.name, 0) + 1
            self._step_of[s.name] = step
            if runs and runs[-1][1] == s.offset and runs[-1][2] == step:
                runs[-1] = (runs[-1][0], s.offset + s.numel, step)
            else:
                runs.append((s.offset, s.offset + s.numel, step))
        return runs

    # -- state for checkpoints --------------------------------------------------------------------
    def param_steps(self) -> dict[str, int]:
        return dict(self._step_of)

    def load_param_steps(self, steps: dict[str, int], total: int) -> None:
        self._step_of = dict(steps)
        self.steps = int(total)


class TieredOptimizer(torch.optim.Optimizer):
    """What ``tm.optimizer`` is: a torch Optimizer whose param groups (fp32 master weights and
    hyperparameters) lr schedulers can drive. ``step()`` runs the tiered step; gradients are
    cleared by it, so ``zero_grad()`` has nothing to do. Checkpoint with ``tm.save()``."""

    def __init__(self, layout: Layout, spec, stepper: Stepper):
        def master(b, s) -> torch.Tensor:  # state on NVMe has no resident master: a meta placeholder
            m = layout.buffers[b.index].master
            return torch.empty(s.shape, device="meta") if m is None else m[s.offset:s.offset + s.numel].view(s.shape)
        masters = {s.name: master(b, s) for b in layout.buckets for s in b.slots}
        if not masters:
            raise TierMemError("tiermem: the module has no trainable parameters (requires_grad=True); "
                               "unfreeze some before wrapping it")
        groups = []
        for i, names in enumerate(layout.groups):
            g = {"params": [masters[n] for n in names], "param_names": list(names), **spec.group_defaults()}
            if i == 1:
                g["weight_decay"] = 0.0  # the no_decay group
            groups.append(g)
        super().__init__(groups, spec.group_defaults())
        self._stepper = stepper

    def step(self, closure=None) -> StepResult:  # type: ignore[override]
        if closure is not None:
            raise TierMemError("tiermem: step(closure) is not supported; call tm.backward(loss) then tm.step()")
        return self._stepper.run(self.param_groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: tm.step() clears the gradients it consumed."""

    def state_dict(self):  # type: ignore[override]
        raise TierMemError("tiermem: tm.optimizer holds no checkpointable state of its own; use "
                           "tm.save(path) and tm.load(path), which include the optimizer state")

    def load_state_dict(self, state_dict) -> None:  # type: ignore[override]
        self.state_dict()
