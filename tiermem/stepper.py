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

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from tiermem.errors import TierMemError
from tiermem.handles import Handle, wait_all
from tiermem.layout import Layout
from tiermem.scaler import LossScaler
from tiermem.types import TensorClass, Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    skipped: bool  # True when the gradients overflowed (inf/NaN) and nothing was updated
    grad_norm: float  # global L2 norm of the (unscaled) gradients, before clipping
    loss_scale: float  # the loss scale for the next backward (1.0 unless fp16)
    step: int  # updates applied so far


class Stepper:
    def __init__(self, layout: Layout, engine, scaler: LossScaler, device_store, *,
                 grad_clip: Optional[float], tracer, background: bool = False):
        self.layout, self.engine, self.scaler = layout, engine, scaler
        self.device_ledger = device_store.ledger
        self.grad_clip = grad_clip
        self.tracer = tracer
        from tiermem.optim import adam_step  # the fused CPU Adam; imported when a model is built
        self._adam_step = adam_step
        self.steps = 0
        self.seconds = 0.0
        self._got: set[tuple[int, int]] = set()  # (bucket, slot) that received a grad this step
        self._step_of: dict[str, int] = {}  # canonical parameter name -> updates applied to it
        self._grad_handles: list[Handle] = []

    # -- during backward ------------------------------------------------------------------------
    def on_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: ship this parameter's grad to its bucket's GRAD tier."""
        bucket, slot = self.layout.slot_of[id(param)]
        grad, param.grad = param.grad, None  # the device grad is freed once the copy has read it
        if grad is None:
            return
        acc = self.layout.buffers[bucket.index].grad[slot.offset:slot.offset + slot.numel]
        first = (bucket.index, slot.offset) not in self._got
        self._got.add((bucket.index, slot.offset))
        tag = f"<grad in flight {slot.name}>"
        self.device_ledger.reserve(tag, grad.numel() * grad.element_size(), TensorClass.GRAD)
        h = self.engine.copy_async(acc, grad.reshape(-1), src_tier=Tier.DEVICE, dst_tier=bucket.grad_tier,
                                   accumulate=not first)
        h.add_done_callback(lambda _f, t=tag: self.device_ledger.release(t))
        self._grad_handles.append(h)

    def finish_pending(self) -> None:
        """Wait for every transfer this stepper started (grad copies of an unfinished step)."""
        if self._grad_handles:
            wait_all(self._grad_handles)
            self._grad_handles.clear()

    def before_forward(self) -> None:
        pass

    # -- the step --------------------------------------------------------------------------------
    def run(self, groups: list[dict]) -> StepResult:
        t0 = time.perf_counter()
        with self.tracer.span("step", "compute", step=self.steps + 1):
            result = self._run(groups)
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
            if not self.scaler.enabled:
                log.warning("tiermem: gradient norm is %s; step skipped, weights unchanged", norm.item())
            return StepResult(True, norm.item(), self.scaler.scale, self.steps)
        clip = 1.0
        if self.grad_clip is not None:
            clip = torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0).item()
        uploads: dict[tuple[Tier, int], list[Handle]] = {}  # staging buffer -> its uploads in flight
        turn = 0
        for b in self.layout.buckets:
            buf = self.layout.buffers[b.index]
            g = grads[b.index]
            runs = self._runs(b)
            if b.state_tier == Tier.DEVICE:
                out, staging = buf.param, None
            else:
                staging, turn = (b.state_tier, turn % 2), turn + 1
                with self.tracer.span("wait staging", "stall"):
                    wait_all(uploads.pop(staging, ()))  # ordering: its last upload has left the buffer
                out = self.layout.staging[b.state_tier][staging[1]]
            group = groups[b.group]
            beta1, beta2 = group["betas"]
            with self.tracer.span(f"adam {b.key}", "adam", numel=b.numel):
                for start, end, step in runs:
                    self._adam_step(buf.master[start:end], buf.exp_avg[start:end], buf.exp_avg_sq[start:end],
                              g[start:end], step=step, lr=group["lr"], beta1=beta1, beta2=beta2,
                              eps=group["eps"], weight_decay=group["weight_decay"], adamw=group["adamw"],
                              grad_scale=scale, clip_coef=clip, out=out[start:end], check_finite=False)
            if staging is not None:  # upload while Adam runs on the next bucket
                uploads[staging] = [self.engine.copy_async(buf.param[a:e], out[a:e], src_tier=b.state_tier,
                                                           dst_tier=Tier.DEVICE) for a, e, _ in runs]
        with self.tracer.span("wait uploads", "stall"):
            wait_all([h for hs in uploads.values() for h in hs])
        self.scaler.update(found_inf=False)
        self._got.clear()
        self.steps += 1
        return StepResult(False, norm.item(), self.scaler.scale, self.steps)

    def _grads_at_state_tier(self) -> dict[int, torch.Tensor]:
        """Each bucket's grads where its optimizer state lives (copied there if they are not)."""
        grads, copies = {}, []
        for b in self.layout.buckets:
            buf = self.layout.buffers[b.index]
            if buf.grad_in is None:
                grads[b.index] = buf.grad
            else:
                copies.append(self.engine.copy_async(buf.grad_in, buf.grad, src_tier=b.grad_tier,
                                                     dst_tier=b.state_tier))
                grads[b.index] = buf.grad_in
        wait_all(copies)
        return grads

    def _global_norm(self, grads: dict[int, torch.Tensor]) -> torch.Tensor:
        norms = [torch.linalg.vector_norm(grads[b.index][s.offset:s.offset + s.numel], dtype=torch.float32).cpu()
                 for b in self.layout.buckets for s in b.slots if (b.index, s.offset) in self._got]
        if not norms:
            return torch.zeros((), dtype=torch.float32)
        return torch.linalg.vector_norm(torch.stack(norms))

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
        masters = {s.name: layout.buffers[b.index].master[s.offset:s.offset + s.numel].view(s.shape)
                   for b in layout.buckets for s in b.slots}
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
