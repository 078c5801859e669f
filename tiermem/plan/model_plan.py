"""The plan of one TieredModel: every decision of its construction, taken before anything exists.

# NOTE [Plan, then build]
A TieredModel is made in two halves. :func:`plan_model` is a pure function of the module (the
names, shapes, dtypes and ``requires_grad`` of its parameters: a module on the meta device plans
as the same module in memory), the policy, the optimizer spec, the working dtype, the bucket size,
the world size and the bytes each tier may hold. It asks the policy about every tensor, packs the
trainable parameters into buckets, splits off the weights sharded over the ranks and those homed
off the device one by one, sums the bytes each tier needs and refuses what this version cannot do,
all into one frozen :class:`ModelPlan`. It allocates nothing, opens no file and runs no collective
(the machine's profile is read only if a whole-model policy asks for it, NOTE [Whole-model
policies]). :func:`tiermem.model.build.build_parts` then builds the stores, homes, weights and step
from that plan and plans nothing itself: the budgets are checked against ``plan.footprint``, the
weights cache fetches ``plan.weights_lookahead`` bytes ahead, the homes are those of
``plan.buckets``. The one later decision, the buckets of parameters unfrozen after construction,
is :func:`plan_unfrozen`, by the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from tiermem.config.specs import _Spec
from tiermem.errors import ConfigError, TierMemError
from tiermem.plan.buckets import Bucket, Placed, plan_buckets
from tiermem.plan.choose import Evaluator
from tiermem.plan.footprint import WORKING_WEIGHTS, Footprint, footprint, largest_module_bytes, model_footprint, totals
from tiermem.plan.placement import (
    ParamGroup,
    _info,
    format_of,
    frozen_buckets,
    place_training_state,
    plan,
    split_weights,
)
from tiermem.plan.policy import Policy, checked_place, resolve_policy
from tiermem.plan.profile import Profile
from tiermem.types import TensorClass, Tier

__all__ = ["ModelPlan", "plan_model", "plan_unfrozen"]


@dataclass(frozen=True)
class ModelPlan:
    """What :func:`plan_model` decided for one model (NOTE [Plan, then build])."""

    policy: Policy  # the one given, or the default
    placement: Policy  # what decides each tensor: the policy bound to this model (NOTE [Whole-model policies])
    evaluator: Evaluator  # the placement's judge, and the stages' predicted seconds for report()
    buckets: tuple[Bucket, ...]  # trainable parameters in reverse order of use, each with its homes
    groups: tuple[ParamGroup, ...]  # the optimizer's param groups
    aliases: Mapping[int, tuple[str, ...]]  # id(param) -> every name it has (tied weights have several)
    weight_homes: Mapping[str, Tier]  # every parameter whose working weights live off the device
    sharded: tuple[Bucket, ...]  # trainable buckets whose weights are sharded over the ranks
    frozen: tuple[Bucket, ...]  # frozen parameters sharded like them (NOTE [Frozen weights sharded over the ranks])
    offloaded: Mapping[str, Tier]  # weights off the device one by one (NOTE [Parameters off the device])
    footprint: Footprint  # the bytes each tier needs, by purpose
    limits: Mapping[Tier, int]  # the bytes each tier's store may hold
    weights_lookahead: Optional[int]  # what the weights cache fetches ahead; None: no weights off the device alone
    compiled_off_device: bool  # a torch.compile'd module reading weights off the device (its forward runs eagerly)
    world: int

    def tier_bytes(self) -> dict[Tier, int]:
        """The bytes each tier needs, all purposes together."""
        return totals(self.footprint)

    def summary(self) -> dict[str, Any]:
        """The plan as plain data: what ``tiermem plan`` prints of a model and ``--json`` writes."""
        params = sum(s.param.numel() for b in self.buckets for s in b.slots)
        return {
            "policy": repr(self.policy),
            "world": self.world,
            "buckets": len(self.buckets),
            "trainable_params": params,
            "homes": {
                "params_off_device": len(self.weight_homes),
                "grads": _count(b.grad_tier for b in self.buckets),
                "optim_state": _count(b.state_tier for b in self.buckets),
                "weights_sharded_buckets": len(self.sharded) + len(self.frozen),
            },
            "tiers": {
                t.value: {"bytes": n, "limit_bytes": self.limits.get(t)} for t, n in self.tier_bytes().items() if n
            },
            "footprint": {t.value: dict(p) for t, p in self.footprint.items() if p},
        }


def _count(tiers: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in tiers:
        out[t.value] = out.get(t.value, 0) + 1
    return out


def plan_model(
    module: torch.nn.Module,
    policy: Optional[Policy],
    *,
    spec: _Spec,
    dtype: torch.dtype,
    bucket_numel: int,
    limits: Mapping[Tier, int],
    machine: Callable[[], Profile],
    world: int = 1,
    overlap: bool = False,
    shard_weights: bool = False,
    device_type: str = "cpu",
    update_in_backward: bool = False,
    inference: bool = False,
) -> ModelPlan:
    """Everything TieredModel's construction decides (NOTE [Plan, then build]); nothing allocated.
    ``limits``: the bytes each tier's store may hold (a tier without a store absent); ``machine``:
    this machine's profile, called only if a whole-model policy asks for it; ``device_type``: the
    device's (``"cuda"`` stages NVMe reads through the host; ``"cpu"`` computes on the host);
    ``inference``: no parameter trains, none is asked to (NOTE [Inference only] in tiermem/model/inference.py)."""
    given = resolve_policy(policy)
    shape = _shape_of(overlap, world, shard_weights, device_type)
    evaluator = Evaluator(
        module, spec, dtype, bucket_numel, limits=limits, machine=machine, inference=inference, **shape
    )
    placement = evaluator.bind(given)
    planned = plan(module, placement, spec, dtype, bucket_numel, overlap=overlap, world=world, inference=inference)
    buckets, homes = planned.buckets, dict(planned.weight_homes)
    if not inference:
        _check_buckets(buckets, update_in_backward)
    cold = frozen_buckets(module, homes, world, shard_weights, bucket_numel, first_index=len(buckets))
    sharded, offloaded = split_weights(buckets, homes, world, shard_weights, cold)
    need = model_footprint(
        module,
        buckets,
        homes,
        dtype,
        bucket_numel=bucket_numel,
        update_in_backward=update_in_backward,
        **shape,
    )
    lookahead = _lookahead(module, offloaded, dtype, limits[Tier.DEVICE] - totals(need)[Tier.DEVICE], inference)
    return ModelPlan(
        policy=given,
        placement=placement,
        evaluator=evaluator,
        buckets=buckets,
        groups=planned.groups,
        aliases=planned.aliases,
        weight_homes=planned.weight_homes,
        sharded=tuple(sharded),
        frozen=tuple(cold),
        offloaded=offloaded,
        footprint=need,
        limits=dict(limits),
        weights_lookahead=lookahead,
        compiled_off_device=bool(homes or sharded or cold) and _is_compiled(module),
        world=world,
    )


def _lookahead(
    module: torch.nn.Module, offloaded: Mapping[str, Tier], dtype: torch.dtype, room: int, inference: bool
) -> Optional[int]:
    """The bytes the weights cache fetches ahead: a few modules' weights, leaving the rest of the
    device (``room``: what the working set leaves) to activations and grads; None without weights
    off the device one by one (NOTE [Parameters off the device]). For inference (NOTE [Inference
    only]) nothing else lives there but a batch's passing activations (the KV cache reserves its own
    bytes at each generate, and the cache gives back what it fetched ahead when asked): the cache
    may fill the room and the running module's share. Measured on bench/generate.py's 220M Llama
    with half its weights streamed, a quarter of them as the device budget: 196 -> 180 ms a token
    (RESULTS 2026-12-07, fifth session)."""
    if not offloaded:
        return None
    largest = largest_module_bytes(module, offloaded, dtype)
    if inference:
        return max(room, 0) + largest
    return min(4 * largest, max(room, 0) // 2)


def _shape_of(overlap: bool, world: int, shard_weights: bool, device_type: str) -> dict[str, Any]:
    """What shapes the homes besides the buckets, as the evaluator and the footprint take it."""
    return dict(
        overlap=overlap,
        world=world,
        shard_weights=shard_weights,
        nvme_staging=device_type == "cuda",  # NVMe reads staged through the host
        device_is_host=device_type == "cpu",
    )


def _check_buckets(buckets: Sequence[Bucket], update_in_backward: bool) -> None:
    """What a plan cannot be built into, refused before anything is."""
    if not buckets:
        raise TierMemError(
            "tiermem: the module has no trainable parameters (requires_grad=True); "
            "unfreeze some before wrapping it (others may be unfrozen later)"
        )
    if not update_in_backward:
        return
    on_device = [b.key for b in buckets if b.state_tier == Tier.DEVICE]
    if on_device:
        raise ConfigError(
            f"tiermem: update_in_backward=True updates on the host, but the policy keeps the optimizer state "
            f"of {len(on_device)} buckets on the device ({', '.join(on_device[:3])}); give OPTIM_STATE a host "
            f"or NVMe home (ZeroOffload(device_fraction=0)), or leave update_in_backward off"
        )


def _is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returns, or has modules compiled in
    place (``block.compile()``)."""
    from torch._dynamo.eval_frame import OptimizedModule  # here: only asked with weights off the device

    return isinstance(module, OptimizedModule) or any(
        getattr(m, "_compiled_call_impl", None) is not None for m in module.modules()
    )


def plan_unfrozen(
    new: Sequence[tuple[str, torch.nn.Parameter]],
    placement: Policy,
    spec: _Spec,
    dtype: torch.dtype,
    bucket_numel: int,
    *,
    group_of: Mapping[str, int],
    weight_homes: Mapping[str, Tier],
    after: Sequence[Bucket],
    overlap: bool = False,
    nvme_staging: bool = False,
) -> tuple[list[Bucket], Footprint]:
    """The buckets of parameters unfrozen after construction (NOTE [Freezing and unfreezing] in
    tiermem/train/step/trainable.py), appended ``after`` the model's, placed by the model's bound
    policy, and the bytes they need beyond the working weights already at their homes off the
    device. ``group_of``: each one's param group; ``weight_homes``: where off-device weights live."""
    placed = []
    for name, p in reversed(new):  # reverse order of use, as the plan packs them
        param_tier = weight_homes.get(name, Tier.DEVICE)
        asked = checked_place(placement, _info(name, TensorClass.PARAM, p, dtype))
        if asked != param_tier:
            raise ConfigError(
                f"tiermem: {name!r} was unfrozen; the policy now places its weights on {asked}, "
                f"but they live on {param_tier}, where it placed them when the model was built; a "
                f"policy must place a parameter's weights in one tier for the life of the model"
            )
        fmt = format_of(spec, p)
        grad_tier, state_tier = place_training_state(placement, name, p, param_tier, fmt, overlap=overlap)
        placed.append(Placed(name, p, grad_tier, state_tier, group_of[name], param_tier, fmt))
    buckets = plan_buckets(placed, bucket_numel, first_index=len(after), first_order=sum(len(b.slots) for b in after))
    need = footprint(buckets, [], dtype, overlap=overlap, nvme_staging=nvme_staging)
    for b in buckets:  # weights homed off the device are there already: the unfreeze reuses them
        if b.param_tier != Tier.DEVICE:
            need[b.param_tier][WORKING_WEIGHTS] -= b.numel * dtype.itemsize
    return buckets, need
