"""TieredModel's construction: from validated arguments (:mod:`tiermem.model.options`) to every
collaborator of a training step, wired.

It plans first and whole (:func:`tiermem.plan.model_plan.plan_model`, NOTE [Plan, then build]),
checks the plan's bytes fit the stores it makes, then builds the engine and one home per class and
tier (NOTE [Homes]), the layout over them, the gradient collector, the stepper, the optimizer the user
sees and the state the checkpoint reads, and hands each collaborator what it needs. Nothing it
builds refers back to the model (NOTE [A dropped model lets go]): the model's own step and
add-group calls come in as callables, which the optimizer holds weakly.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

import torch

from tiermem.checkpoint.view import ModelState, StateCore
from tiermem.config.specs import LossScale, _Spec
from tiermem.config.torch_optim import stepped_elsewhere
from tiermem.memory.ledger import InFlight
from tiermem.model import lifetime
from tiermem.model.inference import end_each_forward, fold_linear_inputs
from tiermem.model.machine import machine_profile, store_limits
from tiermem.model.options import Options, make_stores
from tiermem.model.torch_optimizer import TieredOptimizer
from tiermem.observe.trace import Tracer
from tiermem.plan.choose import Evaluator
from tiermem.plan.footprint import check_fits
from tiermem.plan.model_plan import ModelPlan, plan_model
from tiermem.plan.policy import Policy
from tiermem.train.activations import ActivationOffloader
from tiermem.train.homes.uploads import Outputs
from tiermem.train.hooks import HookSet
from tiermem.train.layout import Layout, accumulation_homes, build, make_homes
from tiermem.train.step.grads import GradCollector
from tiermem.train.step.groups import Fp32Values, GroupEditor, group_dicts
from tiermem.train.step.in_backward import WindowGrads
from tiermem.train.step.in_backward_passes import Passes
from tiermem.train.step.scaler import LossScaler
from tiermem.train.step.stepper import Stepper
from tiermem.train.step.trainable import Trainable
from tiermem.train.weights.gathered import GatheredWeights, build_gathered
from tiermem.train.weights.materialize import Values
from tiermem.train.weights.param_offload import ParamOffload
from tiermem.transfer.collectives import Group, fingerprint
from tiermem.transfer.distributed import resolve_group
from tiermem.transfer.engine import TransferEngine
from tiermem.transfer.residency import KeyedResidency
from tiermem.transfer.schedule import ResidencyScheduler
from tiermem.types import Tier

log = logging.getLogger(__name__)

__all__ = ["Parts", "build_parts"]


class Parts:
    """The collaborators of one TieredModel, filled in by :func:`build_parts` in the order they are
    built; the model takes each as an attribute of its own. While construction runs, the ones built
    so far are what :func:`tiermem.model.lifetime.undone_on_failure` gives back."""

    plan: ModelPlan  # every decision, taken before anything was built (NOTE [Plan, then build])
    policy: Policy  # the one given (or the default)
    placement: Policy  # NOTE [Whole-model policies]: what decides each tensor
    evaluator: Evaluator  # the placement's judge, and the stages' predicted seconds for report()
    tracer: Tracer
    group: Group  # NOTE [Data parallel]; one process: every collective a no-op
    stores: dict[Tier, Any]
    engine: TransferEngine
    hooks: HookSet
    param_offload: Optional[ParamOffload] = None  # weights off the device in one process, frozen ones too
    gathered: Optional[GatheredWeights] = None  # NOTE [Weights sharded over the ranks]
    force_eager: bool  # a compiled forward reading weights off the device runs eagerly
    layout: Layout
    scaler: LossScaler
    grads: GradCollector
    outputs: Outputs  # where Adam writes each bucket's new weights, and how they reach home
    window: Optional[WindowGrads] = None  # NOTE [Updates in backward]: the grads at rest, a window
    stepper: Stepper
    passes: Optional[Passes] = None  # NOTE [Updates in backward]: update_in_backward's backward passes
    optimizer: TieredOptimizer
    group_editor: GroupEditor  # what tm.optimizer.add_param_group(...) runs
    optimizer_spec: _Spec
    trainable: Trainable  # NOTE [Freezing and unfreezing]
    activations: ActivationOffloader
    state: ModelState  # what state_dict, save, load and resident read and replace


def build_parts(
    module: torch.nn.Module,
    policy: Optional[Policy],
    opts: Options,
    *,
    nvme_dir: Optional[str],
    trace_path: Optional[str],
    process_group: Any,
    max_skipped_steps: Optional[int],
    loss_scale: Optional[LossScale],
    step: Callable,
    add_group: Callable,
    values: Optional[Values] = None,
) -> Parts:
    """Every collaborator of a TieredModel of ``module``, built from ``opts`` and wired. ``step`` and
    ``add_group`` are what ``tm.optimizer.step()`` and ``add_param_group()`` run (bound methods of the
    model, held weakly). The plan comes first and whole (NOTE [Plan, then build]); a construction
    that raises once the stores exist gives back what it built
    (:func:`tiermem.model.lifetime.undone_on_failure`)."""
    p = Parts()
    p.tracer = Tracer(trace_path)
    p.group = resolve_group(process_group, tracer=p.tracer if trace_path else None)
    p.plan = plan = plan_model(
        module,
        policy,
        spec=opts.spec,
        dtype=opts.dtype,
        bucket_numel=opts.bucket_numel,
        limits=store_limits(opts.device, opts.budgets, nvme_dir),
        machine=lambda: machine_profile(opts.device, nvme_dir),
        world=p.group.world,
        overlap=opts.overlap,
        shard_weights=opts.shard_weights,
        device_type=opts.device.type,
        update_in_backward=opts.update_in_backward,
        inference=opts.inference,
    )
    p.policy, p.placement, p.evaluator = plan.policy, plan.placement, plan.evaluator
    p.group.check_same("model or configuration", _identity(module, plan, opts))
    in_flight = InFlight()  # grads copying home hold device room until they land: the device ledger waits for them
    # and a cache of prefetched weights evicts: both given to the device store as it is built
    weights_cache = (
        None
        if plan.weights_lookahead is None
        else ResidencyScheduler(Tier.DEVICE, lookahead_bytes=plan.weights_lookahead, prefetch=opts.prefetch)
    )
    reclaimers = (in_flight,) if weights_cache is None else (in_flight, weights_cache)
    p.stores = make_stores(opts, nvme_dir, reclaimers, p.group)  # NOTE [Reclaimers at construction]
    with lifetime.undone_on_failure(p, module):  # a failed build leaves nothing held
        check_fits(plan.footprint, p.stores)  # refuse a working set that does not fit its budgets (as `tiermem plan`)
        p.engine = TransferEngine(p.stores, device=opts.device, tracer=p.tracer if trace_path else None)
        p.hooks = HookSet()
        _build_weights(p, module, weights_cache, opts)
        _build_step(p, module, opts, in_flight, values, max_skipped_steps, loss_scale)
        _build_faces(p, module, opts, step, add_group)
    return p


def _identity(module: torch.nn.Module, plan: ModelPlan, opts: Options) -> str:
    """What every rank must agree on before building: the model's parameters, the placement and the
    options that shape the homes."""
    return fingerprint(
        [(n, tuple(q.shape), str(q.dtype), q.requires_grad) for n, q in module.named_parameters()]
        + [
            repr(plan.placement),
            opts.precision,
            opts.bucket_numel,
            repr(opts.spec),
            opts.grad_clip,
            opts.overlap,
            opts.shard_weights,
        ]
        + [(g.name, sorted(g.options.items()), g.params, g.frozen) for g in plan.groups]
    )


def _build_weights(
    p: Parts, module: torch.nn.Module, weights_cache: Optional[ResidencyScheduler], opts: Options
) -> None:
    """The working weights that do not live whole on the device: off it one by one (NOTE
    [Parameters off the device]) or sharded over the ranks (NOTE [Weights sharded over the ranks])."""
    plan = p.plan
    p.param_offload = (
        None
        if weights_cache is None
        else _offload_weights(module, dict(plan.offloaded), weights_cache, p.engine, p.hooks, opts)
    )
    p.gathered = (
        build_gathered(
            module,
            [*plan.sharded, *plan.frozen],
            p.stores,
            p.engine,
            p.group,
            opts.dtype,
            opts.device,
            p.hooks,
            prefetch=opts.prefetch,
            overlap=opts.overlap,
        )
        if plan.sharded or plan.frozen
        else None
    )
    sources = [s for s in (p.param_offload, p.gathered) if s is not None]
    if opts.inference and sources:  # NOTE [Inference only]: no step ends an iteration of the weights' order
        end_each_forward(module, sources, p.hooks)
    if opts.inference:
        fold_linear_inputs(module, p.hooks)
    # NOTE [Parameters off the device]: a compiled forward reading such weights runs eagerly. The
    # stance is process-wide: with overlap_step a step's Adam (a compiled kernel) runs during the
    # forward on another thread, and must stay compiled; dynamo then falls back by itself
    p.force_eager = plan.compiled_off_device and not opts.overlap
    if plan.compiled_off_device:
        log.warning(
            "tiermem: %d weights of this torch.compile'd model (or of modules compiled in it) live "
            "off the device under %r: its forward runs eagerly (NOTE [Parameters off the device]); "
            "place PARAM on the device to run it compiled",
            len(plan.weight_homes),
            p.policy,
        )


def _build_step(
    p: Parts,
    module: torch.nn.Module,
    opts: Options,
    in_flight: InFlight,
    values: Optional[Values],
    max_skipped_steps: Optional[int],
    loss_scale: Optional[LossScale],
) -> None:
    """The homes of every bucket, the layout over them, and what a step runs: the gradient
    collector, the loss scaler, the stepper and (update_in_backward) its backward passes."""
    p.window = (  # NOTE [Updates in backward]
        WindowGrads(p.engine, functools.partial(accumulation_homes, stores=p.stores, engine=p.engine))
        if opts.update_in_backward
        else None
    )
    homes, step_buckets = _build_layout(p, module, opts, values)
    p.scaler = LossScaler.of(opts.precision == "fp16", loss_scale)
    p.grads = GradCollector(
        homes, p.layout.slot_of, p.engine, p.stores[Tier.DEVICE].ledger, in_flight=in_flight, group=p.group
    )
    if p.window is not None:
        p.window.received = p.grads.received
        p.passes = Passes(p.window, p.grads)
    p.outputs = Outputs(step_buckets, homes, p.stores, opts.dtype, overlap=opts.overlap, tracer=p.tracer)
    p.stepper = Stepper(
        p.layout,
        p.grads,
        p.outputs,
        p.engine,
        p.scaler,
        grad_clip=opts.grad_clip,
        tracer=p.tracer,
        overlap=opts.overlap,
        group=p.group,
        max_skipped=max_skipped_steps,
        passes=p.passes,
    )


def _build_layout(p: Parts, module: torch.nn.Module, opts: Options, values: Optional[Values]) -> tuple[Any, Any]:
    """One home per class and tier for every bucket (NOTE [Homes]), the layout over them with the
    first values in; the homes and the buckets the step runs over."""
    plan = p.plan
    homes, step_buckets = make_homes(
        list(plan.buckets),
        p.stores,
        p.engine,
        opts.dtype,
        overlap=opts.overlap,
        weights_off_device=p.param_offload,
        group=p.group,
        gathered=p.gathered,
        window=p.window,
    )
    p.layout = build(
        module,
        list(plan.buckets),
        step_buckets,
        plan.groups,
        plan.aliases,
        homes,
        p.stores,
        opts.dtype,
        opts.device,
        p.param_offload,
        gathered=p.gathered,
        group=p.group,
        values=values,
        inference=opts.inference,
    )
    return homes, step_buckets


def _build_faces(p: Parts, module: torch.nn.Module, opts: Options, step: Callable, add_group: Callable) -> None:
    """What users and checkpoints see: ``tm.optimizer`` and its groups, the grad hooks, the
    parameters that may be frozen or unfrozen, the activations' accounting and the state a
    checkpoint reads."""
    shown = Fp32Values(module, p.layout)  # not the model's: nothing here refers back to it
    p.optimizer = TieredOptimizer(
        group_dicts(p.plan.groups, opts.spec, shown), opts.spec.group_defaults(), step, add_group
    )
    p.group_editor = GroupEditor(module, opts.spec, shown)
    p.optimizer_spec = opts.spec
    for b in p.plan.buckets:
        for s in b.slots:
            p.hooks.add(s.param.register_post_accumulate_grad_hook(p.grads.on_grad))
    if opts.torch_optimizer is not None:  # never stepped: a step of it would do nothing, silently
        p.hooks.add(opts.torch_optimizer.register_step_pre_hook(stepped_elsewhere))
    p.trainable = Trainable(
        module,
        p.layout,
        policy=p.placement,
        dtype=opts.dtype,
        bucket_numel=opts.bucket_numel,
        overlap=opts.overlap,
        group=p.group,
        stores=p.stores,
        engine=p.engine,
        weights_off_device=p.param_offload,
        grads=p.grads,
        outputs=p.outputs,
        hooks=p.hooks,
        param_groups=p.optimizer.param_groups,
        settle=p.stepper.finish_pending,
        on_device_cuda=opts.device.type == "cuda",
        spec=opts.spec,
        window=p.window,
    )
    p.activations = ActivationOffloader(module, p.placement, p.stores, p.engine, p.hooks)
    p.state = ModelState(
        StateCore(module, p.layout, p.stepper, p.scaler, p.optimizer.param_groups, opts.precision, opts.dtype, p.group)
    )


def _offload_weights(
    module: torch.nn.Module,
    param_homes: dict[str, Tier],
    weights_cache: ResidencyScheduler,
    engine: TransferEngine,
    hooks: HookSet,
    opts: Options,
) -> ParamOffload:
    """NOTE [Parameters off the device]: the weights' residency, over the engine, and the cache
    that brings them to the device, connected to it."""
    residency = KeyedResidency(engine)
    return ParamOffload(
        module,
        param_homes,
        residency,
        weights_cache.connect(residency),
        opts.dtype,
        opts.device,
        hooks,
        overlap=opts.overlap,
        host_in_place=opts.inference and opts.device.type == "cpu",  # NOTE [Host weights read in place]
    )
