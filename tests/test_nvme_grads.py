"""Gradients homed on NVMe: same numbers as on the host, with micro-batches and parameters that
get no gradient; host memory holds buckets in flight, not every gradient."""

from __future__ import annotations

import pytest
import torch
from models import Quirky, TinyGPT, disk_fills_up, gpt_batch, gpt_loss, same_state

from tiermem import AdamW, ConfigError, Phase, StoreError, TensorClass, Tier, TieredModel
from tiermem.plan.policy import PerClass
from tiermem.policies import ZeroOffload


class GradsOnNvme(PerClass):
    homes = {
        TensorClass.PARAM: Tier.DEVICE,
        TensorClass.ACTIVATION: Tier.DEVICE,
        TensorClass.GRAD: Tier.NVME,
        TensorClass.OPTIM_STATE: Tier.HOST,
    }


class EverythingOnNvme(PerClass):
    homes = {
        TensorClass.PARAM: Tier.NVME,
        TensorClass.ACTIVATION: Tier.NVME,
        TensorClass.GRAD: Tier.NVME,
        TensorClass.OPTIM_STATE: Tier.NVME,
    }


def _run(policy, tmp, precision="bf16", accum=1, quirky=False, steps=4):
    torch.manual_seed(21)
    model = Quirky() if quirky else TinyGPT(n_layer=3)
    tm = TieredModel(
        model,
        policy,
        optimizer=AdamW(lr=1e-2, weight_decay=0.1),
        precision=precision,
        grad_clip=0.5,
        bucket_size=2500,
        nvme_dir=str(tmp) if tmp else None,
    )
    losses = []
    for i in range(steps):
        for j in range(accum):
            if quirky:
                g = torch.Generator().manual_seed(10 * i + j)
                y, z = tm(torch.randn(8, 13, generator=g), use_branch=(i + j) % 2 == 1)
                loss = y.float().pow(2).mean() + (z.float().mean() if z is not None else 0)
            else:
                x, yy = gpt_batch(10 * i + j)
                loss = gpt_loss(tm(x), yy)
            tm.backward(loss)
            losses.append(loss.item())
        tm.step()
    return losses, tm.state_dict(), tm


@pytest.mark.parametrize("precision, accum, quirky", [("bf16", 1, False), ("fp16", 3, False), ("fp32", 2, True)])
@pytest.mark.parametrize("policy", [GradsOnNvme(), EverythingOnNvme()], ids=["grads", "everything"])
def test_grads_on_nvme_give_identical_numbers(tmp_path, policy, precision, accum, quirky):
    ref_losses, ref_sd, _ = _run(ZeroOffload(), None, precision, accum, quirky)
    losses, sd, tm = _run(policy, tmp_path, precision, accum, quirky)
    assert losses == ref_losses
    assert same_state(sd, ref_sd)
    rep = tm.report()
    assert rep.class_peak_bytes[(TensorClass.GRAD, Tier.NVME)] > 0
    assert rep.class_bytes_moved[(TensorClass.GRAD, Tier.HOST, Tier.NVME)] > 0


def test_host_holds_grads_only_in_flight(tmp_path):
    _, _, tm = _run(GradsOnNvme(), tmp_path)
    n, pages = tm.layout.n_params, 4096 * len(tm.layout.buckets)
    host = tm.stores[Tier.HOST].ledger
    assert host.kind_used[TensorClass.GRAD] == 0  # between steps no grad stays on the host (ZeroOffload: 4 B/param)
    assert 0 < host.kind_peak[TensorClass.GRAD] <= 4 * n + pages  # at worst, every bucket in flight at once
    _, _, ref = _run(ZeroOffload(), None)
    assert ref.stores[Tier.HOST].ledger.kind_used[TensorClass.GRAD] >= 4 * n


def test_failed_grad_flush_surfaces_and_state_is_unchanged(tmp_path):
    _, _, tm = _run(GradsOnNvme(), tmp_path, steps=1)
    before = tm.state_dict()
    x, y = gpt_batch(99)
    with disk_fills_up(tm.stores[Tier.NVME], after=0):
        with pytest.raises(StoreError, match="(?i)no space left"):  # in backward or at the step
            tm.backward(gpt_loss(tm(x), y))
            tm.step()
    after = tm.state_dict()
    assert same_state(before, after)
    assert tm.phase is Phase.IDLE  # the partial grads were dropped: a retry cannot step on a mix
    tm.backward(gpt_loss(tm(x), y))  # backward again, and training goes on
    assert not tm.step().skipped


def test_grads_on_nvme_refuse_overlap_step(tmp_path):
    with pytest.raises(ConfigError, match="overlap_step=True cannot be combined with grads on NVMe"):
        TieredModel(TinyGPT(), GradsOnNvme(), nvme_dir=str(tmp_path), overlap_step=True)


def test_a_backward_that_stops_early_never_steps_on_old_grads(tmp_path):
    """Step 2's backward raises half way: its grads are dropped; the next step uses only the
    grads of a complete backward (same numbers as ZeroOffload doing the same)."""
    results = []
    for policy, tmp in ((ZeroOffload(), None), (GradsOnNvme(), tmp_path)):
        torch.manual_seed(22)
        tm = TieredModel(
            TinyGPT(n_layer=3),
            policy,
            optimizer=AdamW(lr=1e-2),
            precision="fp32",
            bucket_size=2500,
            nvme_dir=str(tmp) if tmp else None,
        )
        for i in range(3):
            x, y = gpt_batch(i)
            if i == 1:
                handle = tm.module.blocks[1].register_full_backward_hook(lambda *a: 1 / 0)
                with pytest.raises(ZeroDivisionError):
                    tm.backward(gpt_loss(tm(x), y))
                handle.remove()
                assert tm.phase is Phase.IDLE  # the step's grads were dropped
            tm.backward(gpt_loss(tm(x), y))
            tm.step()
        results.append(tm.state_dict())
    assert same_state(results[0], results[1])
