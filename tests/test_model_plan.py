"""NOTE [Plan, then build]: one ModelPlan, a pure function of the module and the configuration,
taken whole before anything is built; the model is built from it and plans nothing itself."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from models import Quirky, TinyGPT

from tiermem import AdamW, Budgets, TieredModel
from tiermem.errors import ConfigError, OutOfTierMemory, TierMemError
from tiermem.plan.model_plan import ModelPlan, plan_model
from tiermem.plan.profile import Profile
from tiermem.policies import ZeroInfinity, ZeroOffload
from tiermem.types import Tier

LIMITS = {Tier.DEVICE: 1 << 30, Tier.HOST: 1 << 30, Tier.NVME: 1 << 32}


def _no_machine() -> Profile:
    raise AssertionError("these policies never ask for the machine's profile")


def _plan(module: torch.nn.Module, policy=None, **kw) -> ModelPlan:
    args = dict(spec=AdamW(), dtype=torch.bfloat16, bucket_numel=700, limits=LIMITS, machine=_no_machine)
    return plan_model(module, policy, **{**args, **kw})


def _shape(plan: ModelPlan) -> tuple:
    """What a plan decided, without the parameter objects it refers to."""
    buckets = [
        (b.index, b.key, b.numel, b.grad_tier, b.state_tier, b.param_tier, [(s.name, s.offset) for s in b.slots])
        for b in plan.buckets
    ]
    return (buckets, dict(plan.weight_homes), dict(plan.offloaded), plan.footprint, plan.weights_lookahead)


@pytest.mark.parametrize("policy", [None, ZeroOffload(), ZeroInfinity()], ids=["default", "offload", "infinity"])
def test_a_meta_module_plans_as_the_same_module_in_memory(policy):
    torch.manual_seed(0)
    real = TinyGPT()
    with torch.device("meta"):
        meta = TinyGPT()
    assert _shape(_plan(meta, policy)) == _shape(_plan(real, policy))


def test_planning_materializes_nothing():
    """Planning ZeroInfinity (everything on NVMe) of a meta module leaves it on meta: the plan takes no
    store and no directory, only the bytes each tier may hold."""
    with torch.device("meta"):
        module = TinyGPT()
    plan = _plan(module, ZeroInfinity())
    assert all(p.is_meta for p in module.parameters())  # nothing materialized either
    assert plan.tier_bytes()[Tier.NVME] > 0 and plan.offloaded  # it did decide NVMe homes
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.world = 2  # type: ignore[misc]


def test_the_model_is_built_from_its_plan():
    torch.manual_seed(0)
    module = TinyGPT()
    tm = TieredModel(module, ZeroOffload(), precision="bf16", bucket_size=2800, device="cpu")
    again = _plan(TinyGPT(), ZeroOffload(), bucket_numel=700, limits=tm.model_plan.limits)
    assert _shape(tm.model_plan) == _shape(again)
    assert [b.key for b in tm.layout.buckets] == [b.key for b in tm.model_plan.buckets]
    summary = tm.model_plan.summary()
    assert summary["trainable_params"] == tm.layout.n_params
    assert sum(t["bytes"] for t in summary["tiers"].values()) == sum(tm.model_plan.tier_bytes().values())
    tm.detach()


def test_a_plan_that_does_not_fit_is_refused_before_anything_is_built(tmp_path):
    """The footprint is checked against the stores built from the budgets; the plan's bytes are the ones
    the error names."""
    torch.manual_seed(0)
    module = TinyGPT()
    need = _plan(TinyGPT(), ZeroOffload(), dtype=torch.float32).tier_bytes()[Tier.HOST]
    with pytest.raises(OutOfTierMemory):
        TieredModel(
            module, ZeroOffload(), precision="fp32", bucket_size=2800, device="cpu", budgets=Budgets(host=need - 1)
        )
    tm = TieredModel(
        module, ZeroOffload(), precision="fp32", bucket_size=2800, device="cpu", budgets=Budgets(host=need)
    )
    assert tm.model_plan.tier_bytes()[Tier.HOST] == need
    tm.detach()


def test_what_cannot_be_built_is_refused_at_planning():
    frozen = Quirky().requires_grad_(False)
    with pytest.raises(TierMemError, match="no trainable parameters"):
        _plan(frozen)
    _plan(TinyGPT(), update_in_backward=True, world=2)  # data parallel too (tests/test_update_in_backward_dp.py)
    with pytest.raises(ConfigError, match="keeps the optimizer state"):
        _plan(TinyGPT(), ZeroOffload(device_fraction=1.0), update_in_backward=True)
    with pytest.raises(ConfigError, match="keeps the optimizer state"):
        _plan(TinyGPT(), ZeroOffload(device_fraction=1.0), update_in_backward=True, world=2)
