"""Placement: the policy asked about every tensor, its answers checked once, trainable
parameters packed into buckets. Pure: no allocation, no I/O.

Every rule about which placements this version can honour lives here, so the constructor,
``tiermem plan`` and the homes agree: a combination it cannot honour is refused with a
``tiermem:`` error that names the tensor and what to change.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from tiermem.config.specs import _Spec
from tiermem.errors import ConfigError
from tiermem.optim.formats import StateFormat, state_format
from tiermem.plan.buckets import Bucket, Placed, plan_buckets
from tiermem.plan.policy import Evaluation, ModelInfo, Policy, bound, checked_place
from tiermem.types import StateKey, TensorClass, TensorInfo, Tier


@dataclass(frozen=True)
class ParamGroup:
    """One optimizer param group of a plan (NOTE [Param groups] in tiermem/config/specs.py)."""

    name: str
    options: Mapping[str, Any]  # the hyperparameters it sets over the optimizer spec's
    params: tuple[str, ...]  # canonical names of its trainable parameters, in reverse order of use
    frozen: tuple[str, ...] = ()  # its frozen (floating-point) parameters, trained in it once unfrozen


@dataclass(frozen=True)
class Plan:
    """What :func:`plan` decided for a model: the buckets (trainable parameters packed in reverse
    order of use, each with its homes), the optimizer param groups (``Bucket.group`` indexes
    them), every name of each parameter, and where the working weights of the parameters homed
    off the device live."""

    buckets: tuple[Bucket, ...]
    groups: tuple[ParamGroup, ...]
    aliases: Mapping[int, tuple[str, ...]]  # id(param) -> every name it has (tied weights have several)
    weight_homes: Mapping[str, Tier]  # parameter name -> home of its working weights, when not the device


def compute_tier(b: Bucket) -> Tier:
    """Where Adam runs for a bucket: where its state lives, or the host for state on NVMe."""
    return Tier.HOST if b.state_tier == Tier.NVME else b.state_tier


def accumulation_tier(b: Bucket) -> Tier:
    """Where a bucket's grads accumulate over micro-batches under update_in_backward (NOTE [Updates
    in backward] in tiermem/train/step/in_backward.py): on NVMe where the policy homes them there, else
    on the host, where the update reads them (grads the policy homes on the device included)."""
    return Tier.NVME if b.grad_tier == Tier.NVME else Tier.HOST


def owner(name: str) -> str:
    return name.rpartition(".")[0]


def _info(name: str, kind: TensorClass, p: torch.Tensor, dtype: torch.dtype) -> TensorInfo:
    return TensorInfo(name, kind, p.numel() * dtype.itemsize, tuple(p.shape), dtype, owner(name), param=name)


def _state_info(key: StateKey, p: torch.Tensor, fmt: StateFormat) -> TensorInfo:
    part = fmt.parts[fmt.names.index(key.part)]
    return TensorInfo.of_state(
        key, part.numel(p.numel(), p.shape) * part.itemsize, tuple(p.shape), part.dtype, owner(key.param)
    )


def format_of(spec: _Spec, p: torch.Tensor) -> StateFormat:
    """The optimizer state format of a trainable parameter under ``spec`` (NOTE [State formats]):
    the one rule the plan, the unfreezing and ``tiermem plan`` use."""
    master = torch.bfloat16 if spec.bf16_stochastic_round else torch.float32
    return state_format(spec.kind, master_dtype=master, numel=p.numel(), **spec.state_options())


def weights_sharded(b: Bucket, world: int, shard_weights: bool) -> bool:
    """Whether a bucket's working weights are cut over the ranks, each keeping its chunk (NOTE
    [Weights sharded over the ranks] in tiermem/train/weights/gathered.py): :func:`sharded_at` its PARAM tier."""
    return sharded_at(b.param_tier, world, shard_weights)


def sharded_at(param_tier: Tier, world: int, shard_weights: bool) -> bool:
    """Whether working weights homed on ``param_tier`` are cut over the ranks: under data
    parallelism, those off the device always; those on the device with ``shard_weights`` (else
    each rank keeps them whole, ZeRO-2). Frozen ones follow it too (:func:`frozen_buckets`)."""
    return world > 1 and (param_tier != Tier.DEVICE or shard_weights)


def split_weights(
    buckets: Sequence[Bucket],
    param_homes: Mapping[str, Tier],
    world: int,
    shard_weights: bool,
    frozen: Sequence[Bucket] = (),
) -> tuple[list[Bucket], dict[str, Tier]]:
    """The buckets whose weights are sharded over the ranks (:func:`weights_sharded`), and the
    parameters whose weights live off the device each on its own (NOTE [Parameters off the device]:
    those of one process, and frozen ones not in ``frozen``, the sharded frozen buckets of
    :func:`frozen_buckets`), with their home."""
    sharded = [b for b in buckets if weights_sharded(b, world, shard_weights)]
    in_shards = {s.name for b in [*sharded, *frozen] for s in b.slots}
    return sharded, {n: t for n, t in param_homes.items() if n not in in_shards}


def frozen_buckets(
    module: torch.nn.Module,
    param_homes: Mapping[str, Tier],
    world: int,
    shard_weights: bool,
    bucket_numel: Optional[int],
    *,
    first_index: int,
) -> list[Bucket]:
    """The frozen parameters whose working weights are sharded over the ranks like trainable ones
    (NOTE [Frozen weights sharded over the ranks] in tiermem/train/weights/frozen.py), packed into buckets
    in reverse order of use by their home (``Bucket.frozen``; no grads, no state): the floating-point
    ones homed off the device under data parallelism, and with ``shard_weights`` those on the device
    too. ``bucket_numel``: the model's bucket size (None: a bucket per parameter); ``first_index``:
    past the model's trainable buckets. One process: none."""
    unique, _ = _unique_params(module)
    placed = []
    for name, p in reversed(unique):
        tier = param_homes.get(name, Tier.DEVICE)
        if not p.requires_grad and p.is_floating_point() and sharded_at(tier, world, shard_weights):
            placed.append(Placed(name, p, tier, tier, 0, tier))
    buckets = plan_buckets(placed, bucket_numel or 1, first_index=first_index)
    for b in buckets:
        b.frozen = True
    return buckets


def adam_writes_device(compute: Tier, device_is_host: bool) -> bool:
    """Whether Adam running on ``compute`` writes weights homed on the device in place: on the
    device itself, or on the host when the device is the CPU (``device_is_host``: NOTE [A CPU
    device])."""
    return compute == Tier.DEVICE or (compute == Tier.HOST and device_is_host)


def writes_weights_in_place(b: Bucket, sharded: bool, *, device_is_host: bool = False) -> bool:
    """Whether Adam writes ``b``'s new working weights straight into their home (no staging
    buffer): weights on the device (:func:`adam_writes_device`), or this rank's chunk of sharded
    weights on the tier where Adam runs."""
    ct = compute_tier(b)
    on_device = b.param_tier == Tier.DEVICE and adam_writes_device(ct, device_is_host)
    return on_device or (sharded and b.param_tier == ct)


def weights_from_master(b: Bucket, sharded: bool, overlap: bool, *, device_is_host: bool = False) -> bool:
    """Whether a rank's chunk of ``b``'s working weights is never stored but rounded from its
    master for each gather (NOTE [A chunk rounded from its master] in
    tiermem/train/weights/weight_shards.py): sharded weights whose home is the memory where their
    optimizer state lives and the update runs (the same tier; or the device beside state on the
    host when ``device_is_host``: the device is the CPU, whose memory is the host's), without
    overlap_step (whose update rewrites the master while the next forward gathers the old weights).
    Never a frozen bucket's: it has no master."""
    if not sharded or b.frozen or overlap or b.param_tier == Tier.NVME or b.state_tier != compute_tier(b):
        return False
    shared = device_is_host and {b.param_tier, b.state_tier} == {Tier.DEVICE, Tier.HOST}
    return b.param_tier == b.state_tier or shared


def master_is_weights(b: Bucket, sharded: bool, overlap: bool) -> bool:
    """Whether ``b``'s working weights and its master are one copy (NOTE [One copy of bf16 master
    weights] in tiermem/train/weights/param_offload.py): a bf16 master (``bf16_stochastic_round``, bf16
    precision: the working dtype) whose weights live off the device, one parameter at a time, on
    the tier of its optimizer state (HOST or NVME), without overlap_step (whose update rewrites
    the master while the next forward reads the old weights)."""
    return (
        b.state.stochastic_round
        and not sharded
        and not overlap
        and b.param_tier == b.state_tier
        and b.param_tier in (Tier.HOST, Tier.NVME)
    )


def check_combination(name: str, param_tier: Tier, grad_tier: Tier, state_tiers: set[Tier], overlap: bool) -> Tier:
    """The rules a parameter's placements must follow in this version; returns its state tier."""
    if len(state_tiers) != 1:
        raise ConfigError(
            f"tiermem: the policy splits the optimizer state of {name!r} over "
            f"{sorted(t.value for t in state_tiers)}; every part of one "
            f"parameter's optimizer state must share a tier"
        )
    state_tier = next(iter(state_tiers))
    if grad_tier == Tier.NVME and state_tier == Tier.DEVICE:
        raise ConfigError(
            f"tiermem: the policy places {name!r}'s grads on NVMe but its optimizer state on "
            f"the device; grads on NVMe are read back to the host for the step: place "
            f"OPTIM_STATE on HOST or NVME for it"
        )
    if param_tier != Tier.DEVICE and state_tier == Tier.DEVICE:
        raise ConfigError(
            f"tiermem: the policy places {name!r}'s weights on {param_tier} but its optimizer "
            f"state on the device; this version updates off-device weights from host or "
            f"NVMe state only: place OPTIM_STATE on HOST or NVME for it"
        )
    if overlap and grad_tier == Tier.NVME:
        raise ConfigError(
            "tiermem: overlap_step=True cannot be combined with grads on NVMe (the next "
            "backward would overwrite grads the update still reads); place GRAD on HOST "
            "or pass overlap_step=False"
        )
    return state_tier


def _unique_params(module: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Parameter]], dict[int, list[str]]]:
    """Each parameter once (under its first name), and every name it has (tied weights have several)."""
    names: dict[int, list[str]] = defaultdict(list)
    unique: list[tuple[str, torch.nn.Parameter]] = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in names:
            unique.append((name, p))
        names[id(p)].append(name)
    return unique, dict(names)


def bind(
    module: torch.nn.Module,
    policy: Policy,
    dtype: torch.dtype,
    limits: Optional[Mapping[Tier, int]] = None,
    evaluate: Optional[Callable[..., Evaluation]] = None,
    *,
    inference: bool = False,
) -> Policy:
    """The policy to ask about ``module``'s tensors: ``policy.for_model`` told about the trainable
    parameters (every one, for ``inference``: ``ModelInfo.inference``) in the order forward uses
    them (NOTE [Whole-model policies]). Binding a bound policy again gives it back unchanged."""
    return _bind(_unique_params(module)[0], policy, dtype, limits, evaluate, inference=inference)


def _bind(
    unique: list[tuple[str, torch.nn.Parameter]],
    policy: Policy,
    dtype: torch.dtype,
    limits: Optional[Mapping[Tier, int]] = None,
    evaluate: Optional[Callable[..., Evaluation]] = None,
    *,
    inference: bool = False,
) -> Policy:
    """:func:`bind` with the module's parameters already listed (:func:`_unique_params`)."""
    params = tuple(_info(name, TensorClass.PARAM, p, dtype) for name, p in unique if p.requires_grad or inference)
    return bound(policy, ModelInfo(params, dtype, dict(limits or {}), evaluate, inference=inference))


def plan(
    module: torch.nn.Module,
    policy: Policy,
    spec: _Spec,
    dtype: torch.dtype,
    bucket_numel: int,
    *,
    overlap: bool = False,
    world: int = 1,
    limits: Optional[Mapping[Tier, int]] = None,
    inference: bool = False,
) -> Plan:
    """Ask the policy about every tensor (once bound to the whole model: NOTE [Whole-model
    policies]), then pack trainable parameters into buckets. ``limits``: bytes each tier may
    hold, for the policies that size a split; ``inference``: as :func:`bind` takes it."""
    unique, names = _unique_params(module)
    policy = _bind(unique, policy, dtype, limits, inference=inference)
    groups, group_of = param_groups(spec, unique)
    weight_homes: dict[str, Tier] = {}
    placed: list[Placed] = []
    for name, p in reversed(unique):  # reverse order of use: backward fills the last ones first
        param_tier = checked_place(policy, _info(name, TensorClass.PARAM, p, dtype))
        if param_tier != Tier.DEVICE:
            weight_homes[name] = param_tier
        if not p.requires_grad:
            continue
        fmt = format_of(spec, p)
        grad_tier, state_tier = place_training_state(policy, name, p, param_tier, fmt, overlap=overlap)
        placed.append(Placed(name, p, grad_tier, state_tier, group_of[name], param_tier, fmt))
    buckets = plan_buckets(placed, bucket_numel)
    return Plan(
        tuple(buckets),
        groups,
        MappingProxyType({k: tuple(v) for k, v in names.items()}),
        MappingProxyType(weight_homes),
    )


def place_training_state(
    policy: Policy, name: str, p: torch.Tensor, param_tier: Tier, fmt: StateFormat, *, overlap: bool
) -> tuple[Tier, Tier]:
    """The tiers of a trainable parameter's grads and optimizer state, as the (bound) policy
    places them and this version can honour them."""
    grad_tier = checked_place(policy, _info(name, TensorClass.GRAD, p, torch.float32))
    state_tiers = {checked_place(policy, _state_info(StateKey(name, part), p, fmt)) for part in fmt.names}
    return grad_tier, check_combination(name, param_tier, grad_tier, state_tiers, overlap)


def param_groups(
    spec: _Spec, unique: list[tuple[str, torch.nn.Parameter]]
) -> tuple[tuple[ParamGroup, ...], dict[str, int]]:
    """The optimizer param groups of a model (NOTE [Param groups]) and the group index of each
    trainable parameter. Groups given to the spec must hold only this module's parameters, and
    every trainable parameter must be in one; a frozen one may be (it joins it once unfrozen)."""
    defined = spec.param_groups()
    if spec.given is not None:
        ours = {id(p) for _, p in unique}
        strangers = [tuple(t.shape) for g in spec.given for t in g.params if id(t) not in ours]
        if strangers:
            raise ConfigError(
                f"tiermem: the optimizer's param groups hold {len(strangers)} tensors that are not "
                f"parameters of the wrapped module (shapes {strangers[:3]}); build the groups from "
                f"this module's parameters"
            )
    members: list[list[str]] = [[] for _ in defined]
    frozen: list[list[str]] = [[] for _ in defined]
    missing: list[str] = []
    for name, p in reversed(unique):
        group = spec.group_of(name, p)
        if p.requires_grad:
            (missing if group is None else members[group]).append(name)
        elif group is not None and p.is_floating_point():
            frozen[group].append(name)
    if missing:
        raise ConfigError(
            f"tiermem: the trainable parameters {missing[::-1][:5]}{' and more' if len(missing) > 5 else ''} "
            f"are in no param group of the optimizer; add them to a group, or freeze them "
            f"(requires_grad_(False)) before building the TieredModel"
        )
    # NOTE [Param groups]: the first always; a rule group when a parameter joins it; a given one always
    kept = [i for i, g in enumerate(defined) if members[i] or frozen[i] or i == 0 or g.given]
    groups = tuple(ParamGroup(defined[i].name, defined[i].overrides, tuple(members[i]), tuple(frozen[i])) for i in kept)
    return groups, {name: k for k, i in enumerate(kept) for name in members[i]}
