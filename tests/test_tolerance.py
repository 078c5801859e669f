"""The rule of tests/tolerance.py (NOTE [Arithmetic tolerances]) on fp32 AdamW: torch's other
correct kernels (foreach, fused) fall inside the bound on any CPU, and a wrong update falls outside
it: a learning rate 0.1% off, the weight decay missed on one parameter, one step missed."""

from __future__ import annotations

import pytest
import torch
from models import TinyGPT, gpt_batch, gpt_loss
from tolerance import adam_direction_bound, adam_ratio, assert_adam_within, second_moments, ulp

pytestmark = pytest.mark.numerics
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS = 3


def _torch(steps: int = STEPS, lr: float = HP["lr"], skip_decay: str | None = None, **impl):
    """TinyGPT after ``steps`` steps of torch's AdamW (``skip_decay``: one parameter in a group of its own without decay)."""
    torch.manual_seed(0)
    m = TinyGPT()
    named = dict(m.named_parameters())
    groups = [{"params": [p for n, p in named.items() if n != skip_decay]}]
    if skip_decay is not None:
        groups.append({"params": [named[skip_decay]], "weight_decay": 0.0})
    opt = torch.optim.AdamW(groups, lr=lr, betas=HP["betas"], eps=HP["eps"], weight_decay=HP["weight_decay"], **impl)
    for i in range(steps):
        x, y = gpt_batch(i)
        gpt_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    return m.state_dict(), second_moments(m, opt)


@pytest.fixture(scope="module")
def oracle():
    return _torch(foreach=False)


@pytest.mark.parametrize("impl", [{"foreach": True}, {"fused": True}])
def test_torchs_other_kernels_are_within_the_bound(oracle, impl):
    ref, v = oracle
    assert_adam_within(_torch(**impl)[0], ref, v, steps=STEPS, **HP)


@pytest.mark.parametrize(
    "wrong",
    [
        pytest.param(dict(lr=HP["lr"] * 1.001), id="lr-0.1%-off"),
        pytest.param(dict(skip_decay="blocks.0.fc.weight"), id="no-decay-on-one-parameter"),
        pytest.param(dict(steps=STEPS - 1), id="one-step-missed"),
    ],
)
def test_a_wrong_update_is_outside_the_bound(oracle, wrong):
    ref, v = oracle
    got = _torch(foreach=False, **wrong)[0]
    assert adam_ratio(got, ref, v, steps=STEPS, **HP) > 1.0


def test_the_pieces_of_the_bound():
    assert ulp(torch.tensor([1.0, 1.5, 2.0, 0.0])).tolist()[:3] == [2.0**-23, 2.0**-23, 2.0**-22]
    assert ulp(torch.tensor([0.0])).item() == torch.finfo(torch.float32).tiny * 2.0**-23
    assert adam_direction_bound(1) == pytest.approx(1.0)  # the first step moves by lr exactly
    assert 1.0 <= adam_direction_bound(STEPS, HP["betas"]) < 1.01
    assert adam_direction_bound(2, (0.9, 0.0)) == float("inf")  # beta2 = 0: m / |g| is unbounded
