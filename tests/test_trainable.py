"""Freezing and unfreezing between steps (NOTE [Freezing and unfreezing]): gradual unfreezing
trains as torch does under every placement, a parameter frozen after training keeps its state,
an unfreeze that cannot be honoured is a ``tiermem:`` error that changes nothing, and checkpoints
follow. Oracle: torch's AdamW in a plain loop toggling the same ``requires_grad``, to rounding
(NOTE [Arithmetic tolerances] in tests/tolerance.py)."""

from __future__ import annotations

import pytest
import torch
from models import TinyGPT, gpt_batch, gpt_loss
from tolerance import adam_ratio, assert_adam_within, second_moments

from tiermem import (
    AdamW,
    Budgets,
    ConfigError,
    OutOfTierMemory,
    PerClass,
    Policy,
    TensorClass,
    Tier,
    TieredModel,
    TierMemError,
)
from tiermem.policies import KeepOnDevice, ZeroInfinity, ZeroOffload

EPOCHS, PER_EPOCH = 4, 2
HP = dict(lr=1e-2, steps=EPOCHS * PER_EPOCH, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


class Nvme(PerClass):
    """Grads and optimizer state on NVMe."""

    homes = {
        TensorClass.PARAM: Tier.DEVICE,
        TensorClass.ACTIVATION: Tier.DEVICE,
        TensorClass.GRAD: Tier.NVME,
        TensorClass.OPTIM_STATE: Tier.NVME,
    }


def schedule(m: TinyGPT) -> list[list[torch.nn.Module]]:
    """Gradual unfreezing: the head first (tied to the embedding), then one block per epoch from the top."""
    return [[m.ln_f, m.head], [m.blocks[1]], [m.blocks[0]], [m.wpe]]


def freeze_for(m: TinyGPT, epoch: int) -> None:
    m.requires_grad_(False)
    for mods in schedule(m)[: epoch + 1]:
        for mod in mods:
            mod.requires_grad_(True)


def torch_gradual(toggles=freeze_for) -> tuple[dict, dict]:
    """torch's for-loop AdamW: the weights, and its second moments (for NOTE [Arithmetic tolerances])."""
    torch.manual_seed(0)
    m = TinyGPT()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    step = 0
    for epoch in range(EPOCHS):
        toggles(m, epoch)
        for _ in range(PER_EPOCH):
            x, y = gpt_batch(step)
            gpt_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
            step += 1
    return m.state_dict(), second_moments(m, opt)


def tiered_gradual(policy=None, precision: str = "fp32", toggles=freeze_for, **kw) -> tuple[dict, TieredModel]:
    torch.manual_seed(0)
    m = TinyGPT()
    toggles(m, 0)
    tm = TieredModel(m, policy, optimizer=AdamW(lr=1e-2, weight_decay=0.1), precision=precision, bucket_size=2000, **kw)
    step = 0
    for epoch in range(EPOCHS):
        toggles(tm.module, epoch)
        for _ in range(PER_EPOCH):
            x, y = gpt_batch(step)
            tm.backward(gpt_loss(tm(x), y))
            tm.step()
            step += 1
    return tm.state_dict(), tm


def diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


POLICIES = {
    "zero-offload": ZeroOffload,
    "keep-on-device": KeepOnDevice,
    "grads-and-state-on-nvme": Nvme,
    "zero-infinity": ZeroInfinity,
    "split": lambda: ZeroOffload(device_fraction=0.5),
}


@pytest.fixture(scope="module")
def torch_run() -> tuple[dict, dict]:
    return torch_gradual()


@pytest.mark.numerics
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_gradual_unfreezing_trains_as_torch_does(tmp_path, torch_run, name):
    want, exp_avg_sq = torch_run
    got, tm = tiered_gradual(POLICIES[name](), nvme_dir=str(tmp_path))
    assert_adam_within(got, want, exp_avg_sq, **HP)
    assert not tm.layout.frozen  # every parameter has optimizer state now
    assert all(p.grad is None for p in tm.module.parameters())  # the grads went home, none piled up
    assert {n: s for n, s in tm.stepper.param_steps().items() if n.startswith("blocks.0.")} == {
        n: (EPOCHS - 2) * PER_EPOCH for n, _ in tm.module.named_parameters() if n.startswith("blocks.0.")
    }
    frozen_all_along, _ = torch_gradual(toggles=lambda m, e: freeze_for(m, 0))
    assert adam_ratio(frozen_all_along, want, exp_avg_sq, **HP) > 1000  # the unfrozen blocks trained


def test_gradual_unfreezing_is_bit_identical_across_policies(tmp_path):
    results = {}
    for name, policy in POLICIES.items():
        (tmp_path / name).mkdir()
        results[name], tm = tiered_gradual(policy(), precision="bf16", nvme_dir=str(tmp_path / name))
        tm.detach()
    first = results["zero-offload"]
    assert all(torch.equal(first[k], r[k]) for r in results.values() for k in first)


def test_unfreezing_under_overlap_step_trains():
    """overlap_step (one-step delayed update) has no torch oracle: unfreezing lands the update in
    flight first, then the new parameters train."""
    _, tm = tiered_gradual(overlap_step=True)
    assert not tm.layout.frozen and tm.stepper.param_steps()["wpe.weight"] == PER_EPOCH


def _refreeze(m: TinyGPT, epoch: int) -> None:
    """Block 0 trains, is frozen for an epoch, then trains again: its state carries over."""
    m.requires_grad_(True)
    if epoch == 2:
        m.blocks[0].requires_grad_(False)


@pytest.mark.numerics
def test_a_parameter_frozen_after_training_keeps_its_state():
    want, exp_avg_sq = torch_gradual(toggles=_refreeze)
    got, tm = tiered_gradual(toggles=_refreeze)
    assert_adam_within(got, want, exp_avg_sq, **HP)
    assert tm.stepper.param_steps()["blocks.0.fc.weight"] == (EPOCHS - 1) * PER_EPOCH


def test_unfreezing_waits_for_the_step_boundary_and_freezing_does_not():
    torch.manual_seed(0)
    m = TinyGPT()
    m.blocks[0].requires_grad_(False)
    tm = TieredModel(m, precision="fp32")
    x, y = gpt_batch(0)
    tm.backward(gpt_loss(tm(x), y))  # a first micro-batch
    m.blocks[0].requires_grad_(True)
    with pytest.raises(
        TierMemError,
        match=r"^tiermem: \['blocks\.0\..*'\]( and more)? were unfrozen while gradients of earlier "
        r"micro-batches wait for tm\.step\(\); unfreeze between steps",
    ):
        tm(x)
    m.blocks[0].requires_grad_(False)
    m.blocks[1].requires_grad_(False)  # freezing in the middle of accumulation: fine, as in torch
    tm.backward(gpt_loss(tm(x), y))
    assert not tm.step().skipped
    m.blocks[0].requires_grad_(True)  # after the step: taken
    tm.backward(gpt_loss(tm(x), y))
    tm.step()
    assert tm.stepper.param_steps()["blocks.0.fc.weight"] == 1


def _head_only() -> TinyGPT:
    torch.manual_seed(0)
    m = TinyGPT()
    m.requires_grad_(False)
    m.ln_f.requires_grad_(True)
    return m


def test_an_unfreeze_that_does_not_fit_is_refused_with_figures_and_changes_nothing():
    probe = TieredModel(_head_only(), precision="fp32")
    used = probe.stores[Tier.HOST].used  # what the model holds on the host with only ln_f trainable
    probe.detach()
    m = _head_only()
    tm = TieredModel(m, precision="fp32", budgets=Budgets(host=used + 8192))  # wte's state (3 x 888 x 4 B) won't fit
    x, y = gpt_batch(0)
    tm.backward(gpt_loss(tm(x), y))
    tm.step()
    before, held = tm.state_dict(), tm.stores[Tier.HOST].used
    m.wte.requires_grad_(True)
    with pytest.raises(OutOfTierMemory, match=r"^tiermem: .*<unfreezing wte\.weight>.*optimizer state"):
        tm(x)
    assert "wte.weight" in tm.layout.frozen and len(tm.layout.buckets) == 1 and tm.stores[Tier.HOST].used == held
    m.wte.requires_grad_(False)  # undone: training goes on as before
    tm.backward(gpt_loss(tm(x), y))
    tm.step()
    assert diff(tm.state_dict(), before) > 0


def test_a_parameter_unfrozen_that_no_group_holds_is_an_error_until_added():
    torch.manual_seed(0)
    m = TinyGPT()
    m.wpe.requires_grad_(False)
    tm = TieredModel(m, optimizer=AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2), precision="fp32")
    m.wpe.requires_grad_(True)
    x, y = gpt_batch(0)
    with pytest.raises(
        TierMemError,
        match=r"^tiermem: \['wpe\.weight'\] is to be trained but in no param group of "
        r"tm\.optimizer; add them with tm\.optimizer\.add_param_group",
    ):
        tm(x)
    assert "wpe.weight" in tm.layout.frozen
    tm.optimizer.add_param_group({"params": [m.wpe.weight], "lr": 1e-3})
    tm.backward(gpt_loss(tm(x), y))
    tm.step()
    assert tm.stepper.param_steps()["wpe.weight"] == 1


def test_a_policy_that_moves_an_unfrozen_parameters_weights_is_refused():
    class WeightsLeaveOnceTrainable(Policy):
        """Places wpe's weights on the host once it trains: not honoured (its weights stay where they are)."""

        def place(self, info):
            if info.kind is TensorClass.PARAM and info.name == "wpe.weight" and not frozen:
                return Tier.HOST
            return ZeroOffload().place(info)

    frozen = True
    m = TinyGPT()
    m.wpe.requires_grad_(False)
    tm = TieredModel(m, WeightsLeaveOnceTrainable(), precision="fp32")
    frozen = False
    m.wpe.requires_grad_(True)
    with pytest.raises(
        ConfigError,
        match=r"^tiermem: 'wpe\.weight' was unfrozen; the policy now places its weights "
        r"on .*host.*, but they live on .*device",
    ):
        tm(gpt_batch(0)[0])


def test_a_checkpoint_after_unfreezing_loads_once_the_same_parameters_are_unfrozen(tmp_path):
    _, tm = tiered_gradual()
    tm.save(str(tmp_path / "c.tm"))
    torch.manual_seed(0)
    m = TinyGPT()
    freeze_for(m, 0)
    fresh = TieredModel(m, optimizer=AdamW(lr=1e-2, weight_decay=0.1), precision="fp32")
    with pytest.raises(
        TierMemError,
        match=r"^tiermem: checkpoint .* holds optimizer state for \['blocks\.0\..*which "
        r"are frozen in this model.*Unfreeze them \(requires_grad_\(True\)\) before "
        r"tm\.load\(\)",
    ):
        fresh.load(str(tmp_path / "c.tm"))
    freeze_for(m, EPOCHS - 1)
    fresh.load(str(tmp_path / "c.tm"))
    for tiered in (tm, fresh):
        x, y = gpt_batch(100)
        tiered.backward(gpt_loss(tiered(x), y))
        tiered.step()
    assert diff(tm.state_dict(), fresh.state_dict()) == 0.0
