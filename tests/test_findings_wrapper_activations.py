"""Activations that are wrapper tensor subclasses (DTensor, float8, any ``__torch_dispatch__`` wrapper)
are placed through the plain tensors they wrap, or, when the class cannot say what those are, counted
in tm.report() and a policy that asks to move them is told so in the log (issue 32; NOTE [Wrapper
subclasses] in tiermem/train/activations.py). The wrappers are small ones defined here."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from tiermem import TensorClass, Tier, TieredModel
from tiermem.plan.policy import Policy
from tiermem.policies import KeepOnDevice

ACT = TensorClass.ACTIVATION
BATCH, WIDTH = 16, 96  # a wrapped activation: 16 * 96 * 4 = 6 KiB, above MIN_OFFLOAD_BYTES


class Opaque(torch.Tensor):
    """A wrapper subclass around one plain tensor: every op runs on the inner tensor and wraps its
    result. It does not say what it wraps (no __tensor_flatten__)."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), dtype=inner.dtype, device=inner.device
        )

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = pytree.tree_map_only(Opaque, lambda t: t.inner, (args, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, cls, func(*unwrap[0], **unwrap[1]))


class Flat(Opaque):
    """The same wrapper, saying what it wraps, as torch.compile asks of one."""

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Flat(inner["inner"])


def _into(cls):
    class Into(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return cls(x.clone())

        @staticmethod
        def backward(ctx, g):
            return g.inner if isinstance(g, Opaque) else g

    return Into


class _Out(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        ctx.cls = type(w)
        return w.inner.clone()

    @staticmethod
    def backward(ctx, g):
        return ctx.cls(g)


class Wrapped(nn.Module):
    """Its activations are wrapper tensors of class ``cls`` (tanh saves its result, mul both operands);
    ``cls=None``: the same arithmetic on plain tensors."""

    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    def forward(self, h):
        if self.cls is not None:
            h = _into(self.cls).apply(h)
        h = torch.tanh(h) * h
        return _Out.apply(h) if self.cls is not None else h


class Net(nn.Module):
    def __init__(self, cls):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.wrapped, self.fc2 = nn.Linear(WIDTH, WIDTH), Wrapped(cls), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.fc2(self.wrapped(self.fc1(x)))


class _WrappedOnHost(Policy):
    """KeepOnDevice, with the activations saved inside module ``wrapped`` on the host."""

    def place(self, info):
        if info.kind is ACT:
            return Tier.HOST if info.module == "wrapped" else Tier.DEVICE
        return KeepOnDevice().place(info)


def _train(cls, policy, steps=2):
    tm = TieredModel(Net(cls), policy, precision="fp32")
    peaks, losses = [], []
    for i in range(steps):
        torch.manual_seed(100 + i)
        loss = tm(torch.randn(BATCH, WIDTH)).square().mean()
        peaks.append(tm.stores[Tier.DEVICE].ledger.kind_used[ACT])  # saved for backward, counted
        tm.backward(loss)
        tm.step()
        losses.append(loss.item())
    return tm, losses, peaks


def test_wrapped_activations_count_as_the_bytes_they_wrap():
    plain, plain_losses, plain_used = _train(None, KeepOnDevice())
    tm, losses, used = _train(Flat, KeepOnDevice())
    assert used == plain_used and used[0] > 0  # the same storages, counted on the device ledger
    assert tm.activations.stats.wrapped == 3 * 2  # tanh's result, mul's two operands, per step
    assert losses == plain_losses
    assert all(torch.equal(tm.state_dict()[k], v) for k, v in plain.state_dict().items())


def test_wrapped_activations_move_where_the_policy_places_them():
    ref, ref_losses, _ = _train(Flat, KeepOnDevice())
    tm, losses, _ = _train(Flat, _WrappedOnHost())
    stats = tm.activations.stats
    assert dict(stats.by_module) == {"wrapped": 2 * 2}  # two storages (tanh's result, h) per step
    assert stats.offloaded_bytes[Tier.HOST] == 2 * 2 * BATCH * WIDTH * 4
    assert losses == ref_losses  # placement never changes the numbers
    assert all(torch.equal(tm.state_dict()[k], v) for k, v in ref.state_dict().items())


def test_wrappers_that_do_not_flatten_are_counted_and_a_policy_moving_them_is_told(caplog):
    ref, ref_losses, _ = _train(Flat, KeepOnDevice())
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        tm, losses, _ = _train(Opaque, _WrappedOnHost())
    cls = f"{__name__}.Opaque"
    said = [r.getMessage() for r in caplog.records if cls in r.getMessage()]
    assert len(said) == 1 and "places them on host" in said[0] and "__tensor_flatten__" in said[0]  # once
    report = tm.report()
    assert report.activations_unplaced == {cls: 3 * 2}
    assert f"{cls} x6" in str(report)
    assert losses == ref_losses


@pytest.mark.parametrize("policy", [KeepOnDevice(), _WrappedOnHost()], ids=["device", "host"])
def test_nothing_is_said_of_wrappers_that_flatten(policy, caplog):
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        tm, _, _ = _train(Flat, policy)
    assert tm.report().activations_unplaced == {}
    assert not [r for r in caplog.records if "__tensor_flatten__" in r.getMessage()]
