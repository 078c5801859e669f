"""The generic path (NOTE [Generic optimizers] in tiermem/config/generic_optim.py): any other torch optimizer
runs its own step() on the fp32 master weights where the state lives. Oracle: the same optimizer in a
plain fp32 loop; it is the same code on the same numbers, so the results are bit-identical (the
spread of its for-loop and foreach variants, measured, is printed by the asserts for scale)."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from models import TinyGPT, gpt_batch, gpt_loss
from test_optim_formats import POLICIES, diff, tiered, torch_loop

import tiermem
from tiermem import ConfigError, TensorClass, Tier, TieredModel, TierMemError

GENERIC = {
    "radam": lambda ps, **v: torch.optim.RAdam(ps, lr=1e-2, weight_decay=0.1, **v),
    "nadam": lambda ps, **v: torch.optim.NAdam(ps, lr=1e-2, momentum_decay=4e-3, **v),
    "rprop": lambda ps, **v: torch.optim.Rprop(ps, lr=1e-3, **v),
    "asgd": lambda ps, **v: torch.optim.ASGD(ps, lr=1e-2, t0=2, **v),
}


class SignMomentum(torch.optim.Optimizer):
    """A user's own optimizer: a momentum of the gradient's sign, a step counter as a tensor."""

    def __init__(self, params, lr: float = 1e-3, beta: float = 0.9):
        super().__init__(params, dict(lr=lr, beta=beta))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["buf"] = torch.zeros_like(p)
                st["step"] += 1
                st["buf"].mul_(group["beta"]).add_(torch.sign(p.grad), alpha=1 - group["beta"])
                p.add_(st["buf"], alpha=-group["lr"] / float(st["step"]) ** 0.5)


@functools.cache
def reference(kind: str) -> tuple[dict, float]:
    make = GENERIC[kind]
    runs = [torch_loop(lambda ps, v=v: make(ps, **v)) for v in ({"foreach": False}, {"foreach": True})]
    return runs[0], diff(*runs)


@pytest.mark.parametrize("kind", list(GENERIC))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_generic_optimizers_equal_their_plain_fp32_loop_on_every_tier(kind, policy, tmp_path):
    ref, spread = reference(kind)
    got = tiered(lambda ps: GENERIC[kind](ps), policy=policy, tmp_path=tmp_path)
    assert diff(got, ref) == 0.0, (diff(got, ref), spread)  # the same code on the same numbers
    assert diff(got, torch_loop(lambda ps: torch.optim.SGD(ps, lr=0.0))) > 1e-4  # it trained


def test_a_users_own_optimizer_runs_generically_with_groups_and_a_scheduler(caplog):
    """Per-group hyperparameters, an lr scheduler on tm.optimizer driving them, and the log saying
    the optimizer runs generically."""

    def groups(ps):
        ps = list(ps)
        return [{"params": ps[:4], "lr": 3e-3}, {"params": ps[4:], "beta": 0.5}]

    def lam(i):
        return 1.0 / (1 + i)

    torch.manual_seed(0)
    m = TinyGPT()
    opt = SignMomentum(groups(m.parameters()), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    for i in range(4):
        x, y = gpt_batch(i)
        gpt_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    ref = m.state_dict()
    torch.manual_seed(0)
    m2 = TinyGPT()
    with caplog.at_level(logging.INFO, logger="tiermem"):
        tm = TieredModel(
            m2, optimizer=SignMomentum(groups(m2.parameters()), lr=1e-3), precision="fp32", bucket_size=3000
        )
    assert "SignMomentum has no fused kernel: it runs generically" in caplog.text
    tsched = torch.optim.lr_scheduler.LambdaLR(tm.optimizer, lam)
    for i in range(4):
        x, y = gpt_batch(i)
        tm.backward(gpt_loss(tm(x), y))
        tm.step()
        tsched.step()
    assert tm.optimizer.param_groups[1]["beta"] == 0.5
    assert diff(tm.state_dict(), ref) == 0.0
    tm.detach()


@pytest.mark.parametrize("policy", ["zero_offload", "state_on_nvme"])
def test_generic_checkpoint_keeps_its_state_and_resumes_bit_exact(policy, tmp_path):
    make = GENERIC["nadam"]  # two one-value entries (step, mu_product) and two elementwise ones
    whole = tiered(make, steps=4)
    tm_out: list = []
    (tmp_path / "a").mkdir()
    tiered(make, steps=2, policy=policy, tmp_path=tmp_path / "a", tm_out=tm_out)
    tm_out[0].save(str(tmp_path / "ckpt.tm"))
    tm_out[0].detach()
    torch.manual_seed(0)
    (tmp_path / "b").mkdir()
    nvme = {"nvme_dir": str(tmp_path / "b")} if policy == "state_on_nvme" else {}
    m = TinyGPT()
    tm = TieredModel(m, POLICIES[policy](), optimizer=make(m.parameters()), precision="fp32", bucket_size=1000, **nvme)
    tm.load(str(tmp_path / "ckpt.tm"))
    for i in range(2, 4):
        x, y = gpt_batch(i)
        tm.backward(gpt_loss(tm(x), y))
        tm.step()
    assert diff(tm.state_dict(), whole) == 0.0
    tm.detach()
    assert diff(tiered(make, steps=2, start=2), whole) > 1e-4  # without the state it would differ


@pytest.mark.parametrize("kind", ["radam", "asgd"])
def test_generic_bf16_is_bit_identical_across_policies(kind, tmp_path):
    base = tiered(GENERIC[kind], precision="bf16")
    for policy, bucket_size in (("keep_on_device", 4000), ("zero_infinity", 1000), ("state_on_nvme", 100_000)):
        got = tiered(GENERIC[kind], precision="bf16", policy=policy, bucket_size=bucket_size, tmp_path=tmp_path)
        assert diff(got, base) == 0.0, (policy, bucket_size)


def test_generic_state_has_its_bytes_in_the_ledger():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 256, bias=False))
    tm = TieredModel(m, optimizer=torch.optim.RAdam(m.parameters()), precision="fp32")
    per_param = tm.report().class_peak_bytes[(TensorClass.OPTIM_STATE, Tier.HOST)] / (2 * 256 * 256)
    tm.detach()
    assert 12 <= per_param < 12.2  # master, exp_avg, exp_avg_sq (fp32) and a step per parameter


class PythonStep(SignMomentum):
    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["n"] = self.state[p].get("n", 0) + 1
                p.add_(p.grad, alpha=-group["lr"])


class RowState(SignMomentum):
    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("rows", torch.zeros(p.shape[0]))
                p.add_(p.grad, alpha=-group["lr"])


class OwnList(SignMomentum):
    """Steps a list it kept at construction, not its param groups: it would train the module's own
    parameters behind tiermem's back."""

    def __init__(self, params, lr: float = 1e-3):
        params = list(params)
        super().__init__(params, lr=lr)
        self.mine = params

    @torch.no_grad()
    def step(self, closure=None):
        pass  # (a real one would update self.mine; it must not touch the module's parameters here)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda ps: OwnList(ps), r"tiermem: optimizer=OwnList's step\(\) neither changed a probe parameter"),
        (
            lambda ps: torch.optim.LBFGS(ps),
            r"tiermem: optimizer=LBFGS could not be run generically: its step\(\) failed",
        ),
        (lambda ps: torch.optim.SparseAdam(ps), r"tiermem: optimizer=SparseAdam could not be run generically"),
        (lambda ps: PythonStep(ps), r"tiermem: optimizer=PythonStep keeps state\['n'\] as a int"),
        (lambda ps: RowState(ps), r"tiermem: optimizer=RowState keeps state\['rows'\] of shape \(3,\)"),
        (
            lambda ps: torch.optim.RMSprop([{"params": list(ps)[:2], "momentum": 0.9}, {"params": list(ps)[2:]}]),
            r"tiermem: optimizer=RMSprop keeps other state entries in some param groups than in others",
        ),
    ],
)
def test_optimizers_the_generic_path_cannot_run_are_refused_by_name(make, match):
    m = TinyGPT()
    with pytest.raises(ConfigError, match=match):
        TieredModel(m, optimizer=make(m.parameters()), precision="fp32")


def test_optimizers_lists_fused_and_generic():
    listed = tiermem.optimizers()
    assert listed["torch.optim.AdamW"] == listed["torch.optim.Adafactor"] == listed["tiermem.Lion"] == "fused"
    assert listed["torch.optim.RAdam"] == listed["torch.optim.NAdam"] == listed["torch.optim.Rprop"] == "generic"
    assert "torch.optim.LBFGS" not in listed and "torch.optim.SparseAdam" not in listed
    for name, how in listed.items():  # each listed torch class builds a TieredModel that way
        if name.startswith("torch.optim."):
            m = torch.nn.Linear(3, 2)
            tm = TieredModel(m, optimizer=getattr(torch.optim, name.rpartition(".")[2])(m.parameters()))
            kind = tm.layout.buckets[0].state.kind if hasattr(tm, "layout") else None
            assert (kind == "generic") == (how == "generic"), name
            tm.detach()


class MyAdamW(torch.optim.AdamW):
    """A subclass of a fused class may change the update: it runs generically, its own step()."""


def test_a_subclass_of_a_fused_class_runs_generically_with_torchs_numbers():
    ref = torch_loop(lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False))
    got = tiered(lambda ps: MyAdamW(ps, lr=1e-2))
    assert diff(got, ref) == 0.0


def test_stepping_the_given_instance_is_refused():
    m = TinyGPT()
    opt = torch.optim.RAdam(m.parameters())
    tm = TieredModel(m, optimizer=opt, precision="fp32")
    with pytest.raises(TierMemError, match=r"tiermem: this RAdam was given to a TieredModel"):
        opt.step()
    tm.detach()


def _rank_generic(rank: int, world: int) -> str:
    m = TinyGPT()
    try:
        TieredModel(m, optimizer=torch.optim.RAdam(m.parameters()), precision="fp32")
    except ConfigError as e:
        return str(e)
    return "built"


def test_two_ranks_refuse_the_generic_path_and_say_what_to_change():
    from ranks import run_ranks

    for said in run_ranks(_rank_generic):
        assert said.startswith(
            "tiermem: under data parallelism this version shards elementwise and block-wise 8-bit optimizer state only"
        )
        assert "['generic']" in said and "pass process_group=False" in said
