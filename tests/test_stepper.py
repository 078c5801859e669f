"""The step against the homes' interface (NOTE [Homes]): wired by hand from its parts, with a
state home this library does not ship (a revertible in-memory one), to show that a new tier is
one class and that the step's failure handling holds for any home that says it can revert."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tiermem.optim
from tiermem import AdamW, Tier
from tiermem.memory.resident import DeviceStore, HostStore
from tiermem.observe.trace import Tracer
from tiermem.plan.buckets import STATE_PARTS
from tiermem.plan.placement import plan
from tiermem.policies import ZeroOffload
from tiermem.train.homes.bucket_homes import Homes
from tiermem.train.homes.grad_homes import MemoryGrads
from tiermem.train.homes.state_homes import MemoryState, StateHome
from tiermem.train.homes.uploads import Outputs
from tiermem.train.homes.weight_homes import DeviceWeights
from tiermem.train.layout import build
from tiermem.train.step.grads import GradCollector
from tiermem.train.step.scaler import LossScaler
from tiermem.train.step.stepper import Stepper
from tiermem.transfer.engine import TransferEngine

#: the one param group of _model(), as tm.optimizer shows it (the step reads each parameter's group by name)
HYPER = [
    {
        "lr": 1e-2,
        "betas": (0.9, 0.99),
        "eps": 1e-8,
        "weight_decay": 0.1,
        "adamw": True,
        "param_names": ["0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"],
    }
]


class SnapshotState(StateHome):
    """A new home: state in host memory that keeps each bucket's previous value, so a step can
    be undone (what NVMe does with two slots, without a disk)."""

    compute_tier = Tier.HOST
    revertible = True

    def __init__(self, buckets):
        self.now = {b.index: tuple(torch.zeros(b.numel) for _ in STATE_PARTS) for b in buckets}
        self.before: dict[int, tuple] = {}

    def initial_master(self, b):
        return self.now[b.index][0]

    def initialize(self, b):
        pass

    def step(self, plan, update, tracer, updated):
        done = []
        try:
            for b, runs in plan:
                self.before[b.index] = tuple(t.clone() for t in self.now[b.index])
                done.append(b.index)
                update(b, runs, self.now[b.index])
        except BaseException:
            self.revert(done)
            raise
        return done

    def revert(self, undo):
        for index in undo:
            for t, old in zip(self.now[index], self.before[index]):
                t.copy_(old)

    def read(self, b):
        return self.now[b.index]

    def load_views(self, b):
        return self.now[b.index]


def _model() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 5), nn.Linear(5, 3))


def _wire(module: nn.Module, snapshot_buckets: set[int]):
    """The step's collaborators, as TieredModel wires them, with buckets in ``snapshot_buckets``
    homed in SnapshotState and the rest in ordinary host memory."""
    stores = {Tier.DEVICE: DeviceStore("cpu"), Tier.HOST: HostStore()}
    engine = TransferEngine(stores, device=torch.device("cpu"))
    planned = plan(module, ZeroOffload(), AdamW(), torch.float32, 60)
    buckets = list(planned.buckets)
    host = MemoryGrads(stores[Tier.HOST], buckets, {b.index: Tier.HOST for b in buckets}, stores, engine)
    snap = SnapshotState([b for b in buckets if b.index in snapshot_buckets])
    mem = MemoryState(stores[Tier.HOST], [b for b in buckets if b.index not in snapshot_buckets])
    weights = DeviceWeights(stores[Tier.DEVICE], buckets, torch.float32, engine)
    homes = Homes(
        {b.index: host for b in buckets},
        {b.index: snap if b.index in snapshot_buckets else mem for b in buckets},
        {b.index: weights for b in buckets},
    )
    layout = build(
        module,
        buckets,
        buckets,
        planned.groups,
        planned.aliases,
        homes,
        stores,
        torch.float32,
        torch.device("cpu"),
        None,
    )
    grads = GradCollector(homes, layout.slot_of, engine, stores[Tier.DEVICE].ledger)
    for b in buckets:
        for s in b.slots:
            s.param.register_post_accumulate_grad_hook(grads.on_grad)
    outputs = Outputs(buckets, homes, stores, torch.float32, overlap=False, tracer=Tracer(None))
    stepper = Stepper(layout, grads, outputs, engine, LossScaler(enabled=False), grad_clip=1.0, tracer=Tracer(None))
    return stepper, grads, buckets


def _backward(module: nn.Module, grads: GradCollector, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    module(torch.randn(4, 7, generator=g)).square().mean().backward()
    grads.end_backward()


def _weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_a_new_state_home_trains_like_the_built_in_one():
    runs = []
    for snapshot in (set(), {0, 1, 2, 3, 4, 5}):
        module = _model()
        stepper, grads, buckets = _wire(module, snapshot)
        assert len(buckets) > 2
        for i in range(4):
            _backward(module, grads, i)
            assert not stepper.run(HYPER).skipped
        runs.append(_weights(module))
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


@pytest.mark.parametrize("fail_at", [1, 2, 4])
def test_a_failed_step_reverts_revertible_homes_and_a_retry_matches(monkeypatch, fail_at):
    """Bucket 0 lives in the revertible home, the rest in memory. Adam fails on its
    ``fail_at``-th call: the revertible bucket goes back (state and device weights), memory
    buckets already updated keep their update, and a retry ends where an unfailed step ends."""
    ref_module, tm_module = _model(), _model()
    ref, ref_grads, _ = _wire(ref_module, {0})
    tm, tm_grads, buckets = _wire(tm_module, {0})
    _backward(ref_module, ref_grads, 0)
    ref.run(HYPER)
    _backward(tm_module, tm_grads, 0)
    before = _weights(tm_module)
    real, calls = tiermem.optim.functional.adam_update, {"n": 0}  # the update TieredModel calls

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise RuntimeError("kernel failure")
        return real(*a, **k)

    monkeypatch.setattr(tiermem.optim.functional, "adam_update", flaky)
    with pytest.raises(RuntimeError, match="kernel failure"):
        tm.run(HYPER)
    snap = list(buckets[0].slots)
    after = _weights(tm_module)
    for s in snap:  # the revertible bucket's device weights are as before the step
        key = next(k for k in before if tm_module.get_parameter(k) is s.param)
        assert torch.equal(after[key], before[key])
    assert all(tm.param_steps()[s.name] == 0 for s in snap)  # its step counts went back too
    monkeypatch.setattr(tiermem.optim.functional, "adam_update", real)
    tm.run(HYPER)  # the retry
    want, got = _weights(ref_module), _weights(tm_module)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert tm.param_steps() == ref.param_steps()
