"""Activations against the device budget: the refusal when a batch's activations do not fit
(NOTE [Activations that do not fit] in tiermem/memory/ledger.py), and the built-in policies'
``device_reserve``, which refuses such a layout up front (NOTE [Device reserve] in tiermem/plan/policy.py)."""

from __future__ import annotations

import gc

import pytest
import torch
from models import TinyGPT, gpt_batch, gpt_loss

from tiermem import AdamW, Budgets, ConfigError, OutOfTierMemory, TensorClass, Tier, TieredModel
from tiermem.errors import fmt_bytes
from tiermem.plan.policy import over_reserve
from tiermem.policies import Auto, KeepOnDevice, ZeroOffload
from tiermem.policies.auto import Verdict

D = Tier.DEVICE


def _tm(policy, device=None) -> TieredModel:
    torch.manual_seed(0)
    return TieredModel(
        TinyGPT(d=64), policy, optimizer=AdamW(lr=1e-2), precision="bf16", grad_clip=1.0, budgets=Budgets(device=device)
    )


def _steps(tm: TieredModel, seeds) -> list[float]:
    losses = []
    for seed in seeds:
        x, y = gpt_batch(seed)  # 3 sequences
        loss = gpt_loss(tm(x), y)
        tm.backward(loss)
        tm.step()
        losses.append(loss.item())
    return losses


def _layout_bytes(policy) -> int:
    """The device bytes ``policy``'s layout takes at construction (no budget)."""
    return _tm(policy).report().peak_bytes[D]


def test_activations_that_do_not_fit_say_so_and_lose_nothing():
    policy = ZeroOffload(device_fraction=0.75)
    held = _layout_bytes(policy)
    tm = _tm(policy, device=held + 120_000)  # the layout fits; 3 sequences' activations do, 64 do not
    ledger = tm.stores[D].ledger
    before = dict(ledger.kind_used)
    x, _ = gpt_batch(0, batch=64)
    with pytest.raises(
        OutOfTierMemory,
        match=(
            r"^tiermem: out of device memory placing 'activations saved for backward': asked .* allowed; "
            r"the activations of this batch did not fit beside what the device holds \(weights .*, grads .*, "
            r"optimizer state .*\); use a smaller batch .*ActivationOffload.*device_fraction.*gradient "
            r"checkpointing.*Budgets\(device=\.\.\.\)$"
        ),
    ) as e:
        tm(x)
    n = sum(p.numel() for p in TinyGPT(d=64).parameters())
    assert f"weights {fmt_bytes(2 * n)}" in str(e.value)  # what the device holds, by class
    assert f"optimizer state {fmt_bytes(before[TensorClass.OPTIM_STATE])}" in str(e.value)
    assert e.value.used + e.value.asked > e.value.allowed == held + 120_000
    del e  # its traceback's frames hold the refused forward's tensors, and so their bytes
    gc.collect()
    # nothing stored is lost: the refused forward's activations are gone, and a smaller batch trains
    # exactly as a model that never saw the refused one
    assert ledger.used == held and ledger.kind_used.get(TensorClass.ACTIVATION, 0) == 0
    assert _steps(tm, range(3)) == _steps(_tm(policy, device=held + 120_000), range(3))


def test_a_device_reserve_refuses_the_layout_up_front():
    """The layout fits the device, but leaves less than device_reserve of it for activations: refused
    before anything is allocated, saying what to change; a reserve the layout leaves trains."""
    held = _layout_bytes(ZeroOffload(device_fraction=0.75))
    budget = held + 120_000
    reserve = 0.5  # more than the 120 KB the layout leaves
    with pytest.raises(
        OutOfTierMemory,
        match=r"^tiermem: out of device memory placing '<model working set>': "
        r"asked .*device_reserve=0.5\): the rest is kept for activations "
        r".*; lower device_fraction, lower device_reserve",
    ) as e:
        _tm(ZeroOffload(device_fraction=0.75, device_reserve=reserve), device=budget)
    # asked: the layout's footprint on the device (what it holds, and a grad in flight while backward runs)
    assert held <= e.value.asked <= budget and e.value.allowed == int(budget * (1 - reserve))
    tm = _tm(ZeroOffload(device_fraction=0.75, device_reserve=0.05), device=budget)
    assert len(_steps(tm, range(2))) == 2
    with pytest.raises(OutOfTierMemory, match=r"device_reserve=0.5\).*offload the optimizer state"):
        _tm(KeepOnDevice(device_reserve=0.5), device=_layout_bytes(KeepOnDevice()) + 120_000)


def test_one_reserve_rule_for_auto_and_the_builtins():
    """Auto keeps out of the same share the built-ins check: the device share it chooses under a
    reserve is one ZeroOffload's check accepts with that reserve, and Auto's verdict on a candidate
    over it is the rule's words."""
    budget = _layout_bytes(ZeroOffload()) + 290_000  # some device shares fit the budget, not its 70%
    tm = _tm(
        Auto(
            profile={
                "device": {"accelerator": "a GPU", "h2d_GBps": 25, "d2h_GBps": 25},
                "host": {"copy_GBps": 20},
                "nvme": {"read_GBps": 2, "write_GBps": 1.5},
                "adam": {"tiermem_Gparams_per_s": 1.5, "device_Gparams_per_s": 60},
            },
            device_reserve=0.3,
        ),
        device=budget,
    )
    need = tm.placement.chosen.evaluation.need[D]
    assert over_reserve(need, {D: budget}, 0.3) is None
    refused = [c for c in tm.placement.choices if "device_reserve=0.3" in c.why]
    assert refused and all(
        c.outcome is Verdict.DOES_NOT_FIT and c.why == over_reserve(c.evaluation.need[D], {D: budget}, 0.3)
        for c in refused
    )


def test_over_reserve_by_hand():
    assert over_reserve(900, {D: 1000}, 0.1) is None
    assert (
        over_reserve(901, {D: 1000}, 0.1) == "the device needs 901 B, more than 90% of its 1000 B (device_reserve=0.1)"
    )
    assert over_reserve(10**12, {}, 0.5) is None  # no device limit: nothing to keep a share of


@pytest.mark.parametrize(
    "make",
    [
        lambda r: ZeroOffload(device_reserve=r),
        lambda r: KeepOnDevice(device_reserve=r),
        lambda r: Auto(device_reserve=r),
    ],
)
@pytest.mark.parametrize("value", [1.0, -0.1, True, "0.1"])
def test_bad_reserves_are_refused(make, value):
    with pytest.raises(
        ConfigError,
        match=r"^tiermem: (ZeroOffload|KeepOnDevice|Auto)\.device_reserve=.* is "
        r"invalid: the share of the device left for activations",
    ):
        make(value)
