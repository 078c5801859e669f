"""The drop-in optimizers (CPUSGD, CPUAdagrad, CPULion, CPUAdafactor, CPUAdam8bit, and CPUAdam's new
options) as torch optimizers: against torch with param groups and an lr scheduler, state_dict round
trips that resume bit for bit (torch's own state_dicts load too), all-or-nothing steps, bf16 weights
with stochastic rounding, and the errors they raise."""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
from tolerance import assert_kernel_agrees
from torch import nn

from tiermem import ConfigError
from tiermem.errors import ArgumentError
from tiermem.optim import CPUSGD, CPUAdafactor, CPUAdagrad, CPUAdam, CPUAdam8bit, CPULion

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)
STEPS = 12


def model(seed: int = 0, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(13, 31), nn.Tanh(), nn.Linear(31, 7), nn.LayerNorm(7)).to(dtype)


def groups(m: nn.Module, **second) -> list[dict]:
    """Two groups with their own hyperparameters (weights; biases and norms)."""
    decay = [p for n, p in m.named_parameters() if n.endswith("weight") and p.dim() == 2]
    rest = [p for n, p in m.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
    return [{"params": decay}, {"params": rest, "lr": 3e-3, **second}]


def run_steps(m: nn.Module, opt, gen: torch.Generator, steps: int, sched=None, moves=None) -> None:
    """``moves`` gets the most one step moved a weight (the step size of NOTE [Arithmetic tolerances])."""
    dtype = next(m.parameters()).dtype
    for _ in range(steps):
        x, y = torch.randn(16, 13, generator=gen), torch.randn(16, 7, generator=gen)
        before = [p.detach().clone() for p in m.parameters()]
        opt.zero_grad()
        nn.functional.mse_loss(m(x.to(dtype)).float(), y).backward()
        opt.step()
        if sched is not None:
            sched.step()
        if moves is not None:
            moves.append(max((p.detach() - b).abs().max().item() for p, b in zip(m.parameters(), before)))


def scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # lr changes every step


# (ours, theirs, hyperparameters, the second group's own, tolerance: 0 = bit for bit where torch's
# kernels fuse the same multiply-adds, else to NOTE [Arithmetic tolerances] (tests/tolerance.py); else a
# relative 2**-22 per step for the correctly rounded square root, as CPUAdam's tests)
CASES = {
    "sgd": (
        CPUSGD,
        torch.optim.SGD,
        dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
        dict(momentum=0.5, dampening=0.0, nesterov=True),
        0,
    ),
    "sgd-plain": (CPUSGD, torch.optim.SGD, dict(lr=0.05, maximize=True), dict(weight_decay=0.1), 0),
    "adagrad": (
        CPUAdagrad,
        torch.optim.Adagrad,
        dict(lr=0.05, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1),
        dict(eps=1e-6),
        STEPS * 2.0**-22,
    ),
    "adafactor": (CPUAdafactor, torch.optim.Adafactor, dict(lr=0.05, weight_decay=0.01), dict(d=2.0), 1e-5),
}


@pytest.mark.numerics
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch_with_groups_and_a_scheduler(case):
    ours_cls, theirs_cls, kw, second, tol = CASES[case]
    m1, m2 = model(), model()
    ours = ours_cls(groups(m1, **second), **kw)
    theirs = theirs_cls(groups(m2, **second), **kw, foreach=False)
    run_steps(m1, ours, torch.Generator().manual_seed(1), STEPS, scheduler(ours))
    moves: list[float] = []
    run_steps(m2, theirs, torch.Generator().manual_seed(1), STEPS, scheduler(theirs), moves=moves)
    assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in theirs.param_groups]
    for p, q in zip(m1.parameters(), m2.parameters()):
        if tol == 0:
            assert_kernel_agrees(p.detach(), q.detach(), steps=STEPS, step_size=max(moves))
        else:
            torch.testing.assert_close(p, q, rtol=tol, atol=tol * 0.05)


def test_lion_with_groups_steps_each_group_by_its_own_lr():
    m1 = model()
    opt = CPULion(groups(m1, betas=(0.95, 0.98)), lr=1e-3, weight_decay=0.1)
    before = [p.detach().clone() for p in m1.parameters()]
    run_steps(m1, opt, torch.Generator().manual_seed(1), 1)
    for (p, b), lr in zip(zip(m1.parameters(), before), [1e-3, 3e-3, 1e-3, 3e-3, 3e-3, 3e-3]):
        step = (b * (1 - lr * 0.1) - p).abs()  # after the decay, every element moves by lr (or 0)
        assert torch.allclose(step[step > lr / 2], torch.tensor(lr), rtol=1e-3)


FACTORIES = {
    "sgd": lambda ps: CPUSGD(ps, lr=0.05, momentum=0.9),
    "adagrad": lambda ps: CPUAdagrad(ps, lr=0.05, initial_accumulator_value=0.1),
    "lion": lambda ps: CPULion(ps, lr=1e-3, weight_decay=0.1),
    "adafactor": lambda ps: CPUAdafactor(ps, lr=0.05),
    "adam8bit": lambda ps: CPUAdam8bit(ps, lr=1e-2, min_8bit_size=200),
    "adam-bf16": lambda ps: CPUAdam(ps, lr=1e-2, bf16_stochastic_round=True),
    "adam8bit-bf16": lambda ps: CPUAdam8bit(ps, lr=1e-2, min_8bit_size=200, bf16_stochastic_round=True),
}


def _dtype(name: str) -> torch.dtype:
    return torch.bfloat16 if name.endswith("bf16") else torch.float32


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_state_dict_round_trip_resumes_bit_identically(name):
    m1, gen = model(dtype=_dtype(name)), torch.Generator().manual_seed(1)
    opt1 = FACTORIES[name](m1.parameters())
    run_steps(m1, opt1, gen, 5)
    saved = copy.deepcopy({"model": m1.state_dict(), "opt": opt1.state_dict(), "gen": gen.get_state()})
    run_steps(m1, opt1, gen, 6)  # uninterrupted
    m2, gen2 = model(seed=99, dtype=_dtype(name)), torch.Generator()
    m2.load_state_dict(saved["model"])
    gen2.set_state(saved["gen"])
    opt2 = FACTORIES[name](m2.parameters())
    opt2.load_state_dict(saved["opt"])
    run_steps(m2, opt2, gen2, 6)
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(m1.parameters(), m2.parameters()):
        for key, value in opt1.state[p].items():
            assert value.dtype == opt2.state[q][key].dtype and torch.equal(value, opt2.state[q][key])


def test_loads_torch_sgd_and_adagrad_state_dicts():
    for ours_cls, theirs_cls, kw in (
        (CPUSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
        (CPUAdagrad, torch.optim.Adagrad, dict(lr=0.05)),
    ):
        m_t, m_o = model(), model()
        theirs = theirs_cls(m_t.parameters(), **kw, foreach=False)
        run_steps(m_t, theirs, torch.Generator().manual_seed(1), 3)
        m_o.load_state_dict(m_t.state_dict())
        ours = ours_cls(m_o.parameters(), **kw)
        ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
        run_steps(m_t, theirs, torch.Generator().manual_seed(5), 4)
        run_steps(m_o, ours, torch.Generator().manual_seed(5), 4)
        for p, q in zip(m_o.parameters(), m_t.parameters()):
            torch.testing.assert_close(p, q, rtol=7 * 2.0**-22, atol=7 * 2.0**-22 * 0.05)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_nonfinite_gradient_skips_the_whole_step(name):
    m = model(dtype=_dtype(name))
    opt = FACTORIES[name](m.parameters())
    run_steps(m, opt, torch.Generator().manual_seed(1), 2)
    before = copy.deepcopy((m.state_dict(), opt.state_dict()))
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    last = list(m.parameters())[-1]
    last.grad[0] = math.nan  # only the last parameter's gradient is bad: nobody may move
    opt.step()
    assert opt.last_step_skipped
    after = (m.state_dict(), opt.state_dict())
    for k, v in before[0].items():
        assert torch.equal(after[0][k], v)
    for pid, st in before[1]["state"].items():
        for key, v in st.items():
            assert torch.equal(after[1]["state"][pid][key], v)


@pytest.mark.parametrize("name", ["adam-bf16", "adam8bit-bf16"])
def test_bf16_weights_are_reproducible_and_keyed_by_the_seed(name):
    def final(seed: int) -> list[torch.Tensor]:
        m = model(dtype=torch.bfloat16)
        torch.manual_seed(seed)  # the default sr_seed is torch.initial_seed() when the optimizer is built
        opt = FACTORIES[name](m.parameters())
        run_steps(m, opt, torch.Generator().manual_seed(1), 4)
        assert all(p.dtype == torch.bfloat16 for p in m.parameters())
        assert all(v.dtype != torch.bfloat16 for st in opt.state.values() for v in st.values())  # no bf16 state
        return [p.detach().clone() for p in m.parameters()]

    a, b, c = final(0), final(0), final(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda ps: CPUSGD(ps, lr=-1.0), ConfigError, r"tiermem: CPUSGD lr=-1.0 is invalid"),
        (lambda ps: CPUSGD(ps, momentum=0.0, nesterov=True), ConfigError, r"CPUSGD nesterov=True needs momentum > 0"),
        (lambda ps: CPUSGD(ps, momentun=0.9), ArgumentError, r"did you mean momentum="),
        (lambda ps: CPUAdagrad(ps, lr_decay=-0.1), ConfigError, r"tiermem: CPUAdagrad lr_decay=-0.1 is invalid"),
        (
            lambda ps: CPUAdagrad(ps, initial_accumulator_value=-1.0),
            ConfigError,
            r"initial_accumulator_value=-1.0 is invalid",
        ),
        (lambda ps: CPULion(ps, betas=(0.9, 1.5)), ConfigError, r"tiermem: CPULion beta2=1.5 is invalid"),
        (lambda ps: CPULion(ps, betas=0.9), ConfigError, r"CPULion betas=0.9 is invalid"),
        (lambda ps: CPUAdafactor(ps, beta2_decay=0.5), ConfigError, r"CPUAdafactor beta2_decay=0.5 is invalid"),
        (lambda ps: CPUAdafactor(ps, d=0.5), ConfigError, r"CPUAdafactor d=0.5 is invalid"),
        (lambda ps: CPUAdafactor(ps, eps=1e-3), ConfigError, r"CPUAdafactor eps=0.001 is invalid"),
        (lambda ps: CPUAdam8bit(ps, betas=(1.0, 0.9)), ConfigError, r"CPUAdam8bit betas=\(1.0, 0.9\) is invalid"),
        (lambda ps: CPUAdam8bit(ps, min_8bit_size=0), ConfigError, r"CPUAdam8bit min_8bit_size=0 is invalid"),
        (lambda ps: CPUAdam(ps, bf16_stochastic_round=1), ConfigError, r"bf16_stochastic_round=1 is invalid"),
        (lambda ps: CPUAdam(ps, sr_seed="x"), ConfigError, r"sr_seed='x' is invalid"),
    ],
)
def test_bad_arguments(make, error, match):
    with pytest.raises(error, match=match) as e:
        make([nn.Parameter(torch.zeros(2, 2))])
    assert str(e.value).startswith("tiermem:")


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_parameters_of_the_wrong_kind_are_refused(name):
    wrong = torch.float16 if name.endswith("bf16") else torch.bfloat16
    with pytest.raises(ConfigError, match=r"parameter on cpu of shape \(2,\); it updates fp32 CPU parameters only"):
        FACTORIES[name]([nn.Parameter(torch.zeros(2, dtype=wrong))])


def test_sparse_gradients_are_refused():
    emb = nn.Embedding(10, 3, sparse=True)
    opt = CPUSGD(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ConfigError, match="CPUSGD got a sparse gradient.*torch.optim optimizer that takes sparse"):
        opt.step()


@pytest.mark.parametrize(
    "ours, theirs",
    [(CPUSGD, torch.optim.SGD), (CPUAdagrad, torch.optim.Adagrad), (CPUAdafactor, torch.optim.Adafactor)],
    ids=["sgd", "adagrad", "adafactor"],
)
def test_the_signature_made_from_the_table_is_torchs(ours, theirs):
    def positional(cls):
        return [
            (p.name, p.default)
            for p in inspect.signature(cls).parameters.values()
            if p.kind is p.POSITIONAL_OR_KEYWORD and p.name not in ("foreach", "differentiable", "fused")
        ]

    assert positional(ours) == positional(theirs)
    assert inspect.signature(ours).parameters["maximize"].kind is inspect.Parameter.KEYWORD_ONLY
