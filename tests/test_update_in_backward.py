"""update_in_backward=True (NOTE [Updates in backward]): the same bits as the default step, with
the grads at rest a window of buckets."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from typing import Iterable

import pytest
import torch
from models import Quirky, TinyGPT, gpt_batch, gpt_loss, same_state
from test_nvme_state import StateOnNvme, _files_fail

from tiermem import (
    AdamW,
    AdamW8bit,
    Budgets,
    ConfigError,
    LossScale,
    OutOfTierMemory,
    Phase,
    StoreError,
    TensorClass,
    Tier,
    TieredModel,
    TierMemError,
)
from tiermem.plan.footprint import WINDOW_BUCKETS
from tiermem.plan.policy import PerClass
from tiermem.policies import ZeroInfinity, ZeroOffload


def _make(policy, tmp_path, precision="fp32", *, clip=6.5, optimizer=None, **kw):
    torch.manual_seed(3)
    return TieredModel(
        TinyGPT(n_layer=3),
        policy,
        optimizer=optimizer or AdamW(lr=3e-3, weight_decay=0.1),
        precision=precision,
        grad_clip=clip,
        bucket_size=3000,  # about a dozen buckets
        device="cpu",
        nvme_dir=None if tmp_path is None else str(tmp_path),
        **kw,
    )


def _batch(step: int):
    """Batches whose gradient norms straddle the clip: every third has its targets shuffled
    against a repeated input (a large norm), the others are the model's own kind of data."""
    x, y = gpt_batch(step)
    if step % 3 == 2:
        x = x[:1].expand_as(x).contiguous()
    return x, y


def _train(tm, steps: int) -> list[tuple[str, str, bool]]:
    """(loss, grad norm, skipped) of each step, exactly (as reprs: an overflow's norm is nan)."""
    out = []
    for k in range(steps):
        x, y = _batch(k)
        loss = gpt_loss(tm(x), y)
        tm.backward(loss)
        r = tm.step()
        out.append((repr(loss.item()), repr(r.grad_norm), r.skipped))
    return out


POLICIES = {
    "zero-offload": lambda d: (ZeroOffload(), None),
    "state-on-nvme": lambda d: (StateOnNvme(), d),
    "zero-infinity": lambda d: (ZeroInfinity(), d),
}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("where", list(POLICIES))
def test_the_same_bits_as_the_step_with_clipping_on_some_steps(tmp_path, where, precision):
    ref_policy, ref_dir = POLICIES[where](tmp_path / "ref")
    policy, d = POLICIES[where](tmp_path / "uib")
    for p in (ref_dir, d):
        if p is not None:
            p.mkdir()
    ref = _make(ref_policy, ref_dir, precision)
    tm = _make(policy, d, precision, update_in_backward=True)
    steps = 7
    want, got = _train(ref, steps), _train(tm, steps)
    assert got == want  # losses and norms bit for bit
    clipped = [float(norm) > 6.5 for _, norm, _ in want]
    assert any(clipped) and not all(clipped), clipped  # the clip fires on some steps and not on others
    assert same_state(tm.state_dict(), ref.state_dict())
    assert tm.report().backward_again[0] == steps


def test_the_same_bits_with_8bit_state_and_bf16_masters_on_nvme(tmp_path):
    """The 13B configuration: ZeroInfinity, 8-bit moments, bf16 masters with stochastic rounding."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    opt = lambda: AdamW8bit(lr=3e-3, bf16_stochastic_round=True)  # noqa: E731
    ref = _make(ZeroInfinity(), tmp_path / "a", "bf16", optimizer=opt())
    tm = _make(ZeroInfinity(), tmp_path / "b", "bf16", optimizer=opt(), update_in_backward=True)
    assert _train(tm, 5) == _train(ref, 5)
    assert same_state(tm.state_dict(), ref.state_dict())


def test_fp16_overflow_skips_as_the_step_does_without_a_second_backward():
    scale = LossScale(init_scale=2.0**20)  # the first five steps overflow, the scaler backs off
    ref = _make(ZeroOffload(), None, "fp16", loss_scale=scale)
    tm = _make(ZeroOffload(), None, "fp16", loss_scale=scale, update_in_backward=True)
    want, got = _train(ref, 8), _train(tm, 8)
    assert got == want
    skipped = sum(s for _, _, s in want)
    assert 0 < skipped < 8
    assert tm.report().backward_again[0] == 8 - skipped  # a skipped step runs no second backward
    assert same_state(tm.state_dict(), ref.state_dict())


def test_a_nan_gradient_skips_the_step_and_changes_nothing():
    tm = _make(ZeroOffload(), None, update_in_backward=True)
    _train(tm, 2)
    before = tm.state_dict()
    x, y = _batch(5)
    loss = gpt_loss(tm(x), y) * float("nan")
    tm.backward(loss)
    assert tm.step().skipped
    assert same_state(tm.state_dict(), before)
    assert tm.report().backward_again[0] == 2
    _train(tm, 1)  # and training goes on


def test_the_host_holds_a_window_of_grads_not_all_of_them():
    ref = _make(ZeroOffload(), None)
    tm = _make(ZeroOffload(), None, update_in_backward=True)
    _train(ref, 2)
    _train(tm, 2)
    whole = ref.report().class_peak_bytes[(TensorClass.GRAD, Tier.HOST)]
    assert whole >= 4 * ref.layout.n_params
    largest = max(b.numel for b in tm.layout.buckets) * 4
    held = tm.report().class_peak_bytes.get((TensorClass.GRAD, Tier.HOST), 0)
    assert 0 < held <= WINDOW_BUCKETS * largest < whole / 2, (held, largest, whole)


def test_the_footprint_counts_a_window_instead_of_the_grads():
    from tiermem.plan.footprint import GRADS, GRADS_IN_BACKWARD

    tm = _make(ZeroOffload(), None, update_in_backward=True)
    ref = _make(ZeroOffload(), None)

    def need(model):  # the footprint TieredModel checked its budgets with (NOTE [Plan, then build])
        return model.model_plan.footprint

    with_window, without = need(tm)[Tier.HOST], need(ref)[Tier.HOST]
    assert GRADS not in with_window and without[GRADS] == 4 * ref.layout.n_params
    assert with_window[GRADS_IN_BACKWARD] == WINDOW_BUCKETS * 4 * max(b.numel for b in tm.layout.buckets)


class _GradsOnNvme(PerClass):
    """ZeroInfinity's weights and state on NVMe, its grads there too."""

    homes = {
        TensorClass.PARAM: Tier.NVME,
        TensorClass.ACTIVATION: Tier.DEVICE,
        TensorClass.GRAD: Tier.NVME,
        TensorClass.OPTIM_STATE: Tier.NVME,
    }


class _GradsOnDevice(PerClass):
    """Grads homed on the device, the state on the host: in this mode they accumulate on the host."""

    homes = {
        TensorClass.PARAM: Tier.DEVICE,
        TensorClass.ACTIVATION: Tier.DEVICE,
        TensorClass.GRAD: Tier.DEVICE,
        TensorClass.OPTIM_STATE: Tier.HOST,
    }


ACCUMULATING = {  # the GRAD home earlier micro-batches accumulate in: host memory, NVMe
    "host": lambda: ZeroOffload(device_fraction=0),
    "host-from-device": _GradsOnDevice,
    "state-on-nvme": ZeroInfinity,
    "grads-on-nvme": _GradsOnNvme,
}

#: which micro-batches of a step run inside tm.no_sync(): ``m`` of ``n``
ROUTES = {
    "automatic": lambda m, n: False,
    "no-sync": lambda m, n: m < n - 1,
    "mixed": lambda m, n: m == 0,
    "no-sync-last-too": lambda m, n: True,  # the step's last backward too: no kept graph, no second pass
}


def _micro(step: int) -> int:
    return 2 + step % 2  # two micro-batches, then three


def _accumulate(tm, steps: int, route: str, *, blow_up: Iterable[tuple[int, int]] = ()) -> list[tuple[str, str, bool]]:
    """(loss, grad norm, skipped) of each step of ``_micro(step)`` micro-batches, as :func:`_train`;
    the loss of micro-batch ``m`` of step ``k`` is scaled by 2**20 for each ``(k, m)`` in ``blow_up``."""
    out = []
    for k in range(steps):
        x, y = _batch(k)
        n = _micro(k)
        for m, (xm, ym) in enumerate(zip(x.tensor_split(n), y.tensor_split(n))):
            loss = gpt_loss(tm(xm), ym) / n * (2.0**20 if (k, m) in blow_up else 1.0)
            with tm.no_sync() if ROUTES[route](m, n) else contextlib.nullcontext():
                tm.backward(loss)
        r = tm.step()
        out.append((repr(loss.item()), repr(r.grad_norm), r.skipped))
    return out


def _optim_state(tm) -> dict[str, torch.Tensor]:
    """Each parameter's optimizer state, by ``name:part``."""
    state = tm.sharded_state_dict()["optim"]["state"]
    return {f"{n}:{part}": v.local().clone() for n, parts in state.items() for part, v in parts.items()}


def _pair(where: str, tmp_path, **kw):
    """The same model without update_in_backward and with it, under the policy ``where`` names."""
    models = []
    for name, flag in (("ref", False), ("uib", True)):
        d = tmp_path / name
        d.mkdir()
        models.append(_make(ACCUMULATING[where](), d, update_in_backward=flag, **kw))
    return models


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("where", list(ACCUMULATING))
def test_accumulation_over_micro_batches_gives_the_same_bits_as_the_step(tmp_path, where, route):
    ref, tm = _pair(where, tmp_path)
    steps = 7
    want, got = _accumulate(ref, steps, route), _accumulate(tm, steps, route)
    assert got == want  # losses and norms bit for bit
    clipped = [float(norm) > 6.5 for _, norm, _ in want]
    assert any(clipped) and not all(clipped), clipped
    assert same_state(tm.state_dict(), ref.state_dict())
    assert same_state(_optim_state(tm), _optim_state(ref))
    passes = [sum(not ROUTES[route](m, _micro(k)) for m in range(_micro(k))) for k in range(steps)]
    assert tm.report().backward_again[0] == sum(passes)  # a replay per automatic micro-batch but the last
    assert _train(tm, 2) == _train(ref, 2)  # and steps without accumulation go on alike
    assert same_state(tm.state_dict(), ref.state_dict())


@pytest.mark.parametrize("route", ["automatic", "no-sync"])
def test_fp16_overflow_in_one_micro_batch_skips_the_step_as_the_step_does(tmp_path, route):
    scale = LossScale(init_scale=2.0**8)
    ref, tm = _pair("host", tmp_path, precision="fp16", loss_scale=scale)
    blow_up = {(2, 0), (3, 2), (5, 1)}  # an earlier micro-batch, a step's last, a middle one
    want, got = _accumulate(ref, 7, route, blow_up=blow_up), _accumulate(tm, 7, route, blow_up=blow_up)
    assert got == want
    assert [k for k, (_, _, skipped) in enumerate(want) if skipped] == [2, 3, 5]
    assert same_state(tm.state_dict(), ref.state_dict())
    assert same_state(_optim_state(tm), _optim_state(ref))


def _quirky(steps: int, route: str, bucket_size: int, **kw):
    """Quirky (a branch some micro-batches do not reach), three micro-batches a step: the
    branch's parameters get gradients from the last alone, from earlier ones alone, from none."""
    torch.manual_seed(5)
    tm = TieredModel(
        Quirky(), ZeroOffload(), optimizer=AdamW(lr=1e-2), precision="fp32", grad_clip=0.5,
        bucket_size=bucket_size, device="cpu", **kw,
    )  # fmt: skip
    uses = [(False, False, True), (True, False, False), (False, True, True), (False, False, False)]
    out = []
    for k in range(steps):
        for m, branch in enumerate(uses[k % len(uses)]):
            g = torch.Generator().manual_seed(10 * k + m)
            y, z = tm(torch.randn(8, 13, generator=g), use_branch=branch)
            loss = y.float().pow(2).mean() + (z.float().mean() if z is not None else 0)
            with tm.no_sync() if ROUTES[route](m, 3) else contextlib.nullcontext():
                tm.backward(loss)
        out.append(repr(tm.step().grad_norm))
    return out, tm


@pytest.mark.parametrize("bucket_size", [200, 4096])  # the branch in buckets of its own, or shared
@pytest.mark.parametrize("route", ["automatic", "no-sync"])
def test_parameters_some_micro_batches_do_not_reach(route, bucket_size):
    want, ref = _quirky(8, route, bucket_size)
    got, tm = _quirky(8, route, bucket_size, update_in_backward=True)
    assert got == want
    assert same_state(tm.state_dict(), ref.state_dict())
    assert same_state(_optim_state(tm), _optim_state(ref))


def test_accumulating_brings_back_the_grads_home_for_the_step_and_only_then():
    tm = _make(ZeroOffload(), None, update_in_backward=True)
    _train(tm, 2)
    largest = max(b.numel for b in tm.layout.buckets) * 4
    assert tm.report().class_peak_bytes[(TensorClass.GRAD, Tier.HOST)] <= WINDOW_BUCKETS * largest
    _accumulate(tm, 2, "automatic")
    assert tm.report().class_peak_bytes[(TensorClass.GRAD, Tier.HOST)] >= 4 * tm.layout.n_params


def test_accumulation_the_budgets_have_no_room_for_is_refused_and_the_step_still_runs(caplog):
    from tiermem.plan.footprint import accumulation_footprint, totals

    probe = _make(ZeroOffload(), None, update_in_backward=True)
    _train(probe, 1)
    used = probe.stores[Tier.HOST].used  # what a step leaves held (the pool's buffers among it)
    room = totals(accumulation_footprint(probe.layout.buckets))[Tier.HOST]
    ref = _make(ZeroOffload(), None)
    tm = _make(ZeroOffload(), None, update_in_backward=True, budgets=Budgets(host=used + room // 2))
    _train(ref, 1)
    _train(tm, 1)  # a step without accumulation fits
    x, y = _batch(1)
    tm.backward(gpt_loss(tm(x), y))
    held = tm.stores[Tier.HOST].used
    with (
        caplog.at_level(logging.WARNING, logger="tiermem"),
        pytest.raises(OutOfTierMemory, match=r"^tiermem: out of host memory placing '<grads accumulated over"),
    ):
        tm.backward(gpt_loss(tm(x), y))
    # what to change, as a note on the error (and in the log, which Python 3.10 and pytest 7 see alone)
    assert "tiermem: update_in_backward: a tm.backward() that is not the step's last" in caplog.text
    assert tm.stores[Tier.HOST].used == held  # refused before any of it was taken
    assert tm.phase is Phase.GRADS_READY  # the first backward's gradients (and graph) are kept
    r = tm.step()
    ref.backward(gpt_loss(ref(x), y))
    assert r.grad_norm == ref.step().grad_norm
    assert same_state(tm.state_dict(), ref.state_dict())


def test_refused_with_overlap_step_and_with_state_on_the_device():
    with pytest.raises(ConfigError, match="update_in_backward=True and overlap_step=True"):
        _make(ZeroOffload(), None, update_in_backward=True, overlap_step=True)
    with pytest.raises(ConfigError, match="optimizer state of .* buckets on the device"):
        _make(ZeroOffload(device_fraction=1.0), None, update_in_backward=True)
    with pytest.raises(ConfigError, match="update_in_backward=1 is not a bool"):
        _make(ZeroOffload(), None, update_in_backward=1)


def test_a_step_that_failed_before_any_bucket_landed_is_completed_by_a_retry(tmp_path):
    """Every state write fails: no bucket is updated, the weights sent home are taken back, and the
    retry (a third backward over the kept graph) gives the uninterrupted run's bits."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ref = _make(StateOnNvme(), tmp_path / "a")
    tm = _make(StateOnNvme(), tmp_path / "b", update_in_backward=True)
    _train(ref, 2)
    _train(tm, 2)
    x, y = _batch(2)
    tm.backward(gpt_loss(tm(x), y))
    before = tm.state_dict()
    with _files_fail(tm.stores[Tier.NVME], ("",)):
        with pytest.raises(StoreError, match=os.strerror(errno.EIO)):
            tm.step()
    assert same_state(tm.state_dict(), before)  # nothing moved: reads are allowed and see the old weights
    tm.step()  # the retry
    ref.backward(gpt_loss(ref(x), y))
    ref.step()
    assert same_state(tm.state_dict(), ref.state_dict())
    assert _train(tm, 2) == _train(ref, 2)


def test_a_step_that_failed_after_some_buckets_landed_says_to_load_a_checkpoint(tmp_path):
    """Bucket 0's state write fails after the others landed: their grads are gone, so the step
    cannot be completed; reads are refused, a retry says to load a checkpoint, and a load works."""
    (tmp_path / "a").mkdir()
    (tmp_path / "ckpt").mkdir()
    tm = _make(StateOnNvme(), tmp_path / "a", update_in_backward=True)
    _train(tm, 2)
    tm.save(str(tmp_path / "ckpt" / "two"))
    saved = tm.state_dict()
    x, y = _batch(2)
    tm.backward(gpt_loss(tm(x), y))
    with _files_fail(tm.stores[Tier.NVME], ("bucket0_state.",)):
        with pytest.raises(StoreError, match=os.strerror(errno.EIO)):
            tm.step()
    with pytest.raises(TierMemError, match="weights of two steps"):
        tm(x)
    with pytest.raises(TierMemError, match="cannot be completed.*tm.load"):
        tm.step()
    tm.load(str(tmp_path / "ckpt" / "two"))
    assert same_state(tm.state_dict(), saved)
    _train(tm, 1)


class _ActivationsOnHost(ZeroOffload):
    """ZeRO-Offload with every saved activation offloaded to the host."""

    def place(self, info):
        return Tier.HOST if info.kind is TensorClass.ACTIVATION else super().place(info)


def test_offloaded_activations_come_back_for_the_second_backward():
    ref = _make(_ActivationsOnHost(), None)
    tm = _make(_ActivationsOnHost(), None, update_in_backward=True)
    assert _train(tm, 4) == _train(ref, 4)
    assert tm.report().class_peak_bytes.get((TensorClass.ACTIVATION, Tier.HOST), 0) > 0
    assert same_state(tm.state_dict(), ref.state_dict())
    assert _accumulate(tm, 3, "automatic") == _accumulate(ref, 3, "automatic")  # a replay after the next forward
    assert same_state(tm.state_dict(), ref.state_dict())
