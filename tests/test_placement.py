"""plan/placement: the policy asked once per tensor, its answers checked in one place, and the
buckets packed. Pure: made-up policies on small modules, nothing allocated."""

from __future__ import annotations

import pytest
import torch
from models import TinyGPT
from torch import nn

from tiermem import AdamW, ConfigError, Policy, StateKey, TensorClass, TensorInfo, Tier
from tiermem.plan.buckets import STATE_PARTS
from tiermem.plan.placement import compute_tier, plan
from tiermem.policies import KeepOnDevice, ZeroInfinity, ZeroOffload


class Recording(Policy):
    """Places by a table, and records every question it was asked."""

    def __init__(self, homes: dict[TensorClass, Tier], **per_name: Tier):
        self.homes, self.per_name, self.asked = homes, per_name, []

    def place(self, info):
        self.asked.append(info)
        return self.per_name.get(info.name, self.homes[info.kind])


ZO = {
    TensorClass.PARAM: Tier.DEVICE,
    TensorClass.GRAD: Tier.HOST,
    TensorClass.OPTIM_STATE: Tier.HOST,
    TensorClass.ACTIVATION: Tier.DEVICE,
}


def _plan(module, policy, *, bucket_numel=10**9, overlap=False, spec=None):
    return plan(module, policy, spec or AdamW(), torch.bfloat16, bucket_numel, overlap=overlap)


def test_every_tensor_is_asked_once_with_its_name_kind_and_bytes():
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    model[1].bias.requires_grad_(False)
    policy = Recording(ZO)
    _plan(model, policy)
    asked = {(i.name, i.kind): i for i in policy.asked}
    assert len(asked) == len(policy.asked)  # nobody asked twice
    trainable = ["0.weight", "0.bias", "1.weight"]
    assert set(asked) == (
        {(n, TensorClass.PARAM) for n in trainable + ["1.bias"]}
        | {(n, TensorClass.GRAD) for n in trainable}
        | {(f"{n}:{part}", TensorClass.OPTIM_STATE) for n in trainable for part in STATE_PARTS}
    )
    w = asked[("0.weight", TensorClass.PARAM)]
    assert (w.nbytes, w.shape, w.dtype, w.module) == (15 * 2, (5, 3), torch.bfloat16, "0")
    g = asked[("0.weight", TensorClass.GRAD)]
    assert (g.nbytes, g.dtype) == (15 * 4, torch.float32)
    # the parameter and the state part come as fields: a policy never takes the name apart
    assert (w.param, w.part, g.param, g.part) == ("0.weight", None, "0.weight", None)
    m = asked[("0.weight:exp_avg", TensorClass.OPTIM_STATE)]
    assert (m.param, m.part, m.state_key, m.module) == ("0.weight", "exp_avg", StateKey("0.weight", "exp_avg"), "0")


def test_an_info_made_by_hand_with_the_name_alone_gets_its_parameter_and_part():
    """A policy's own test builds infos as the planner's NOTE shows them: the fields follow the name."""
    state = TensorInfo("blocks.0.fc.weight:exp_avg_sq", TensorClass.OPTIM_STATE, 4, (1,), torch.float32)
    assert (state.param, state.part) == ("blocks.0.fc.weight", "exp_avg_sq")
    grad = TensorInfo("blocks.0.fc.weight", TensorClass.GRAD, 4, (1,), torch.float32)
    assert (grad.param, grad.part, grad.state_key) == ("blocks.0.fc.weight", None, None)
    act = TensorInfo("blocks.0", TensorClass.ACTIVATION, 4, (1,), torch.float32)
    assert (act.param, act.part) == (None, None)
    key = StateKey("wte.weight", "master")
    assert TensorInfo.of_state(key, 4, (1,), torch.float32) == TensorInfo(
        "wte.weight:master", TensorClass.OPTIM_STATE, 4, (1,), torch.float32, None, "wte.weight", "master"
    )


def test_buckets_in_reverse_order_of_use_with_tied_weights_once():
    model = TinyGPT()
    planned = _plan(model, ZeroOffload(), bucket_numel=1500)
    buckets = planned.buckets
    order = [s.name for b in buckets for s in b.slots]
    first_names = [n for n, _ in model.named_parameters()]  # each parameter once, first name
    assert order == list(reversed(first_names))
    assert planned.aliases[id(model.wte.weight)] == ("wte.weight", "head.weight")
    assert all(b.numel <= 1500 or len(b.slots) == 1 for b in buckets)
    assert [s.order for b in buckets for s in b.slots] == list(range(len(order)))
    assert planned.weight_homes == {}
    assert sorted(n for g in planned.groups for n in g.params) == sorted(first_names)


def test_decay_groups_follow_the_spec():
    model = nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5))
    planned = _plan(model, ZeroOffload(), spec=AdamW(no_decay_1d=True))
    assert [(g.name, dict(g.options), g.params) for g in planned.groups] == [
        ("decay", {}, ("0.weight",)),
        ("no_decay", {"weight_decay": 0.0}, ("1.bias", "1.weight", "0.bias")),
    ]
    assert {b.group for b in planned.buckets if b.slots[0].name == "0.weight"} == {0}
    assert {b.group for b in planned.buckets if b.slots[0].name != "0.weight"} == {1}
    groups = _plan(model, ZeroOffload()).groups
    assert [g.name for g in groups] == ["decay"]  # no parameter without decay: one group


def test_the_first_group_stays_when_every_parameter_is_in_another():
    """NOTE [Param groups]: the first group is always there, empty or not; buckets index the kept ones."""
    model = nn.Sequential(nn.LayerNorm(5))
    planned = _plan(model, ZeroOffload(), spec=AdamW(no_decay_1d=True))
    assert [(g.name, g.params) for g in planned.groups] == [("decay", ()), ("no_decay", ("0.bias", "0.weight"))]
    assert {b.group for b in planned.buckets} == {1}


def test_a_bucket_holds_one_placement():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    policy = Recording(
        ZO, **{"0.weight:master": Tier.NVME, "0.weight:exp_avg": Tier.NVME, "0.weight:exp_avg_sq": Tier.NVME}
    )
    buckets = _plan(model, policy).buckets
    by_name = {s.name: b for b in buckets for s in b.slots}
    assert by_name["0.weight"].state_tier == Tier.NVME and compute_tier(by_name["0.weight"]) == Tier.HOST
    assert by_name["0.bias"].state_tier == Tier.HOST and compute_tier(by_name["0.bias"]) == Tier.HOST
    assert by_name["0.weight"] is not by_name["0.bias"]


@pytest.mark.parametrize(
    "policy, params_off, compute",
    [
        (ZeroOffload(), Tier.DEVICE, Tier.HOST),
        (KeepOnDevice(), Tier.DEVICE, Tier.DEVICE),
        (ZeroInfinity(), Tier.NVME, Tier.HOST),
    ],
)
def test_built_in_policies(policy, params_off, compute):
    model = TinyGPT()
    planned = _plan(model, policy)
    buckets, param_homes = planned.buckets, planned.weight_homes
    assert {compute_tier(b) for b in buckets} == {compute}
    expected = {} if params_off == Tier.DEVICE else {n: params_off for n, _ in model.named_parameters()}
    assert param_homes == expected


REFUSED = [
    ({"w:master": Tier.HOST, "w:exp_avg": Tier.NVME}, False, "splits the optimizer state of 'w'"),
    ({"w:GRAD": Tier.NVME, "w:STATE": Tier.DEVICE}, False, "grads on NVMe but its optimizer state on the device"),
    ({"w:PARAM": Tier.HOST, "w:STATE": Tier.DEVICE}, False, "weights on host but its optimizer state on the device"),
    ({"w:GRAD": Tier.NVME}, True, "overlap_step=True cannot be combined with grads on NVMe"),
]


class _One(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))


class _ByTable(Policy):
    def __init__(self, table):
        self.table = table

    def place(self, info):
        key = {TensorClass.PARAM: "w:PARAM", TensorClass.GRAD: "w:GRAD"}.get(info.kind)
        if info.kind is TensorClass.OPTIM_STATE:
            return self.table.get(info.name, self.table.get("w:STATE", Tier.HOST))
        return self.table.get(key, ZO[info.kind])


@pytest.mark.parametrize("table, overlap, message", REFUSED)
def test_combinations_this_version_cannot_honour_are_refused(table, overlap, message):
    with pytest.raises(ConfigError, match=message):
        _plan(_One(), _ByTable(table), overlap=overlap)


def test_a_policy_that_returns_no_tier_is_named():
    class Bad(Policy):
        def place(self, info):
            return "gpu"

    with pytest.raises(ConfigError, match=r"returned 'gpu' for '.*' \(.*\); it must return Tier"):
        _plan(_One(), Bad())
