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
from typing import Any, Callable, Mapping, Optional

import torch

from tiermem.config import _AdamSpec
from tiermem.errors import ConfigError
from tiermem.plan.buckets import STATE_PARTS, Bucket, Placed, plan_buckets
from tiermem.plan.policy import Evaluation, ModelInfo, Policy, bound, checked_place
from tiermem.types import StateKey, TensorClass, TensorInfo, Tier


@dataclass(frozen=True)
class ParamGroup:
    """One optimizer param group of a plan (NOTE [Param groups] in tiermem/config.py)."""

    name: str
    options: Mapping[str, Any]  # the hyperparameters it sets over the optimizer spec's
    params: tuple[str, ...]  # canonical parameter names, in reverse order of use


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


def owner(name: str) -> str:
    return name.rpartition(".")[0]


def _info(name: str, kind: TensorClass, p: torch.Tensor, dtype: torch.dtype) -> TensorInfo:
    return TensorInfo(name, kind, p.numel() * dtype.itemsize, tuple(p.shape), dtype, owner(name), param=name)


def _state_info(key: StateKey, p: torch.Tensor) -> TensorInfo:
    return TensorInfo.of_state(key, p.numel() * 4, tuple(p.shape), torch.float32, owner(key.param))


def check_data_parallel(name: str, param_tier: Tier, grad_tier: Tier, world: int) -> None:
    """What data parallelism (NOTE [Data parallel]) does not combine with in this version."""
    if world == 1:
        return
    if param_tier != Tier.DEVICE:
        raise ConfigError(f"tiermem: the policy places the weights of {name!r} on {param_tier} under data "
                          f"parallelism ({world} ranks); weights off the device are not sharded in this version: "
                          f"use a policy with PARAM on DEVICE (ZeroOffload; for a larger model, a PerClass with "
                          f"OPTIM_STATE on NVME), or process_group=False")
    if grad_tier == Tier.NVME:
        raise ConfigError(f"tiermem: the policy places the grads of {name!r} on NVMe under data parallelism "
                          f"({world} ranks); each rank keeps only 1/{world} of the grads: place GRAD on HOST")


def check_combination(name: str, param_tier: Tier, grad_tier: Tier, state_tiers: set[Tier], overlap: bool) -> Tier:
    """The rules a parameter's placements must follow in this version; returns its state tier."""
    if len(state_tiers) != 1:
        raise ConfigError(f"tiermem: the policy splits the optimizer state of {name!r} over "
                          f"{sorted(t.value for t in state_tiers)}; master, exp_avg and exp_avg_sq "
                          f"of one parameter must share a tier")
    state_tier = next(iter(state_tiers))
    if grad_tier == Tier.NVME and state_tier == Tier.DEVICE:
        raise ConfigError(f"tiermem: the policy places {name!r}'s grads on NVMe but its optimizer state on "
                          f"the device; grads on NVMe are read back to the host for the step: place "
                          f"OPTIM_STATE on HOST or NVME for it")
    if param_tier != Tier.DEVICE and state_tier == Tier.DEVICE:
        raise ConfigError(f"tiermem: the policy places {name!r}'s weights on {param_tier} but its optimizer "
                          f"state on the device; this version updates off-device weights from host or "
                          f"NVMe state only: place OPTIM_STATE on HOST or NVME for it")
    if overlap and grad_tier == Tier.NVME:
        raise ConfigError("tiermem: overlap_step=True cannot be combined with grads on NVMe (the next "
                          "backward would overwrite grads the update still reads); place GRAD on HOST "
                          "or pass overlap_step=False")
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


def bind(module: torch.nn.Module, policy: Policy, dtype: torch.dtype, limits: Optional[Mapping[Tier, int]] = None,
         evaluate: Optional[Callable[..., Evaluation]] = None) -> Policy:
    """The policy to ask about ``module``'s tensors: ``policy.for_model`` told about the trainable
    parameters in the order forward uses them (NOTE [Whole-model policies]). Binding a bound
    policy again gives it back unchanged."""
    return _bind(_unique_params(module)[0], policy, dtype, limits, evaluate)


def _bind(unique: list[tuple[str, torch.nn.Parameter]], policy: Policy, dtype: torch.dtype,
          limits: Optional[Mapping[Tier, int]] = None, evaluate: Optional[Callable[..., Evaluation]] = None) -> Policy:
    """:func:`bind` with the module's parameters already listed (:func:`_unique_params`)."""
    params = tuple(_info(name, TensorClass.PARAM, p, dtype) for name, p in unique if p.requires_grad)
    return bound(policy, ModelInfo(params, dtype, dict(limits or {}), evaluate))


def plan(module: torch.nn.Module, policy: Policy, spec: _AdamSpec, dtype: torch.dtype,
         bucket_numel: int, *, overlap: bool = False, world: int = 1, limits: Optional[Mapping[Tier, int]] = None
         ) -> Plan:
    """Ask the policy about every tensor (once bound to the whole model: NOTE [Whole-model
    policies]), then pack trainable parameters into buckets. ``limits``: bytes each tier may
    hold, for the policies that size a split."""
    unique, names = _unique_params(module)
    policy = _bind(unique, policy, dtype, limits)
    weight_homes: dict[str, Tier] = {}
    defined = spec.param_groups()
    members: list[list[str]] = [[] for _ in defined]
    placed: list[Placed] = []
    for name, p in reversed(unique):  # reverse order of use: backward fills the last ones first
        param_tier = checked_place(policy, _info(name, TensorClass.PARAM, p, dtype))
        if param_tier != Tier.DEVICE:
            weight_homes[name] = param_tier
        if not p.requires_grad:
            continue
        grad_tier = checked_place(policy, _info(name, TensorClass.GRAD, p, torch.float32))
        state_tiers = {checked_place(policy, _state_info(StateKey(name, part), p)) for part in STATE_PARTS}
        state_tier = check_combination(name, param_tier, grad_tier, state_tiers, overlap)
        check_data_parallel(name, param_tier, grad_tier, world)
        group = spec.group_of(name, p)
        members[group].append(name)
        placed.append(Placed(name, p, grad_tier, state_tier, group, param_tier))
    kept = [i for i, m in enumerate(members) if m or i == 0]  # NOTE [Param groups]: the first always
    index = {i: k for k, i in enumerate(kept)}
    groups = tuple(ParamGroup(defined[i].name, defined[i].overrides, tuple(members[i])) for i in kept)
    buckets = plan_buckets([e._replace(group=index[e.group]) for e in placed], bucket_numel)
    return Plan(tuple(buckets), groups, MappingProxyType({k: tuple(v) for k, v in names.items()}),
                MappingProxyType(weight_homes))
