"""Parameters off the device (ZeRO-Infinity): same numbers, device budget held, clear errors."""

from __future__ import annotations

import threading

import pytest
import torch
from models import TinyGPT, disk_fills_up, gpt_batch, gpt_loss, same_state
from test_nvme_state import _make, _train, _trains_like
from torch import nn

from tiermem import AdamW, Budgets, OutOfTierMemory, TensorClass, Tier, TieredModel, TierMemError
from tiermem.plan.policy import Policy
from tiermem.policies import ZeroInfinity, ZeroOffload
from tiermem.train.weights.offdevice import OffDeviceWeight


class Scatter(Policy):
    """Every class somewhere else: weights of blocks on the host, the rest's on NVMe; state of the
    embeddings on NVMe, the rest on the host; grads on the host."""

    def place(self, info):
        if info.kind is TensorClass.PARAM:
            return Tier.HOST if info.name.startswith("blocks.") else Tier.NVME
        if info.kind is TensorClass.OPTIM_STATE:
            return Tier.NVME if info.name.startswith(("wte.", "wpe.")) else Tier.HOST
        return ZeroOffload().place(info)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("policy", [ZeroInfinity(), Scatter()], ids=["zero-infinity", "scatter"])
def test_weights_off_device_give_identical_numbers(tmp_path, precision, policy):
    ref = _make(ZeroOffload(), None, precision)
    tm = _make(policy, tmp_path, precision)
    rep = _trains_like(tm, ref, 4)
    cp = rep.class_peak_bytes
    assert cp.get((TensorClass.PARAM, Tier.NVME), 0) > 0
    if isinstance(policy, Scatter):
        assert cp[(TensorClass.PARAM, Tier.HOST)] > 0 and cp[(TensorClass.OPTIM_STATE, Tier.NVME)] > 0
    stats = tm.param_offload.scheduler.stats
    assert stats.prefetches > 0  # later steps fetched ahead along the recorded trace
    moved = rep.class_bytes_moved
    assert moved[(TensorClass.PARAM, Tier.NVME, Tier.DEVICE)] > 0  # weights fetched for their modules
    assert moved[(TensorClass.PARAM, Tier.HOST, Tier.NVME)] > 0  # updated weights written home
    assert moved[(TensorClass.OPTIM_STATE, Tier.NVME, Tier.HOST)] > 0
    assert moved[(TensorClass.GRAD, Tier.DEVICE, Tier.HOST)] > 0
    assert "param" in str(rep) and "nvme->device" in str(rep)


def test_device_budget_smaller_than_the_weights(tmp_path):
    def make(policy, budgets=None, nvme_dir=str(tmp_path)):
        torch.manual_seed(12)
        return TieredModel(
            TinyGPT(d=256, n_layer=4),
            policy,
            precision="bf16",
            bucket_size="256KiB",
            nvme_dir=nvme_dir,
            budgets=budgets,
        )

    weights = 2 * sum(p.numel() for p in TinyGPT(d=256, n_layer=4).parameters())
    budget = weights * 3 // 4  # weights alone would not fit; activations need their share too
    tm = make(ZeroInfinity(), Budgets(device=budget))
    ref = make(ZeroOffload(), nvme_dir=None)  # one run owns a directory; this one needs none
    assert _train(tm, 3) == _train(ref, 3)
    rep = tm.report()
    assert rep.peak_bytes[Tier.DEVICE] <= budget
    assert rep.class_peak_bytes[(TensorClass.PARAM, Tier.DEVICE)] < weights  # never all weights at once


def test_device_budget_holds_with_a_slow_copy_lane(tmp_path):
    """Grads still being copied home hold device bytes; a weight brought back in backward waits
    for them to land rather than refusing (a busy 2-core CI machine made this flaky)."""
    weights = 2 * sum(p.numel() for p in TinyGPT(d=256, n_layer=4).parameters())
    budget = weights * 3 // 4
    torch.manual_seed(12)
    tm = TieredModel(
        TinyGPT(d=256, n_layer=4),
        ZeroInfinity(),
        precision="bf16",
        bucket_size="256KiB",
        nvme_dir=str(tmp_path),
        budgets=Budgets(device=budget),
    )
    torch.manual_seed(12)
    ref = TieredModel(TinyGPT(d=256, n_layer=4), ZeroOffload(), precision="bf16", bucket_size="256KiB")
    losses = []
    for i in range(3):
        x, y = gpt_batch(i)
        loss = gpt_loss(tm(x), y)
        stall = threading.Event()
        tm.engine.run_async(lambda: stall.wait(0.5), lane="d2h")  # the grad copies queue behind this
        tm.backward(loss)
        stall.set()
        losses.append(loss.item())
        tm.step()
    assert losses == _train(ref, 3)
    assert tm.report().peak_bytes[Tier.DEVICE] <= budget


def test_budget_below_one_modules_weights_is_a_clear_error(tmp_path):
    with pytest.raises(OutOfTierMemory, match=r"weights of the largest module, while it runs"):
        _make(ZeroInfinity(), tmp_path, budgets=Budgets(device=1000))


def test_detach_and_checkpoint_with_weights_off_device(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    tm = _make(ZeroInfinity(), tmp_path / "a")
    _train(tm, 2)
    path = str(tmp_path / "ckpt")
    tm.save(path)
    other = _make(ZeroInfinity(), tmp_path / "b", bucket=5000)
    other.load(path)
    assert _train(tm, 2, offset=2) == _train(other, 2, offset=2)
    sd = tm.state_dict()
    m = tm.detach()
    assert all(torch.equal(p.detach(), sd[n]) for n, p in m.named_parameters())
    x, y = gpt_batch(0)
    gpt_loss(m(x), y).backward()  # plain torch again: real weights, no hooks
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_overlap_step_with_weights_off_device(tmp_path):
    ref = _make(ZeroOffload(), None, overlap_step=True)
    tm = _make(ZeroInfinity(), tmp_path, overlap_step=True)
    _trains_like(tm, ref, 4)


def _two_steps_and_a_backward(tmp_path):
    """ZeroInfinity (on ``tmp_path/a``) and its ZeroOffload reference after two steps, with the
    third step's gradients waiting in the ZeroInfinity model."""
    (tmp_path / "a").mkdir()
    tm = _make(ZeroInfinity(), tmp_path / "a")
    ref = _make(ZeroOffload(), None)
    _train(tm, 2)
    _train(ref, 2)
    x, y = gpt_batch(2)
    tm.backward(gpt_loss(tm(x), y))
    return tm, ref


def _after_failure(tm, before: dict) -> dict:
    """What each bucket holds after a failed step, read from the model's state (NOTE [A failed step
    is rolled forward]): ``tm.state_dict()`` refuses it whenever part of the step landed (a master
    moved; also when only new working weights were sent home, which the masters do not show)."""
    from test_nvme_state import held

    try:
        shown = tm.state_dict()
    except TierMemError as e:
        assert str(e).startswith("tiermem: tm.state_dict() would use weights of two steps"), e
        shown = None
    after = held(tm)
    if not same_state(after, before):
        assert shown is None, "tm.state_dict() gave the masters of two steps"
    else:
        assert shown is None or same_state(shown, before)
    return after


@pytest.mark.parametrize("fail_after", [3, 12, 40])
def test_failed_step_with_weights_on_nvme_is_completed_by_a_retry(tmp_path, fail_after):
    """NOTE [A failed step is rolled forward]: after the disk fills mid-step every parameter holds
    its state from before the step or from after it (never a mix), and the retry completes the step
    exactly as the uninterrupted run (weights on NVMe included: the next forwards give its losses)."""
    from tiermem import StoreError

    tm, ref = _two_steps_and_a_backward(tmp_path)
    before = tm.state_dict()
    with disk_fills_up(tm.stores[Tier.NVME], after=fail_after):
        with pytest.raises(StoreError, match="(?i)no space left"):
            tm.step()
    after = _after_failure(tm, before)
    _train(ref, 1, offset=2)
    stepped = ref.state_dict()
    assert all(torch.equal(after[k], before[k]) or torch.equal(after[k], stepped[k]) for k in after)
    tm.step()  # the retry uses the kept grads of the buckets that had not landed
    assert same_state(tm.state_dict(), stepped)
    assert _train(tm, 2, offset=3) == _train(ref, 2, offset=3)
    a, b = tm.state_dict(), ref.state_dict()
    assert same_state(a, b)


def test_weights_that_did_not_land_are_sent_home_again_by_the_retry(tmp_path):
    """The new weights cannot be written (EIO on the weights' files only) while the buckets'
    state lands: the step fails once Adam needs a staging buffer whose weights did not land, the
    buckets whose state landed count as updated (their grads are gone), and the retry sends their
    weights home again from the new master, so the next forwards compute with them, as the
    uninterrupted run does."""
    import errno
    import os

    from tiermem import StoreError

    tm, ref = _two_steps_and_a_backward(tmp_path)
    store = tm.stores[Tier.NVME]
    real = store._pwritev

    def weights_fail(fd, bufs, offset):
        if "_state." not in os.path.basename(os.readlink(f"/proc/self/fd/{fd}")):  # a weight's file
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, bufs, offset)

    store._pwritev = weights_fail
    try:
        with pytest.raises(StoreError, match="Input/output error"):
            tm.step()
    finally:
        store._pwritev = real
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    _train(ref, 1, offset=2)
    stepped, after = ref.state_dict(), _after_failure(tm, before)
    landed = [k for k in after if torch.equal(after[k], stepped[k]) and not torch.equal(after[k], before[k])]
    assert landed and all(torch.equal(after[k], before[k]) or k in landed for k in after)
    tm.step()  # the rest of the update, and the landed buckets' weights sent home again
    assert _train(tm, 2, offset=3) == _train(ref, 2, offset=3)
    assert same_state(tm.state_dict(), ref.state_dict())


def test_fp32_weights_off_device_match(tmp_path):
    ref = _make(ZeroOffload(), None, "fp32")
    tm = _make(ZeroInfinity(), tmp_path, "fp32")
    _trains_like(tm, ref, 3)


def test_a_module_that_raises_releases_its_weights(tmp_path):
    tm = _make(ZeroInfinity(), tmp_path)
    block = tm.module.blocks[0]
    real = block.forward

    def boom(x):
        raise RuntimeError("boom")

    block.forward = boom
    x, y = gpt_batch(0)
    with pytest.raises(RuntimeError, match="boom"):
        tm(x)
    block.forward = real
    assert tm.param_offload.scheduler.acquired() == []  # nothing stays acquired
    # each weight is its off-device form again, with no device copy held, and reads as its value
    assert all(type(p) is OffDeviceWeight for p in block.parameters())
    master = tm.state_dict()
    for name, p in block.named_parameters():
        assert torch.equal(p.float(), master[f"blocks.0.{name}"].to(torch.bfloat16).float())
    _train(tm, 1)  # and training goes on


def test_prefetch_off_fetches_on_demand_with_the_same_numbers(tmp_path):
    ref = _make(ZeroInfinity(), tmp_path / "on" if (tmp_path / "on").mkdir() is None else None)
    tm = _make(ZeroInfinity(), tmp_path / "off" if (tmp_path / "off").mkdir() is None else None, prefetch=False)
    assert _train(tm, 3) == _train(ref, 3)
    assert tm.param_offload.scheduler.stats.prefetches == 0 and tm.param_offload.scheduler.stats.misses > 0
    assert ref.param_offload.scheduler.stats.prefetches > 0


# -- weights read where their module is not running (issue 12, item 1) ---------------------------------
class _CheckpointedNorm(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.a, self.ln, self.b, self.reentrant = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3), reentrant

    def forward(self, x):
        h = self.a(x)
        if self.reentrant is None:
            return self.b(self.ln(h).relu())
        from torch.utils.checkpoint import checkpoint

        return self.b(checkpoint(lambda t: self.ln(t).relu(), h, use_reentrant=self.reentrant))


class _Borrowing(nn.Module):
    """A head computing with another module's weight, a module called twice, a root parameter."""

    def __init__(self):
        super().__init__()
        self.wte, self.mid, self.scale = nn.Embedding(10, 8), nn.Linear(8, 8), nn.Parameter(torch.ones(8))

    def forward(self, idx):
        h = self.mid(self.mid(self.wte(idx))) * self.scale
        return torch.nn.functional.linear(h, self.wte.weight)


@pytest.mark.parametrize(
    "make, eval_mode, inputs",
    [
        (lambda: _CheckpointedNorm(None), True, lambda: torch.randn(4, 8)),  # eval() mode
        (lambda: _CheckpointedNorm(True), False, lambda: torch.randn(4, 8, requires_grad=True)),  # reentrant recompute
        (lambda: _CheckpointedNorm(False), False, lambda: torch.randn(4, 8)),
        (_Borrowing, False, lambda: torch.randint(0, 10, (4, 5))),
    ],
)
def test_weights_are_resident_wherever_autograd_or_the_model_reads_them(tmp_path, make, eval_mode, inputs):
    """Same numbers as ZeroOffload, never a NaN placeholder in arithmetic."""
    states = []
    for policy in (ZeroOffload(), ZeroInfinity()):
        torch.manual_seed(0)
        (tmp_path / type(policy).__name__).mkdir()  # a directory each: one run owns a directory
        tm = TieredModel(
            make(), policy, optimizer=AdamW(lr=1e-2), precision="fp32", nvme_dir=str(tmp_path / type(policy).__name__)
        )
        if eval_mode:
            tm.eval()
        torch.manual_seed(1)
        for _ in range(2):
            tm.backward(tm(inputs()).square().mean())
            assert not tm.step().skipped
        states.append(tm.state_dict())
    assert same_state(*states)
