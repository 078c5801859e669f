"""Param groups as users bring them (NOTE [Param groups]): a torch optimizer given to TieredModel,
tiermem's specs taking the same groups, ``tm.optimizer.param_groups`` with per-group schedulers,
``add_param_group`` moving parameters, and checkpoints that keep the groups. Oracles: torch's
own AdamW/Adam in a plain loop, to rounding (NOTE [Arithmetic tolerances] in tests/tolerance.py;
the largest group lr bounds every group's steps)."""

from __future__ import annotations

import copy

import pytest
import torch
from models import TinyGPT, gpt_batch, gpt_loss
from tolerance import adam_ratio, assert_adam_within, second_moments
from torch import nn

import tiermem
from tiermem import AdamW, ConfigError, PerClass, TensorClass, Tier, TieredModel, TierMemError
from tiermem.policies import KeepOnDevice, ZeroInfinity, ZeroOffload

STEPS = 6
HP = dict(lr=1e-2, steps=STEPS, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)  # the largest lr and decay


class StateOnNvme(PerClass):
    homes = {
        TensorClass.PARAM: Tier.DEVICE,
        TensorClass.ACTIVATION: Tier.DEVICE,
        TensorClass.GRAD: Tier.NVME,
        TensorClass.OPTIM_STATE: Tier.NVME,
    }


def llrd(m: TinyGPT, base: float = 1e-2, decay: float = 0.6) -> list[dict]:
    """Layer-wise lr decay: one group per layer, the embeddings lowest; the final norm without decay."""
    layers = [[m.wte, m.wpe], *[[b] for b in m.blocks], [m.ln_f]]
    return [
        {
            "params": [p for mod in layer for p in mod.parameters()],
            "lr": base * decay ** (len(layers) - 1 - d),
            "weight_decay": 0.0 if d == len(layers) - 1 else 0.1,
        }
        for d, layer in enumerate(layers)
    ]


def lambdas(n: int) -> list:
    """A per-group LambdaLR: each group's lr falls at its own pace."""
    return [lambda s, i=i: 1.0 / (1 + 0.3 * s * i) for i in range(n)]


def torch_loop(cls=torch.optim.AdamW, steps: int = STEPS, groups=llrd, edit=None, **kw) -> tuple[dict, dict]:
    """torch's optimizer in a plain loop: the weights, and its second moments (NOTE [Arithmetic tolerances])."""
    torch.manual_seed(0)
    m = TinyGPT()
    opt = cls(groups(m), lr=1e-2, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambdas(len(opt.param_groups)))
    for i in range(steps):
        if edit is not None:
            edit(i, opt)
        x, y = gpt_batch(i)
        gpt_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return m.state_dict(), second_moments(m, opt)


def tiered_loop(
    make_optimizer,
    *,
    steps: int = STEPS,
    precision: str = "fp32",
    policy=None,
    edit=None,
    first=None,
    scheduled: bool = True,
    **kw,
) -> tuple[dict, TieredModel]:
    """``first(tm)``: before the scheduler is built; ``edit(i, tm)``: before step ``i`` (a group
    added then is one no scheduler was built with: torch's schedulers refuse that, so none runs)."""
    torch.manual_seed(0)
    m = TinyGPT()
    tm = TieredModel(m, policy, optimizer=make_optimizer(m), precision=precision, bucket_size=4000, **kw)
    if first is not None:
        first(tm)
    sched = torch.optim.lr_scheduler.LambdaLR(tm.optimizer, lambdas(len(tm.optimizer.param_groups)))
    for i in range(steps):
        if edit is not None:
            edit(i, tm)
        x, y = gpt_batch(i)
        tm.backward(gpt_loss(tm(x), y))
        tm.step()
        if scheduled:
            sched.step()
    return tm.state_dict(), tm


def diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# -- a torch optimizer given, tiermem's spec with the same groups -----------------------------------------
@pytest.mark.numerics
@pytest.mark.parametrize(
    "cls,kw",
    [
        (torch.optim.AdamW, {}),
        (torch.optim.Adam, {"weight_decay": 0.05}),
        (torch.optim.Adam, {"decoupled_weight_decay": True, "weight_decay": 0.05}),
    ],
)
def test_a_torch_optimizers_groups_train_as_that_optimizer_does(cls, kw):
    got, tm = tiered_loop(lambda m: cls(llrd(m), lr=1e-2, **kw))
    want, exp_avg_sq = torch_loop(cls, foreach=False, **kw)
    assert_adam_within(got, want, exp_avg_sq, **HP)
    one_lr, _ = torch_loop(cls, groups=lambda m: [{"params": m.parameters()}], **kw)
    assert adam_ratio(one_lr, want, exp_avg_sq, **HP) > 100  # the groups' own lrs and decays changed the result
    assert [g["lr"] for g in tm.optimizer.param_groups] == pytest.approx(
        [1e-2 * 0.6 ** (3 - d) / (1 + 0.3 * STEPS * d) for d in range(4)]
    )


@pytest.mark.numerics
def test_tiermems_spec_takes_the_same_groups_with_the_same_result():
    from_torch, _ = tiered_loop(lambda m: torch.optim.AdamW(llrd(m), lr=1e-2))
    from_spec, tm = tiered_loop(lambda m: AdamW(llrd(m), lr=1e-2))
    assert diff(from_torch, from_spec) == 0.0
    named, _ = tiered_loop(lambda m: AdamW(m.named_parameters(), lr=1e-2, weight_decay=0.1))  # torch's named form
    fused, exp_avg_sq = torch_loop(groups=lambda m: m.parameters(), weight_decay=0.1, fused=True)
    assert_adam_within(named, fused, exp_avg_sq, **HP)  # another implementation: to rounding


def test_param_groups_are_named_and_list_their_parameters():
    m = TinyGPT()
    m.wpe.requires_grad_(False)  # a frozen parameter may be in a group: it trains there once unfrozen
    groups = llrd(m)
    groups.append({"params": [], "name": "spare", "lr": 0.5})  # a given group is kept, even empty
    tm = TieredModel(m, optimizer=torch.optim.AdamW(groups, lr=1e-3), precision="fp32")
    pg = tm.optimizer.param_groups
    assert [g["name"] for g in pg] == ["group0", "group1", "group2", "group3", "spare"]
    assert set(pg[0]["param_names"]) == {"wte.weight", "wpe.weight"}  # head.weight is wte.weight (tied)
    assert sorted(pg[1]["param_names"]) == sorted(f"blocks.0.{n}" for n, _ in m.blocks[0].named_parameters())
    assert pg[4]["param_names"] == [] and pg[4]["lr"] == 0.5
    assert [g["weight_decay"] for g in pg] == [0.1, 0.1, 0.1, 0.0, 0.01]
    wpe = pg[0]["params"][pg[0]["param_names"].index("wpe.weight")]
    assert wpe.dtype == torch.float32 and torch.equal(wpe, m.wpe.weight.float())  # its fp32 value


# -- add_param_group --------------------------------------------------------------------------------------
def _move_block1(i, tm):
    if i == 2:
        tm.optimizer.add_param_group({"params": tm.module.blocks[1].parameters(), "lr": 3e-2, "name": "hot"})


def _torch_run(groups, edit, **kw) -> tuple[dict, dict]:
    """torch's for-loop AdamW on ``groups(m)`` (no scheduler), ``edit(i, opt)`` before each step:
    the weights and the second moments."""
    torch.manual_seed(0)
    m = TinyGPT()
    opt = torch.optim.AdamW(groups(m), lr=1e-2, **kw, foreach=False)
    for i in range(STEPS):
        edit(i, opt, m)
        x, y = gpt_batch(i)
        gpt_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    return m.state_dict(), second_moments(m, opt)


@pytest.mark.numerics
def test_add_param_group_moves_parameters_with_their_state():
    got, tm = tiered_loop(lambda m: AdamW(lr=1e-2, weight_decay=0.1), edit=_move_block1, scheduled=False)
    assert [g["name"] for g in tm.optimizer.param_groups] == ["decay", "hot"]
    assert not any(n.startswith("blocks.1.") for n in tm.optimizer.param_groups[0]["param_names"])

    def apart(m):  # torch cannot move a parameter; the same numbers: block 1 in a group of its own
        rest = [p for n, p in m.named_parameters() if not n.startswith("blocks.1.")]
        return [{"params": rest}, {"params": m.blocks[1].parameters()}]

    def hot(i, opt, m):  # ... at the first group's lr until step 2, then at the new lr, its state kept
        if i == 2:
            opt.param_groups[1]["lr"] = 3e-2

    want, exp_avg_sq = _torch_run(apart, hot, weight_decay=0.1)
    hp = {**HP, "lr": 3e-2}  # block 1's lr from step 2 on
    assert_adam_within(got, want, exp_avg_sq, **hp)
    never_moved, _ = tiered_loop(lambda m: AdamW(lr=1e-2, weight_decay=0.1), scheduled=False)
    assert adam_ratio(never_moved, want, exp_avg_sq, **hp) > 100


@pytest.mark.numerics
def test_add_param_group_takes_a_frozen_parameter_that_trains_there_once_unfrozen():
    def edit(i, tm):
        if i == 1:
            tm.optimizer.add_param_group({"params": [tm.module.wpe.weight], "lr": 5e-3, "name": "positions"})
        if i == 3:
            tm.module.wpe.weight.requires_grad_(True)

    def make(m):
        m.wpe.requires_grad_(False)
        return AdamW([p for n, p in m.named_parameters() if n != "wpe.weight"], lr=1e-2)

    got, tm = tiered_loop(make, edit=edit, scheduled=False)
    assert tm.optimizer.param_groups[-1]["param_names"] == ["wpe.weight"]
    assert tm.stepper.param_steps()["wpe.weight"] == STEPS - 3

    def apart(m):
        m.wpe.requires_grad_(False)
        return [
            {"params": [p for n, p in m.named_parameters() if n != "wpe.weight"]},
            {"params": [m.wpe.weight], "lr": 5e-3},
        ]

    def unfreeze(i, opt, m):
        if i == 3:
            m.wpe.weight.requires_grad_(True)

    want, exp_avg_sq = _torch_run(apart, unfreeze, weight_decay=0.01)
    assert_adam_within(got, want, exp_avg_sq, **HP)


# -- the same groups under every policy, bit for bit --------------------------------------------------------
def test_groups_and_moves_stay_bit_identical_across_policies(tmp_path):
    results = {}
    for name, policy in [
        ("zero-offload", ZeroOffload()),
        ("keep-on-device", KeepOnDevice()),
        ("split", ZeroOffload(device_fraction=0.5)),
        ("state-on-nvme", StateOnNvme()),
        ("zero-infinity", ZeroInfinity()),
    ]:
        nvme = tmp_path / name
        nvme.mkdir()
        results[name], tm = tiered_loop(
            lambda m: AdamW(llrd(m), lr=1e-2),
            precision="bf16",
            policy=policy,
            edit=_move_block1,
            scheduled=False,
            nvme_dir=str(nvme),
        )
        tm.detach()
    first = results["zero-offload"]
    assert all(torch.equal(first[k], r[k]) for r in results.values() for k in first)


# -- checkpoints keep the groups ------------------------------------------------------------------------------
def test_a_checkpoint_keeps_the_groups_and_resumes_exactly(tmp_path):
    def make(m):
        return torch.optim.AdamW(llrd(m), lr=1e-2)

    _, tm = tiered_loop(make, steps=3, first=lambda tm: _move_block1(2, tm))
    lrs = [g["lr"] for g in tm.optimizer.param_groups]
    assert lrs[-1] == pytest.approx(3e-2 / (1 + 0.3 * 3 * 4))  # the scheduler drives the added group too
    tm.save(str(tmp_path / "c.tm"))
    for i in range(3, 5):
        x, y = gpt_batch(i)
        tm.backward(gpt_loss(tm(x), y))
        tm.step()
    ref = tm.state_dict()

    torch.manual_seed(0)
    m = TinyGPT()
    resumed = TieredModel(m, optimizer=make(m), precision="fp32", bucket_size=1000)
    with pytest.raises(
        TierMemError,
        match=r"^tiermem: checkpoint .* has 5 param groups, this model 4; nothing was "
        r"loaded: build the same param groups",
    ):
        resumed.load(str(tmp_path / "c.tm"))
    resumed.optimizer.add_param_group({"params": m.blocks[1].parameters(), "name": "hot"})
    resumed.load(str(tmp_path / "c.tm"))
    assert [g["lr"] for g in resumed.optimizer.param_groups] == lrs  # the lrs the scheduler had set
    for i in range(3, 5):
        x, y = gpt_batch(i)
        resumed.backward(gpt_loss(resumed(x), y))
        resumed.step()
    assert diff(resumed.state_dict(), ref) == 0.0

    m = TinyGPT()
    other = TieredModel(m, optimizer=torch.optim.AdamW(llrd(m), lr=1e-2), precision="fp32")
    other.optimizer.add_param_group({"params": m.blocks[0].parameters(), "name": "hot"})  # another block
    with pytest.raises(
        TierMemError,
        match=r"other param groups than this model: group 1 is 'group1' there, 'group1' "
        r"here \(only there: \['blocks\.0\.",
    ):
        other.load(str(tmp_path / "c.tm"))


# -- what is refused, and how ------------------------------------------------------------------------------
def _stepped(m):
    opt = torch.optim.AdamW(m.parameters())
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in m.parameters():
        p.grad = None
    return opt


def _scheduled(m):
    opt = torch.optim.AdamW(m.parameters())
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return opt


REFUSED_AT_CONSTRUCTION = {
    "lbfgs": (  # runs neither fused nor generically (its step needs a closure: NOTE [Generic optimizers])
        lambda m: torch.optim.LBFGS(m.parameters(), lr=0.1),
        r"optimizer=LBFGS could not be run generically: its step\(\) failed on a probe",
    ),
    "amsgrad": (
        lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True),
        r"AdamW given as optimizer=: AdamW\.params\[0\]\.amsgrad=True: tiermem's Adam has no amsgrad",
    ),
    "maximize": (lambda m: torch.optim.Adam(m.parameters(), maximize=True), r"maximize=True: .*has no maximize"),
    "stepped": (_stepped, r"has state for 3 parameters \(it has stepped\); tiermem runs the update itself"),
    "a scheduler on it": (
        _scheduled,
        r"an lr scheduler was built on the AdamW given as optimizer=; .*build the "
        r"scheduler on tm\.optimizer",
    ),
    "a parameter left out": (
        lambda m: torch.optim.AdamW([m[0].weight]),
        r"the trainable parameters \['0\.bias', '2\.weight'\] are in no param group",
    ),
    "another model's": (
        lambda m: torch.optim.AdamW(nn.Linear(2, 2).parameters()),
        r"hold 2 tensors that are not parameters of the wrapped module",
    ),
    "a key adam has not": (
        lambda m: AdamW([{"params": m.parameters(), "momentum": 0.9}]),
        r"AdamW\.params\[0\] sets 'momentum', which tiermem's Adam does not take",
    ),
    "groups and no_decay": (
        lambda m: AdamW(m.parameters(), no_decay_1d=True),
        r"no_decay/no_decay_1d choose groups by rule; with param groups given",
    ),
}


def _small() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2, bias=False))


@pytest.mark.parametrize("case", sorted(REFUSED_AT_CONSTRUCTION))
def test_refused_at_construction(case):
    make, match = REFUSED_AT_CONSTRUCTION[case]
    m = _small()
    with pytest.raises(ConfigError, match="^tiermem: .*" + match):
        TieredModel(m, optimizer=make(m), precision="fp32")
    TieredModel(m, precision="fp32").detach()  # nothing of the refused one holds the module


def test_add_param_group_refusals_change_nothing():
    m = _small()
    tm = TieredModel(
        m,
        optimizer=AdamW([{"params": m[0].parameters(), "name": "first"}, {"params": m[2].parameters()}]),
        precision="fp32",
    )
    before = copy.deepcopy(tm.optimizer.param_groups[:])
    for group, match in [
        ({"params": [torch.zeros(3)]}, r"a tensor of shape \(3,\) is not a parameter of the wrapped module"),
        ({"params": [m[0].weight, m[0].weight]}, r"repeats a parameter of group 0"),
        ({"params": [m[0].weight], "name": "first"}, r"a group named 'first' exists already"),
        ({"params": [m[0].weight], "amsgrad": True}, r"amsgrad=True: tiermem's Adam has no amsgrad"),
        ({"params": [m[0].weight], "lr": -1.0}, r"lr=-1\.0 is invalid"),
        ({"params": [m[0].weight], "momentum": 0.9}, r"sets 'momentum', which tiermem's Adam does not take"),
        ([m[0].weight], r"add_param_group\(\) takes one group, a dict with 'params' \(as torch\), not a list"),
    ]:
        with pytest.raises(ConfigError, match="^tiermem: " + ".*" + match):
            tm.optimizer.add_param_group(group)
    assert [g["param_names"] for g in tm.optimizer.param_groups] == [g["param_names"] for g in before]


def test_the_given_torch_optimizer_refuses_to_step_and_a_group_edited_by_hand_is_an_error():
    m = _small()
    given = torch.optim.AdamW(m.parameters(), lr=1e-2)
    tm = TieredModel(m, optimizer=given, precision="fp32")
    x = torch.randn(5, 3)
    tm.backward(tm(x).square().mean())
    with pytest.raises(TierMemError, match=r"^tiermem: this AdamW was given to a TieredModel.*call tm\.step\(\)"):
        given.step()
    name = tm.optimizer.param_groups[0]["param_names"].pop()  # a parameter no group lists
    with pytest.raises(TierMemError, match=rf"^tiermem: \['{name}'\] is to be trained but in no param group"):
        tm.step()
    tm.optimizer.param_groups[0]["param_names"].append(name)
    assert not tm.step().skipped  # the grads were kept: the retry steps
    tm.detach()
    given.step()  # detached: the hook is gone


@pytest.mark.parametrize(
    "spec",
    [AdamW(lr=1e-3), tiermem.AdamW8bit(lr=1e-3, min_8bit_size=64), tiermem.Adafactor(lr=1e-3), tiermem.SGD(lr=1e-3)],
    ids=["adamw", "adamw8bit", "adafactor", "sgd"],
)
def test_a_bad_value_set_on_a_group_is_refused_at_the_step_and_changes_nothing(spec):
    """A group's hyperparameters are checked once a step, before any bucket changes (NOTE [Checked
    once a step]): an lr set by hand to a value the kernel refuses is a tiermem: error at tm.step(), the
    weights and state as they were; set right again, the step runs from the same gradients."""
    torch.manual_seed(0)
    tm = TieredModel(TinyGPT(), ZeroOffload(), optimizer=spec, precision="fp32", bucket_size=4000)
    x, y = gpt_batch(0)
    tm.backward(gpt_loss(tm(x), y))
    before = {k: v.clone() for k, v in tm.state_dict().items()}
    tm.optimizer.param_groups[0]["lr"] = -1.0
    with pytest.raises(ConfigError, match=r"^tiermem: .*lr=-1\.0 .*invalid"):
        tm.step()
    assert all(torch.equal(v, before[k]) for k, v in tm.state_dict().items())
    tm.optimizer.param_groups[0]["lr"] = 1e-3
    assert not tm.step().skipped
    assert any(not torch.equal(v, before[k]) for k, v in tm.state_dict().items())
