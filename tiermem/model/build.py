"""TieredModel's construction: from validated arguments (:mod:`tiermem.model.options`) to every
collaborator of a training step, wired.

It asks the policy where every tensor lives (:mod:`tiermem.plan.placement`), checks the bytes fit
(:mod:`tiermem.plan.footprint`), builds the stores, the engine and one home per class and tier
(NOTE [Homes]), the layout over them, the gradient collector, the stepper, the optimizer the user
sees and the state the checkpoint reads, and hands each collaborator what it needs. Nothing it
builds refers back to the model (NOTE [A dropped model lets go]): the model's own step and
add-group calls come in as callables, which the optimizer holds weakly.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

import torch

from tiermem.checkpoint.view import ModelState
from tiermem.config.specs import LossScale, _Spec
from tiermem.config.torch_optim import stepped_elsewhere
from tiermem.errors import ConfigError, TierMemError
from tiermem.memory.ledger import InFlight
from tiermem.model import lifetime
from tiermem.model.machine import machine_profile, store_limits
from tiermem.model.options import Options, make_stores
from tiermem.model.torch_optimizer import TieredOptimizer
from tiermem.observe.trace import Tracer
from tiermem.plan.buckets import Bucket
from tiermem.plan.choose import Evaluator
from tiermem.plan.footprint import Footprint, check_fits, largest_module_bytes, model_footprint, totals
from tiermem.plan.placement import frozen_buckets, plan, split_weights
from tiermem.plan.policy import Policy, resolve_policy
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
from tiermem.transfer.collectives import Group, fingerprint, resolve_group
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
    model, held weakly). A construction that raises once the stores exist gives back what it built
    (:func:`tiermem.model.lifetime.undone_on_failure`)."""
    p = Parts()
    p.policy = resolve_policy(policy)
    p.tracer = Tracer(trace_path)
    p.group = resolve_group(process_group, tracer=p.tracer if trace_path else None)
    limits = store_limits(opts.device, opts.budgets, nvme_dir)
    p.evaluator = Evaluator(
        module,
        opts.spec,
        opts.dtype,
        opts.bucket_numel,
        limits=limits,
        machine=lambda: machine_profile(opts.device, nvme_dir),
        overlap=opts.overlap,
        world=p.group.world,
        nvme_staging=opts.device.type == "cuda",
        device_is_host=opts.device.type == "cpu",
        shard_weights=opts.shard_weights,
    )
    p.placement = p.evaluator.bind(p.policy)  # NOTE [Whole-model policies]: what decides each tensor
    planned = plan(
        module,
        p.placement,
        opts.spec,
        opts.dtype,
        opts.bucket_numel,
        overlap=opts.overlap,
        world=p.group.world,
    )
    buckets, param_homes = list(planned.buckets), dict(planned.weight_homes)
    if not buckets:
        raise TierMemError(
            "tiermem: the module has no trainable parameters (requires_grad=True); "
            "unfreeze some before wrapping it (others may be unfrozen later)"
        )
    if opts.update_in_backward:
        _check_in_backward(buckets, p.group.world)
    p.group.check_same(
        "model or configuration",
        fingerprint(
            [(n, tuple(q.shape), str(q.dtype), q.requires_grad) for n, q in module.named_parameters()]
            + [
                repr(p.placement),
                opts.precision,
                opts.bucket_numel,
                repr(opts.spec),
                opts.grad_clip,
                opts.overlap,
                opts.shard_weights,
            ]
            + [(g.name, sorted(g.options.items()), g.params, g.frozen) for g in planned.groups]
        ),
    )
    cold = frozen_buckets(  # NOTE [Frozen weights sharded over the ranks]
        module, param_homes, p.group.world, opts.shard_weights, opts.bucket_numel, first_index=len(buckets)
    )
    sharded, offloaded = split_weights(buckets, param_homes, p.group.world, opts.shard_weights, cold)
    need = _footprint(module, buckets, param_homes, opts, p.group.world)
    in_flight = InFlight()  # grads copying home hold device room until they land: the device ledger waits for them
    # and a cache of prefetched weights evicts: both given to the device store as it is built
    weights_cache = (
        _weights_cache(module, offloaded, opts.dtype, limits[Tier.DEVICE] - totals(need)[Tier.DEVICE], opts.prefetch)
        if offloaded
        else None
    )
    reclaimers = (in_flight,) if weights_cache is None else (in_flight, weights_cache)
    p.stores = make_stores(opts, nvme_dir, reclaimers, p.group)  # NOTE [Reclaimers at construction]
    with lifetime.undone_on_failure(p, module):  # a failed build leaves nothing held
        check_fits(need, p.stores)  # refuse a working set that does not fit its budgets (as `tiermem plan`)
        p.engine = TransferEngine(p.stores, device=opts.device, tracer=p.tracer if trace_path else None)
        p.hooks = HookSet()
        p.param_offload = (
            _offload_weights(module, offloaded, weights_cache, p.engine, p.hooks, opts)
            if weights_cache is not None
            else None
        )
        p.gathered = (
            build_gathered(
                module,
                [*sharded, *cold],
                p.stores,
                p.engine,
                p.group,
                opts.dtype,
                opts.device,
                p.hooks,
                prefetch=opts.prefetch,
                overlap=opts.overlap,
            )
            if sharded or cold
            else None
        )  # NOTE [Weights sharded over the ranks]
        # NOTE [Parameters off the device]: a compiled forward reading such weights runs eagerly
        compiled_off_device = bool(param_homes or sharded or cold) and _is_compiled(module)
        # the stance is process-wide: with overlap_step a step's Adam (a compiled kernel) runs during
        # the forward on another thread, and must stay compiled; dynamo then falls back by itself
        p.force_eager = compiled_off_device and not opts.overlap
        if compiled_off_device:
            log.warning(
                "tiermem: %d weights of this torch.compile'd model (or of modules compiled in it) live "
                "off the device under %r: its forward runs eagerly (NOTE [Parameters off the device]); "
                "place PARAM on the device to run it compiled",
                len(param_homes),
                p.policy,
            )
        window = (  # NOTE [Updates in backward]
            WindowGrads(p.engine, functools.partial(accumulation_homes, stores=p.stores, engine=p.engine))
            if opts.update_in_backward
            else None
        )
        homes, step_buckets = make_homes(
            buckets,
            p.stores,
            p.engine,
            opts.dtype,
            overlap=opts.overlap,
            weights_off_device=p.param_offload,
            group=p.group,
            gathered=p.gathered,
            window=window,
        )
        p.layout = build(
            module,
            buckets,
            step_buckets,
            planned.groups,
            planned.aliases,
            homes,
            p.stores,
            opts.dtype,
            opts.device,
            p.param_offload,
            gathered=p.gathered,
            group=p.group,
            values=values,
        )
        p.scaler = LossScaler.of(opts.precision == "fp16", loss_scale)
        p.grads = GradCollector(
            homes,
            p.layout.slot_of,
            p.engine,
            p.stores[Tier.DEVICE].ledger,
            in_flight=in_flight,
            group=p.group,
        )
        if window is not None:
            window.received = p.grads.received
            p.passes = Passes(window, p.grads)
        outputs = Outputs(step_buckets, homes, p.stores, opts.dtype, overlap=opts.overlap, tracer=p.tracer)
        p.stepper = Stepper(
            p.layout,
            p.grads,
            outputs,
            p.engine,
            p.scaler,
            grad_clip=opts.grad_clip,
            tracer=p.tracer,
            overlap=opts.overlap,
            group=p.group,
            max_skipped=max_skipped_steps,
            passes=p.passes,
        )
        shown = Fp32Values(module, p.layout)  # not the model's: nothing here refers back to it
        p.optimizer = TieredOptimizer(
            group_dicts(planned.groups, opts.spec, shown), opts.spec.group_defaults(), step, add_group
        )
        p.group_editor = GroupEditor(module, opts.spec, shown)
        p.optimizer_spec = opts.spec
        for b in buckets:
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
            outputs=outputs,
            hooks=p.hooks,
            param_groups=p.optimizer.param_groups,
            settle=p.stepper.finish_pending,
            on_device_cuda=opts.device.type == "cuda",
            spec=opts.spec,
            window=window,
        )
        p.activations = ActivationOffloader(module, p.placement, p.stores, p.engine, p.hooks)
        p.state = ModelState(
            module,
            p.layout,
            p.stepper,
            p.scaler,
            p.optimizer.param_groups,
            opts.precision,
            opts.dtype,
            p.group,
        )
    return p


def _check_in_backward(buckets: list[Bucket], world: int) -> None:
    """What update_in_backward does not do (NOTE [Updates in backward]), refused before anything is built."""
    if world > 1:
        raise ConfigError(
            f"tiermem: update_in_backward=True runs in one process in this version ({world} ranks here); "
            f"leave it off under data parallelism (ZeRO-2/3 shard the grads over the ranks already)"
        )
    on_device = [b.key for b in buckets if b.state_tier == Tier.DEVICE]
    if on_device:
        raise ConfigError(
            f"tiermem: update_in_backward=True updates on the host, but the policy keeps the optimizer state "
            f"of {len(on_device)} buckets on the device ({', '.join(on_device[:3])}); give OPTIM_STATE a host "
            f"or NVMe home (ZeroOffload(device_fraction=0)), or leave update_in_backward off"
        )


def _footprint(
    module: torch.nn.Module, buckets: list[Bucket], param_homes: dict[str, Tier], opts: Options, world: int
) -> Footprint:
    """The bytes per tier the working set needs (the rule ``tiermem plan`` uses too)."""
    return model_footprint(
        module,
        buckets,
        param_homes,
        opts.dtype,
        overlap=opts.overlap,
        world=world,
        shard_weights=opts.shard_weights,
        nvme_staging=opts.device.type == "cuda",
        device_is_host=opts.device.type == "cpu",
        bucket_numel=opts.bucket_numel,
        update_in_backward=opts.update_in_backward,
    )


def _weights_cache(
    module: torch.nn.Module, param_homes: dict[str, Tier], dtype: torch.dtype, room: int, prefetch: bool
) -> ResidencyScheduler:
    """NOTE [Parameters off the device]: what brings weights to the device. It fetches ahead up
    to a few modules' weights: enough to hide transfers, while leaving the rest of the device
    (``room``: what the working set leaves) to activations and grads, which may take back what
    it holds (it is a reclaimer of the device store)."""
    lookahead = min(4 * largest_module_bytes(module, param_homes, dtype), max(room, 0) // 2)
    return ResidencyScheduler(Tier.DEVICE, lookahead_bytes=lookahead, prefetch=prefetch)


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
    )


def _is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returns, or has modules compiled in
    place (``block.compile()``)."""
    from torch._dynamo.eval_frame import OptimizedModule  # here: only asked with weights off the device

    return isinstance(module, OptimizedModule) or any(
        getattr(m, "_compiled_call_impl", None) is not None for m in module.modules()
    )
