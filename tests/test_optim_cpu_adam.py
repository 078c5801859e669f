"""CPUAdam as a drop-in torch optimizer: against torch.optim.AdamW/Adam with param groups and an lr
scheduler, state_dict round trips (bit-identical resume), skipped steps, and the errors it raises."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from tiermem import ConfigError
from tiermem.optim import CPUAdam

STEPS = 12
# As in test_optim.py: the only deviation from torch is one rounding of a square root per element and
# step, so weights agree to a relative 2**-22 per step; AdamW's moments agree bit for bit.
TOL = STEPS * 2.0**-22


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(13, 31), nn.Tanh(), nn.Linear(31, 7), nn.LayerNorm(7))


def groups(m: nn.Module) -> list[dict]:
    """Two groups with their own hyperparameters (a usual split: no decay on biases and norms)."""
    decay = [p for n, p in m.named_parameters() if n.endswith("weight") and p.dim() == 2]
    rest = [p for n, p in m.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": rest, "weight_decay": 0.0, "lr": 3e-3, "betas": (0.8, 0.99)},
    ]


def train(m: nn.Module, opt, sched, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 13, generator=gen)
        y = torch.randn(16, 7, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        sched.step()


def scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # lr changes every step


@pytest.mark.parametrize("adamw", [True, False])
def test_matches_torch_with_groups_and_a_scheduler(adamw):
    ours_m, theirs_m = model(), model()
    ours = CPUAdam(groups(ours_m), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05, adamw=adamw)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    theirs = cls(groups(theirs_m), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05, foreach=False)
    train(ours_m, ours, scheduler(ours), STEPS)
    train(theirs_m, theirs, scheduler(theirs), STEPS)
    assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in theirs.param_groups]
    for p, q in zip(ours_m.parameters(), theirs_m.parameters()):
        torch.testing.assert_close(p, q, rtol=TOL, atol=TOL * 4e-2)
        a, b = ours.state[p], theirs.state[q]
        assert set(a) == {"step", "exp_avg", "exp_avg_sq"} and torch.equal(a["step"], b["step"])
        # the gradients come through the loss from weights that may differ in their last ulp
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"], rtol=TOL, atol=TOL * b["exp_avg"].abs().max().item())
        torch.testing.assert_close(
            a["exp_avg_sq"], b["exp_avg_sq"], rtol=TOL, atol=TOL * b["exp_avg_sq"].abs().max().item()
        )


def test_state_dict_round_trip_resumes_bit_identically():
    k, rest = 5, 7
    m1 = model()
    opt1 = CPUAdam(groups(m1), lr=1e-2, weight_decay=0.05)
    s1 = scheduler(opt1)
    train(m1, opt1, s1, k + rest)  # uninterrupted

    m2 = model()
    opt2 = CPUAdam(groups(m2), lr=1e-2, weight_decay=0.05)
    s2 = scheduler(opt2)
    train(m2, opt2, s2, k)
    blob = io.BytesIO()
    torch.save({"model": m2.state_dict(), "opt": opt2.state_dict(), "sched": s2.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob)
    m3 = model(seed=99)  # fresh weights, fresh optimizer: everything comes from the checkpoint
    m3.load_state_dict(saved["model"])
    opt3 = CPUAdam(groups(m3), lr=1e-2, weight_decay=0.05)
    s3 = scheduler(opt3)  # the usual order: build both, then load both
    opt3.load_state_dict(saved["opt"])
    s3.load_state_dict(saved["sched"])
    gen = torch.Generator().manual_seed(1)
    for _ in range(k):  # the data stream continues where it stopped
        torch.randn(16, 13, generator=gen), torch.randn(16, 7, generator=gen)
    for _ in range(rest):
        x, y = torch.randn(16, 13, generator=gen), torch.randn(16, 7, generator=gen)
        opt3.zero_grad()
        nn.functional.mse_loss(m3(x), y).backward()
        opt3.step()
        s3.step()
    for p, q in zip(m1.parameters(), m3.parameters()):
        assert torch.equal(p, q)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt1.state[p][key], opt3.state[q][key])


def test_loads_a_torch_adamw_state_dict():
    m_t, m_o = model(), model()
    theirs = torch.optim.AdamW(m_t.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    train(m_t, theirs, scheduler(theirs), 3)
    m_o.load_state_dict(m_t.state_dict())
    ours = CPUAdam(m_o.parameters(), lr=1e-2, adamw=False)  # the checkpoint says AdamW: it wins
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    assert all(g["adamw"] is True for g in ours.param_groups)
    train(m_t, theirs, scheduler(theirs), 4, seed=5)
    train(m_o, ours, scheduler(ours), 4, seed=5)
    for p, q in zip(m_o.parameters(), m_t.parameters()):
        torch.testing.assert_close(p, q, rtol=7 * 2.0**-22, atol=7 * 2.0**-22 * 4e-2)


def test_nonfinite_gradient_skips_the_whole_step():
    m = model()
    opt = CPUAdam(m.parameters(), lr=1e-2, weight_decay=0.1)
    train(m, opt, scheduler(opt), 2)
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
    last.grad[0] = 0.0
    opt.step()
    assert not opt.last_step_skipped and opt.state[last]["step"].item() == 3


def test_parameters_without_grad_and_closure():
    a, b = nn.Parameter(torch.ones(5)), nn.Parameter(torch.ones(3))
    opt = CPUAdam([a, b], lr=0.1)

    def closure():
        loss = (a * 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 10.0
    assert torch.equal(b, torch.ones(3)) and b not in opt.state  # like torch: untouched, no state
    assert (a < 1).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), r"CPUAdam lr=-1.0 is invalid"),
        (dict(lr=math.inf), r"CPUAdam lr=inf is invalid"),
        (dict(betas=(0.9, 1.0)), r"CPUAdam betas=\(0.9, 1.0\) is invalid.*\[0, 1\)"),
        (dict(betas=0.9), r"CPUAdam betas=0.9 is invalid.*two numbers"),
        (dict(eps=-1.0), r"CPUAdam eps=-1.0 is invalid"),
        (dict(weight_decay=-0.1), r"CPUAdam weight_decay=-0.1 is invalid"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ConfigError, match=match) as e:
        CPUAdam([nn.Parameter(torch.zeros(2))], **kwargs)
    assert str(e.value).startswith("tiermem:")


@pytest.mark.parametrize(
    "name, value, accepted",
    [
        ("lr", 0.0, True),
        ("lr", -1e-3, False),
        ("lr", math.inf, False),
        ("lr", math.nan, False),
        ("lr", "0.1", False),
        ("beta1", 0.0, True),
        ("beta1", 0.999, True),
        ("beta1", 1.0, False),
        ("beta1", -0.1, False),
        ("beta2", math.nan, False),
        ("eps", 0.0, True),
        ("eps", -1e-8, False),
        ("eps", math.inf, False),
        ("weight_decay", 0.5, True),
        ("weight_decay", -0.1, False),
        ("weight_decay", math.inf, False),
    ],
)
def test_one_rule_for_every_adam(name, value, accepted):
    """NOTE [Adam hyperparameter rules]: the AdamW spec, CPUAdam and adam_step accept and refuse the
    same values, each naming itself, the hyperparameter and the value."""
    from tiermem import AdamW
    from tiermem.optim.adam_hyper import AdamHyper

    betas = {"beta1": lambda v: (v, 0.999), "beta2": lambda v: (0.9, v)}
    kw = {"betas": betas[name](value)} if name in betas else {name: value}
    hyper = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    makers = {
        r"AdamW\.": lambda: AdamW(**kw),
        "CPUAdam ": lambda: CPUAdam([nn.Parameter(torch.zeros(2))], **kw),
        "adam_step ": lambda: AdamHyper(**{**hyper, name: value}),
    }
    for where, make in makers.items():
        if accepted:
            make()
            continue
        shown = "betas" if name in betas and where != "adam_step " else name
        with pytest.raises(ConfigError, match=rf"^tiermem: {where}{shown}=.* is invalid: it must be "):
            make()


def test_bad_parameters_and_grads():
    with pytest.raises(ConfigError, match=r"torch.bfloat16 parameter on cpu.*fp32 CPU parameters only"):
        CPUAdam([nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))])
    opt = CPUAdam([nn.Parameter(torch.zeros(2))])
    with pytest.raises(ConfigError, match=r"betas=\(2.0, 0.9\) is invalid"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "betas": (2.0, 0.9)})
    assert len(opt.param_groups) == 1  # a refused group is not added
    emb = nn.Embedding(10, 3, sparse=True)
    opt = CPUAdam(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ConfigError, match="sparse gradient.*SparseAdam"):
        opt.step()
