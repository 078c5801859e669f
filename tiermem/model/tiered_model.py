"""TieredModel: wrap any ``nn.Module`` and train it with ``tm(x)``, ``tm.backward(loss)``, ``tm.step()``.

The composition root: construction plans (:func:`tiermem.plan.model_plan.plan_model`: where every
tensor lives and the bytes each tier needs, nothing allocated; NOTE [Plan, then build]), then
builds from the plan (:mod:`tiermem.model.build`: the stores, the engine, one home per class and
tier, NOTE [Homes]) and hands each collaborator what it needs, already wired; the model takes them
and owns their lifetime. The calls that read or replace its state are
:mod:`tiermem.model.state_calls`', those that mirror the module's :mod:`tiermem.model.module_calls`',
and the conveniences (``phase``, ``resident``, ``report``) :mod:`tiermem.model.model_views`'. This
module is construction and the three calls of a step. Gradients leave the device bucket by bucket
while backward is still running (:mod:`tiermem.train.step.grads`); ``step()`` is :mod:`tiermem.train.step.stepper`'s.
Every public call is checked against the step's phase in one place (NOTE [Step lifecycle]).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from typing import Any, Iterator, Optional

import torch

from tiermem.config.budgets import Budgets
from tiermem.config.specs import LossScale, _Spec
from tiermem.errors import ConfigError, add_note, checked_arguments
from tiermem.memory import deferred
from tiermem.model import lifetime
from tiermem.model.build import Parts, build_parts
from tiermem.model.compute import warn_if_slow
from tiermem.model.inference import Inference, building, refuse
from tiermem.model.inputs import cast_inputs, check_loss
from tiermem.model.model_views import ModelViews
from tiermem.model.module_calls import ModuleCalls
from tiermem.model.options import DEFAULT_OPTIMIZER, Options, validate
from tiermem.model.phase import Lifecycle, Phase
from tiermem.model.state_calls import StateCalls
from tiermem.plan.policy import Policy
from tiermem.train.step.stepper import StepResult
from tiermem.train.weights.materialize import values_for

log = logging.getLogger(__name__)

__all__ = ["TieredModel", "StepResult", "Phase"]


@checked_arguments
class TieredModel(StateCalls, ModuleCalls, ModelViews):
    """Train ``module`` with every tensor of its step placed on a tier by ``policy``.

    The three calls of a training loop are ``tm(*inputs)`` (the module's forward; tensors inside any
    container move to the device and floating ones are cast to the working precision),
    ``tm.backward(loss)`` (once per micro-batch; gradients accumulate at their home) and
    ``tm.step()`` (update from the accumulated gradients, then clear them). ``tm.optimizer`` has
    ``param_groups``, so ``torch.optim.lr_scheduler`` drives it; ``tm.phase`` tells where in the step
    the model is (NOTE [Step lifecycle]). Construction checks that the working set fits the budgets
    and refuses, with the bytes each tier needs, one that does not. Under ``torch.distributed``,
    gradients and optimizer state are sharded over the ranks (NOTE [Data parallel]).

    Args:
        module: any ``torch.nn.Module`` with trainable parameters (``requires_grad=True``; with
            ``optimizer=None``, any parameters: NOTE [Inference only]); it is
            wrapped by one live TieredModel at a time. ``requires_grad`` may change between steps
            (NOTE [Freezing and unfreezing] in :mod:`tiermem.train.step.trainable`).
        policy: the :class:`~tiermem.Policy` that gives each tensor its home tier. Default:
            :class:`~tiermem.policies.ZeroOffload` (weights and activations on the device, grads and
            optimizer state on the host).
        optimizer: a tiermem spec (:class:`~tiermem.AdamW`, :class:`~tiermem.Adam`; param groups
            optional), or a ``torch.optim.AdamW``/``Adam`` built on the module's parameters, which is
            read for its class, param groups and hyperparameters and never stepped itself
            (:mod:`tiermem.config.torch_optim`). Default: ``tiermem.AdamW()``. ``None``: inference
            only, no grads, master weights or optimizer state (NOTE [Inference only]).
        precision: the working precision of the weights the device holds: ``"bf16"``, ``"fp16"``
            (dynamic loss scaling: an overflowing step is skipped and the scale lowered),
            ``"fp32"``, or ``"auto"``: bf16 where the device computes it natively, else fp32 on a
            CPU and fp16 on an older GPU (NOTE [Choosing the precision] in tiermem/config/precision.py);
            ``tm.precision`` is the one in use. bf16 or fp16 on a CPU much slower at them than at
            fp32 logs one warning. fp32 master weights always live with the optimizer state.
        budgets: caps on the bytes tiermem manages per tier (:class:`~tiermem.Budgets`). Default:
            the device's free memory less a margin, the available RAM, the free disk space.
        nvme_dir: the directory NVMe tensors go to; needed when the policy places anything on
            ``Tier.NVME``. The run owns it (a lock) until it is detached or dropped; under data
            parallelism each rank uses ``nvme_dir/rank<r>``.
        grad_clip: clip the global L2 norm of the gradients to this (as
            ``torch.nn.utils.clip_grad_norm_``); a finite number > 0, or None for no clipping.
        device: where the working weights and the forward run: ``"cpu"``, ``"cuda"``, ``"cuda:N"``
            or a ``torch.device``. Default: the current CUDA device when one is available, else the
            CPU.
        bucket_size: fp32 gradient bytes per bucket, an int or a string such as ``"32MiB"``.
            Smaller buckets start transfers earlier; larger ones make fewer, bigger copies.
        overlap_step: run each step's CPU update in the background while the next forward and
            backward run (the one-step delayed update of ZeRO-Offload), so they see weights one update
            old; the update lands at the next ``step()``. Costs a second fp32 gradient buffer and a
            host copy of the working weights (+6 B/param). An update that fails in the background
            raises from that later call, and its gradients cannot be retried.
        trace_path: write a Chrome trace (open it in Perfetto) of compute, transfers and optimizer
            steps to this file; its directory must exist.
        prefetch: fetch weights homed off the device ahead of use, along the order the first step
            recorded (default). ``False`` fetches each only when its module runs (for comparison).
        process_group: under data parallelism, the ``torch.distributed`` group to shard over.
            Default (None): the default group when ``torch.distributed`` is initialized, else one
            process. ``False``: a full replica in each process (no collectives).
        max_skipped_steps: in bf16 and fp32, this many steps skipped in a row for non-finite
            gradients raise a :class:`~tiermem.TierMemError` naming the parameters (NOTE [A stalled
            run is loud]); None never stops.
        loss_scale: fp16's dynamic loss scaling (a :class:`~tiermem.LossScale`); fp16 only. Default:
            ``torch.amp.GradScaler``'s initial scale, growth interval and factors.
        shard_weights: under data parallelism, shard the weights on the device over the ranks too,
            each rank keeping 1/N and gathering a bucket while it is read (ZeRO-3; weights off the
            device always are: NOTE [Weights sharded over the ranks]). In one process it changes
            nothing.
        weights: a checkpoint to take the weights from, read one tensor at a time straight into their
            homes (NOTE [Models on the meta device]): a Hugging Face checkpoint directory
            (``model.safetensors`` or shards with ``model.safetensors.index.json``), one
            ``.safetensors`` file or a torch state-dict file. Its names, shapes and dtypes are checked
            against the module before anything is built. The module may be on the meta device (built
            under ``torch.device("meta")``); without ``weights``, such a module's parameters are
            initialized by its own modules' initialization, one module at a time.
        update_in_backward: keep no gradient at rest (NOTE [Updates in backward] in
            tiermem/train/step/in_backward.py): ``tm.backward(loss)`` takes the gradients' norms and keeps
            the graph, ``tm.step()`` runs backward again and updates each bucket as soon as its
            gradients land. The same bits as the default step, for one more backward per step and a
            few buckets of host memory instead of 4 B/param of grads. Micro-batches before a step's
            last accumulate in the whole GRAD home (4 B/param, made when a step first accumulates):
            a second ``tm.backward()`` first runs the previous one's backward again into it (its
            graph, and so its activations, lived until then), one inside ``tm.no_sync()`` lands
            there in one pass. One process; optimizer state on the host or NVMe.

    Raises:
        ConfigError: an argument is wrong (the message names it and says what to pass).
        OutOfTierMemory: the working set does not fit the budgets (the bytes each tier needs).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        policy: Optional[Policy] = None,
        *,
        optimizer: "_Spec | torch.optim.Optimizer | None" = DEFAULT_OPTIMIZER,
        precision: str = "bf16",
        budgets: Optional[Budgets] = None,
        nvme_dir: Optional[str] = None,
        grad_clip: Optional[float] = None,
        device: torch.device | str | None = None,
        bucket_size: int | str = "32MiB",
        overlap_step: bool = False,
        trace_path: Optional[str] = None,
        prefetch: bool = True,
        process_group: Any = None,
        max_skipped_steps: Optional[int] = 10,
        loss_scale: Optional[LossScale] = None,
        shard_weights: bool = False,
        weights: "str | os.PathLike[str] | None" = None,
        update_in_backward: bool = False,
    ):
        opts = validate(
            module,
            optimizer=optimizer,
            precision=precision,
            budgets=budgets,
            grad_clip=grad_clip,
            device=device,
            bucket_size=bucket_size,
            overlap_step=overlap_step,
            nvme_dir=nvme_dir,
            trace_path=trace_path,
            prefetch=prefetch,
            max_skipped_steps=max_skipped_steps,
            loss_scale=loss_scale,
            shard_weights=shard_weights,
            update_in_backward=update_in_backward,
        )
        self._adopt(module, opts)
        with building(self._inference, opts.dtype):
            parts = self._built(
                module,
                policy,
                opts,
                weights,
                nvme_dir=nvme_dir,
                trace_path=trace_path,
                process_group=process_group,
                max_skipped_steps=max_skipped_steps,
                loss_scale=loss_scale,
            )
            self._take(parts)
            self._own(module, parts)
        self._compute_seconds = 0.0  # in training tm(...) and tm.backward(...): forward+backward, for report()
        trains = f"{self.layout.n_params:,} trainable parameters in {len(self.layout.buckets)} buckets"
        asked = f", from precision={precision!r}" if precision != self.precision else ""  # "auto" made this device's
        what = "inference only" if self._inference else trains
        log.info("tiermem: %s under %r (%s%s)", what, self.policy, self.precision, asked)

    def _adopt(self, module: torch.nn.Module, opts: Options) -> None:
        """Before anything is built: models dropped earlier given back, ``module`` owned by none, the
        options the model shows as its own."""
        deferred.start()  # the worker that gives back dropped models (NOTE [Finalizers only enqueue])
        deferred.settle()  # what models dropped before this one held is back (their hooks are off the module)
        lifetime.check_unowned(module)  # NOTE [A dropped model lets go]: one live TieredModel a module
        self.module, self.precision, self.dtype, self.device = module, opts.precision, opts.dtype, opts.device
        warn_if_slow(opts.precision, opts.device)  # one warning, from the profile's matmul figures
        self.grad_clip, self.overlap_step = opts.grad_clip, opts.overlap
        self.update_in_backward = opts.update_in_backward
        self._life = Lifecycle()
        self._inference = Inference(module) if opts.inference else None  # NOTE [Inference only]

    def _built(self, module: torch.nn.Module, policy: Optional[Policy], opts: Any, weights: Any, **kw: Any) -> Parts:
        """Every collaborator, planned then built and wired (:mod:`tiermem.model.build`); none refers
        back to self. ``weights``' headers are checked whole before anything is built."""
        if weights is not None and not isinstance(weights, (str, os.PathLike)):
            raise ConfigError(f"tiermem: weights={weights!r} is not a path; pass a checkpoint's file or directory")
        values = values_for(module, None if weights is None else os.fspath(weights))  # reads no tensor
        try:
            return build_parts(module, policy, opts, step=self._step, add_group=self._add_group, values=values, **kw)
        finally:
            values.close()

    def _take(self, parts: Parts) -> None:
        """The collaborators, as the model's own attributes."""
        #: every decision of the construction, taken before anything was built (NOTE [Plan, then build])
        self.model_plan = parts.plan
        self.policy, self.placement, self._evaluator = parts.policy, parts.placement, parts.evaluator
        self.tracer, self.group, self.stores, self.engine = parts.tracer, parts.group, parts.stores, parts.engine
        self.hooks, self.param_offload, self.gathered = parts.hooks, parts.param_offload, parts.gathered
        self._force_eager = parts.force_eager
        self.layout, self.scaler, self.grads, self.stepper = parts.layout, parts.scaler, parts.grads, parts.stepper
        self._passes = parts.passes  # NOTE [Updates in backward]: None unless update_in_backward
        self.optimizer, self._groups = parts.optimizer, parts.group_editor  # inference: no group, step refused
        #: the tiermem optimizer spec this model runs (a torch optimizer given is read into one); None:
        #: inference only (NOTE [Inference only])
        self.optimizer_spec: Optional[_Spec] = None if self._inference else parts.optimizer_spec
        self._trainable, self.activations, self._state = parts.trainable, parts.activations, parts.state

    def _own(self, module: torch.nn.Module, parts: Parts) -> None:
        """Take ownership of ``module`` and of what was built for it."""
        with lifetime.undone_on_failure(parts, module):  # a failed construction leaves nothing held
            # NOTE [A dropped model lets go]: nothing built refers back to self, so a model nobody
            # references is collected; this gives back what it held (and is detach()'s last part)
            self._release = weakref.finalize(
                self, lifetime.dropped, self.hooks, self.engine, self.stores, self.tracer, self.stepper, os.getpid()
            )
            self._release.atexit = False  # the process's end frees it all; no I/O on the way out
            lifetime.claim(module, self)
            for source in self.weight_sources():
                source.settle()  # the module's original tensors of off-device weights go

    # -- the three calls ------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward on ``args``/``kwargs``, with tensors moved to the device and floating
        ones cast to the working precision inside any container (NamedTuples, dataclasses, any
        ``Mapping``). In train mode with grad enabled, its activations are placed by the policy."""
        if not (torch.is_grad_enabled() and self.module.training):
            return self._forward(args, kwargs)  # not a training forward: no part of a step's time
        t0 = time.perf_counter()
        try:
            return self._forward(args, kwargs)
        finally:
            self._compute_seconds += time.perf_counter() - t0

    def _forward(self, args: tuple, kwargs: dict) -> Any:
        with self._life.during("forward", Phase.FORWARD):
            self._check_forward("tm(...)")
            if torch.is_grad_enabled() and self.module.training and self.group.world == 1 and not self._inference:
                # NOTE [Freezing and unfreezing]; under data parallelism at backward, where every rank is
                self._trainable.sync(grads_waiting=self.grads.has_grads(), collective=False)
            args, kwargs = cast_inputs((args, kwargs), self.dtype, self.device)
            with self.tracer.span("forward", "compute"), _eagerly(self._force_eager):
                if torch.is_grad_enabled() and self.module.training:
                    with self.activations.track():
                        return self.module(*args, **kwargs)
                return self.module(*args, **kwargs)  # eval() or no_grad: activations stay where they are

    def _check_forward(self, call: str) -> None:
        """What every forward checks first, named ``call`` in its errors."""
        self.stepper.check_whole(call)  # NOTE [A failed step is rolled forward]
        self._state.check_loaded(call)  # NOTE [A failed load is guarded]
        self._trainable.check_unchanged(call)  # NOTE [The parameters a model was wrapped with]

    @contextlib.contextmanager
    def _generating(self) -> Iterator[None]:
        """What ``tm.generate(...)`` runs inside (NOTE [Inference only]): a forward's phase and checks."""
        with self._life.during("forward", Phase.FORWARD):
            self._check_forward("tm.generate(...)")
            with self.tracer.span("generate", "compute"), _eagerly(self._force_eager):
                yield

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (scaled in fp16); call once per micro-batch, grads accumulate.

        Each bucket's gradients leave the device for their home as soon as backward produced them
        (under ``update_in_backward``, a window of them: NOTE [Updates in backward]).
        If it raises after some of its gradients arrived, this step's grads (earlier micro-batches
        too) are dropped: run the step's forward and backward again. If it raises before any did
        (e.g. a second backward through the same graph), nothing changed: earlier micro-batches'
        grads are kept, and the error says so.

        Args:
            loss: a scalar tensor computed from ``tm(...)`` in train mode, outside ``torch.no_grad()``.
        """
        t0 = time.perf_counter()
        try:
            self._backward(loss)
        finally:
            self._compute_seconds += time.perf_counter() - t0

    def _backward(self, loss: torch.Tensor) -> None:
        if self._inference:
            raise refuse("tm.backward()")
        self._life.check("backward")
        check_loss(loss)
        self._trainable.sync(grads_waiting=self.grads.has_grads(), collective=True)  # NOTE [Freezing and unfreezing]
        if self._passes is not None:
            self._passes.prepare()  # the accumulation homes, if it accumulates: refused before anything changes
        with self._life.during("backward", Phase.BACKWARD):  # raising before any grad: back to the phase before
            try:
                if self._passes is not None and self._passes.kept:  # the step's last backward so far was not its last
                    self._replay()
                self._backward_pass(loss)
            finally:
                self.activations.release()
            self._life.to(Phase.GRADS_READY)

    def _replay(self) -> None:
        """Under update_in_backward, the kept graph's backward again into the accumulation homes
        (NOTE [Updates in backward]); if it fails, the step's grads are dropped."""
        assert self._passes is not None
        try:
            with self.tracer.span("backward again", "compute"):
                self._passes.replay()
        except BaseException as e:
            self._dropped(e)
            raise

    def _backward_pass(self, loss: torch.Tensor) -> None:
        """This backward's own pass; a failure drops the step's grads once any of its own arrived."""
        arrived_before = self.grads.arrivals
        try:
            scaled = loss.float() * self.scaler.scale if self.scaler.enabled else loss
            with self.tracer.span("backward", "compute"):
                if self._passes is not None:
                    self._passes.backward(scaled)  # NOTE [Updates in backward]
                else:
                    scaled.backward()
                    self.grads.end_backward()
        except BaseException as e:
            if self.grads.arrivals == arrived_before:  # nothing of this backward reached tiermem
                add_note(
                    e,
                    "tiermem: no gradient of this backward had arrived: the step's earlier gradients "
                    "are kept; run forward again to get a new graph before calling backward",
                )
                raise
            self._dropped(e)
            raise

    def _dropped(self, error: BaseException) -> None:
        """A backward stopped part way: the step's grads are dropped, never stepped on as a mix."""
        self.grads.drop()
        self._life.to(Phase.IDLE)
        add_note(
            error,
            "tiermem: this backward stopped part way: the step's gradients (earlier micro-batches "
            "too) were dropped; run the step's forward and backward again",
        )

    def step(self) -> StepResult:
        """Update the weights from the accumulated grads, then clear them.

        Waits for the gradients, unscales them (fp16), takes the global norm, clips, runs the
        optimizer where its state lives and sends the new working weights home. Non-finite
        gradients skip the step (nothing changes). A step that fails on I/O is completed by calling
        ``step()`` again (NOTE [A failed step is rolled forward]). Same as ``tm.optimizer.step()``.

        Returns:
            A :class:`StepResult`: ``skipped``, ``grad_norm`` (before clipping), ``loss_scale``
            (for the next backward) and ``step`` (updates applied so far).
        """
        result = self.optimizer.step()
        self.tracer.maybe_write()  # throttled: a full rewrite of a growing file; always at detach()
        return result

    def _add_group(self, groups: list[dict], group: dict) -> None:
        """What ``tm.optimizer.add_param_group(group)`` runs (tiermem.train.step.groups.GroupEditor)."""
        if self._inference:
            raise refuse("tm.optimizer.add_param_group()")
        self._life.check("state", "tm.optimizer.add_param_group()")
        self._groups.add(groups, group)

    def _step(self, groups: list[dict]) -> StepResult:
        """What ``tm.optimizer.step()`` runs: the tiered step, checked against the phase."""
        if self._inference:
            raise refuse("tm.step()")
        with self._life.during("step", Phase.STEPPING):
            self._state.check_loaded("tm.step()")  # NOTE [A failed load is guarded]
            self._trainable.check_unchanged("step()")  # NOTE [The parameters a model was wrapped with]
            try:
                result = self.stepper.run(groups)
            except BaseException:
                self._life.to(Phase.GRADS_READY if self.grads.has_grads() else Phase.IDLE)
                raise
            self._life.to(Phase.IDLE)
        return result

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Under data parallelism, backward inside this block accumulates gradients on this rank
        without communicating (as ``DistributedDataParallel.no_sync``); the next backward outside
        it (or the step) sends the sum once. Under ``update_in_backward`` a backward inside it is
        known not to be the step's last: it accumulates in one pass and keeps no graph (NOTE
        [Updates in backward]). Otherwise, in one process, it changes nothing."""
        self._life.check("backward")
        homes = self.layout.homes.grad_homes()
        for home in homes:
            home.defer(True)
        try:
            yield
        finally:
            for home in homes:
                home.defer(False)


def _eagerly(on: bool) -> contextlib.AbstractContextManager:
    """Compiled code runs eagerly inside (``torch.compiler.set_stance``, torch 2.6+; before it,
    dynamo finds the eager hooks and falls back by itself, after trying to trace)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if on and set_stance is not None else contextlib.nullcontext()
