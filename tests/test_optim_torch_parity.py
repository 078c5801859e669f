"""sgd_step, adagrad_step, lion_step and adafactor_step (the default, native path) against their
references: torch.optim.SGD / Adagrad / Adafactor, and for Lion the paper's update written here.

Two implementations of one update agree to rounding, whose size depends on the CPU (which products
each fuses into a multiply-add): the tolerances are NOTE [Arithmetic tolerances] (tests/tolerance.py)
or derived here, never a spread measured on the machine at hand:
* SGD: each step moves a weight by at most lr * |buffer|, the buffer a sum of gradients (and decay)
  weighted by at most 1 / (1 - momentum).
* Adagrad: each step moves a weight by at most lr (|g| / sqrt(sum) <= 1, the sum holding g**2), and
  adds at most max (|g| + wd * |p|)**2 to a sum.
* Adafactor: torch's for-loop and foreach kernels each take their reductions in fp32; ours in
  double. Against the same algorithm run by torch in float64 ("exact"), our error is at most theirs
  (plus an fp32 ulp of the result for the final rounding).
* Lion: the paper's ``p -= lr * (sign(c) + wd * p)`` rounds differently from decay-then-step, a few
  ulps of p per step; the sign is exact (c is never within an ulp of 0 on this data).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tolerance import assert_beyond, assert_within

from tiermem.optim import adafactor_step, adagrad_step, lion_step, sgd_step
from tiermem.optim.adafactor import state_numels

BF16, FP32 = torch.bfloat16, torch.float32
pytestmark = pytest.mark.numerics


def assert_bits_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{(a != b).sum().item()} elements differ"


def data(shape, seed, steps, grad_scale=0.1):
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(shape, generator=gen)
    return master, [torch.randn(shape, generator=gen) * grad_scale for _ in range(steps)]


def torch_run(cls, master, grads, kw, **impl):
    p = torch.nn.Parameter(master.clone())
    opt = cls([p], **kw, **impl)
    for g in grads:
        p.grad = g.clone().to(p.dtype)
        opt.step()
    return p.detach(), opt.state[p]


# -- SGD -----------------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 3000),
    momentum=st.sampled_from([0.0, 0.9]),
    dampening=st.sampled_from([0.0, 0.3]),
    nesterov=st.booleans(),
    weight_decay=st.sampled_from([0.0, 0.01]),
    maximize=st.booleans(),
    lr=st.sampled_from([0.1, 1e-3]),
    seed=st.integers(0, 2**16),
)
def test_sgd_matches_torch(n, momentum, dampening, nesterov, weight_decay, maximize, lr, seed):
    nesterov = nesterov and momentum > 0 and dampening == 0
    kw = dict(
        lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay, maximize=maximize
    )
    master, grads = data(n, seed, 15)
    p, buf = master.clone(), torch.zeros(n) if momentum else None
    for i, g in enumerate(grads):
        sgd_step(p, buf, g, step=i + 1, **kw)
    want, state = torch_run(torch.optim.SGD, master, grads, kw, foreach=False)
    step = _sgd_buffer_bound(grads, master, momentum, weight_decay)
    assert_within(p, want, steps=len(grads), step_size=lr * step)
    if momentum:
        assert_within(buf, state["momentum_buffer"], steps=len(grads), step_size=step)


def _sgd_buffer_bound(grads, master, momentum: float, weight_decay: float) -> float:
    """The largest |buffer| SGD can reach (so a step moves a weight by at most lr times it): each
    step adds at most |g| + wd * |w| (|w| within twice its start here), weighted down by momentum;
    nesterov adds momentum times the buffer again."""
    g = max(t.abs().max().item() for t in grads) + weight_decay * 2 * master.abs().max().item()
    return g * (1 + momentum) / (1 - momentum)


def test_sgd_bound_catches_a_lagging_step():
    master, grads = data(3000, 4, 15)
    kw = dict(lr=0.1, momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.01, maximize=False)
    want, _ = torch_run(torch.optim.SGD, master, grads, kw, foreach=False)
    lagging, _ = torch_run(torch.optim.SGD, master, grads[:-1], kw, foreach=False)
    assert_beyond(lagging, want, steps=15, step_size=0.1 * _sgd_buffer_bound(grads, master, 0.9, 0.01))


# -- Adagrad -------------------------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 3000),
    lr_decay=st.sampled_from([0.0, 0.01]),
    weight_decay=st.sampled_from([0.0, 0.01]),
    init=st.sampled_from([0.0, 0.1]),
    maximize=st.booleans(),
    eps=st.sampled_from([1e-10, 1e-3]),
    seed=st.integers(0, 2**16),
)
def test_adagrad_matches_torch(n, lr_decay, weight_decay, init, maximize, eps, seed):
    steps, lr = 20, 0.05
    kw = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps, maximize=maximize)
    master, grads = data(n, seed, steps)
    p, state_sum = master.clone(), torch.full((n,), init)
    for i, g in enumerate(grads):
        adagrad_step(p, state_sum, g, step=i + 1, **kw)
    want, state = torch_run(
        torch.optim.Adagrad, master, grads, {**kw, "initial_accumulator_value": init}, foreach=False
    )
    assert_within(p, want, steps=steps, step_size=lr)  # |g| / sqrt(sum) <= 1: a step moves p by lr at most
    # each step adds (g + wd * p)**2 to a sum (|p| within twice its start here)
    added = (max(g.abs().max().item() for g in grads) + weight_decay * 2 * master.abs().max().item()) ** 2
    assert_within(state_sum, state["sum"], steps=steps, step_size=added)


def test_adagrad_tolerance_catches_a_lagging_step():
    master, grads = data(3000, 1, 6)
    kw = dict(lr=0.05, lr_decay=0.0, weight_decay=0.0, eps=1e-10)
    want, _ = torch_run(torch.optim.Adagrad, master, grads, kw, foreach=False)
    fused, _ = torch_run(torch.optim.Adagrad, master, grads, kw, fused=True)
    lagging, _ = torch_run(torch.optim.Adagrad, master, grads[:-1], kw, foreach=False)
    assert_within(fused, want, steps=6, step_size=0.05)  # torch's other kernel: within
    assert_beyond(lagging, want, steps=6, step_size=0.05)


# -- Lion ----------------------------------------------------------------------------------------------
def paper_lion(master, grads, lr, beta1, beta2, wd):
    """Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2, as written there."""
    p, m = master.clone(), torch.zeros_like(master)
    for g in grads:
        c = beta1 * m + (1 - beta1) * g
        p = p - lr * (torch.sign(c) + wd * p)
        m = beta2 * m + (1 - beta2) * g
    return p, m


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 3000),
    lr=st.sampled_from([1e-4, 3e-3]),
    betas=st.sampled_from([(0.9, 0.99), (0.95, 0.98)]),
    wd=st.sampled_from([0.0, 0.1, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_lion_matches_the_paper(n, lr, betas, wd, seed):
    steps = 15
    master, grads = data(n, seed, steps)
    p, m = master.clone(), torch.zeros(n)
    for i, g in enumerate(grads):
        lion_step(p, m, g, step=i + 1, lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=wd)
    want_p, want_m = paper_lion(master, grads, lr, *betas, wd)
    ulp = torch.finfo(FP32).eps
    torch.testing.assert_close(p, want_p, rtol=4 * steps * ulp, atol=4 * steps * ulp * lr)
    # m is a moving average that can cross 0: its error is relative to the terms summed, not to m
    g_max = max(g.abs().max().item() for g in grads)
    torch.testing.assert_close(m, want_m, rtol=2 * steps * ulp, atol=2 * steps * ulp * g_max)


def test_lion_tolerance_catches_a_lagging_step():
    master, grads = data(3000, 2, 8)
    want, _ = paper_lion(master, grads, 3e-3, 0.9, 0.99, 0.1)
    lagging, _ = paper_lion(master, grads[:-1], 3e-3, 0.9, 0.99, 0.1)
    ulp = torch.finfo(FP32).eps
    with pytest.raises(AssertionError):
        torch.testing.assert_close(lagging, want, rtol=4 * 8 * ulp, atol=4 * 8 * ulp * 3e-3)


# -- Adafactor -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(3000,), (37, 53), (3, 20, 30), (200, 1500)])
@pytest.mark.parametrize(
    "kw",
    [
        dict(lr=1e-2, weight_decay=0.01),
        dict(lr=0.3, eps=(1e-6, 1e-2), d=1.5, maximize=True),
        dict(lr=1e-2, beta2_decay=-0.5),
    ],
)
def test_adafactor_error_is_at_most_torchs(shape, kw):
    steps = 12
    master, grads = data(shape, 3, steps)
    eps1, eps2 = kw.get("eps", (None, 1e-3))
    ours = master.clone()
    state = {k: torch.zeros(v) for k, v in state_numels(shape).items()}
    for i, g in enumerate(grads):
        adafactor_step(
            ours,
            g,
            step=i + 1,
            lr=kw["lr"],
            beta2_decay=kw.get("beta2_decay", -0.8),
            eps1=eps1,
            eps2=eps2,
            d=kw.get("d", 1.0),
            weight_decay=kw.get("weight_decay", 0.0),
            maximize=kw.get("maximize", False),
            **state,
        )
    exact, exact_state = torch_run(
        torch.optim.Adafactor, master.double(), [g.double() for g in grads], kw, foreach=False
    )
    torch_errors = [
        (torch_run(torch.optim.Adafactor, master, grads, kw, **impl)[0].double() - exact).abs().max().item()
        for impl in (dict(foreach=False), dict(foreach=True))
    ]
    ulp = torch.finfo(FP32).eps * exact.abs().max().item()
    assert (ours.double() - exact).abs().max().item() <= max(torch_errors) + ulp
    for name, value in state.items():  # the second moment's statistics, to fp32 rounding of their sums
        torch.testing.assert_close(value, exact_state[name].float().reshape(-1), rtol=1e-5, atol=0.0)


def test_adafactor_bound_catches_a_lagging_step():
    master, grads = data((200, 1500), 3, 6)
    kw = dict(lr=1e-2)
    exact, _ = torch_run(torch.optim.Adafactor, master.double(), [g.double() for g in grads], kw, foreach=False)
    lagging, _ = torch_run(torch.optim.Adafactor, master, grads[:-1], kw, foreach=False)
    mine, _ = torch_run(torch.optim.Adafactor, master, grads, kw, foreach=False)
    assert (lagging.double() - exact).abs().max() > 10 * (mine.double() - exact).abs().max()
