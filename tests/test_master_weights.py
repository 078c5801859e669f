"""A bf16 master and its working weights kept as one copy (NOTE [One copy of bf16 master weights] in
tiermem/train/weights/param_offload.py): the bytes each tier holds, the numbers (bit for bit those of
every other placement), checkpoints, and a failed step's retry. Oracle: the same run under
KeepOnDevice, whose weights and master are two tensors in device memory."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from models import TinyGPT, gpt_batch, gpt_loss, same_state, train_steps
from test_nvme_state import EVERY_STATE, _disk_fails, fail_then_retry

import tiermem
from tiermem import PerClass, StoreError, TensorClass, Tier, TieredModel
from tiermem.policies import KeepOnDevice, ZeroInfinity, ZeroOffload


class HostWeights(PerClass):
    """Weights and optimizer state on the host, grads too (ZeroOffload with its weights off the device)."""

    homes = {
        TensorClass.PARAM: Tier.HOST,
        TensorClass.OPTIM_STATE: Tier.HOST,
        TensorClass.GRAD: Tier.HOST,
        TensorClass.ACTIVATION: Tier.DEVICE,
    }


POLICIES = {
    "keep_on_device": KeepOnDevice,
    "zero_offload": ZeroOffload,
    "zero_infinity": ZeroInfinity,
    "host_weights": HostWeights,
}


def _spec(params, fp32_master: bool = False):
    return tiermem.AdamW8bit(params, lr=1e-2, min_8bit_size=256, bf16_stochastic_round=not fp32_master)


def _gpt(policy: str, tmp_path, bucket_size: int = 1000, seed: int = 0) -> TieredModel:
    torch.manual_seed(seed)
    m = TinyGPT()
    nvme = {"nvme_dir": str(tmp_path)} if policy == "zero_infinity" else {}
    return TieredModel(
        m, POLICIES[policy](), optimizer=_spec(m.parameters()), precision="bf16", bucket_size=bucket_size, **nvme
    )


def _stack(policy, tmp_path, fp32_master: bool = False, width: int = 512, depth: int = 16):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(depth)))
    tm = TieredModel(
        model,
        policy,
        optimizer=_spec(model.parameters(), fp32_master),
        precision="bf16",
        bucket_size="512KiB",
        nvme_dir=str(tmp_path),
    )
    x = torch.randn(8, width)
    for _ in range(2):
        tm.backward(tm(x).float().square().mean())
        tm.step()
    return tm, width * width * depth


def _held(tm: TieredModel, tier: Tier) -> dict[TensorClass, int]:
    return {k: v for k, v in tm.stores[tier].ledger.kind_used.items() if v}


def test_zero_infinity_keeps_a_bf16_master_once_on_disk(tmp_path):
    """8-bit moments and a bf16 master under ZeroInfinity: 2 B/param of weights (the master) and
    2.03 of the rest of the state on NVMe, by the ledger and by the files (6.03 with two copies);
    a fp32 master stays beside the weights (8.03)."""
    (tmp_path / "bf16").mkdir()
    tm, n = _stack(ZeroInfinity(), tmp_path / "bf16")
    held = _held(tm, Tier.NVME)
    assert held[TensorClass.PARAM] == 2 * n  # the weights' keys, which hold the master
    assert (held[TensorClass.PARAM] + held[TensorClass.OPTIM_STATE]) / n <= 4.1
    store = tm.stores[Tier.NVME]
    keys = list(store.keys())
    assert len(keys) == 16 + len(tm.layout.buckets)  # one key per weight, one state key per bucket
    values = sum(os.path.getsize(store._journal.keys[k].current().path) - 4096 for k in keys)  # less each header
    assert values / n <= 4.1, f"{values / n:.2f} B/param in the keys' files"
    tm.detach()
    (tmp_path / "fp32").mkdir()
    tm, n = _stack(ZeroInfinity(), tmp_path / "fp32", fp32_master=True)
    held = _held(tm, Tier.NVME)
    assert 8.0 < (held[TensorClass.PARAM] + held[TensorClass.OPTIM_STATE]) / n <= 8.1
    tm.detach()


def test_weights_on_the_host_are_views_of_the_master(tmp_path):
    """Weights and state on the host: the host holds the bf16 master once (its weights views of
    it, no staging for new weights): 4.03 B/param of weights and state, not 6.03 + staging; the
    footprint TieredModel checks its budgets with says the same."""
    tm, n = _stack(HostWeights(), tmp_path)
    held = _held(tm, Tier.HOST)
    assert TensorClass.PARAM not in held
    assert held[TensorClass.OPTIM_STATE] / n <= 4.1
    weight = tm.module[3].weight
    with tm.resident(weight):
        device = weight.detach().clone()
    b, s = _slot_of(tm, "3.weight")
    master = tm.layout.homes.state[b.index].master(b, s)
    assert torch.equal(device, master)  # what forward reads is the master
    tm.detach()


def _slot_of(tm: TieredModel, name: str):
    return next((b, s) for b in tm.layout.buckets for s in b.slots if s.name == name)


@pytest.mark.parametrize(
    "policy,bucket_size",
    [("zero_offload", 100_000), ("zero_infinity", 1000), ("zero_infinity", 100_000), ("host_weights", 1000)],
)
def test_one_copy_is_bit_identical_to_two(policy, bucket_size, tmp_path):
    """The weights the module computes with, the master state_dict() reads and the weights detach()
    gives back: bit for bit KeepOnDevice's, step after step."""
    ref = _gpt("keep_on_device", None)
    tm = _gpt(policy, tmp_path, bucket_size)
    assert train_steps(tm, 3) == train_steps(ref, 3)
    assert same_state(tm.state_dict(), ref.state_dict())
    for p, q in zip(tm.detach().parameters(), ref.detach().parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("policy", ["zero_infinity", "host_weights"])
def test_checkpoints_cross_between_one_copy_and_two(policy, tmp_path):
    """A checkpoint saved with one copy loads where there are two (KeepOnDevice) and the other way
    round, and either resumes bit for bit as the uninterrupted run: the file is the same."""
    whole = _gpt("keep_on_device", None)
    train_steps(whole, 4)
    for first, second in ((policy, "keep_on_device"), ("keep_on_device", policy)):
        d = tmp_path / f"{first}-{second}"
        (d / "a").mkdir(parents=True)
        (d / "b").mkdir()
        tm = _gpt(first, d / "a")
        train_steps(tm, 2)
        tm.save(str(d / "ckpt.tm"))
        tm.detach()
        tm = _gpt(second, d / "b", seed=1)  # other initial weights: all of them come from the file
        tm.load(str(d / "ckpt.tm"))
        train_steps(tm, 2, offset=2)
        assert same_state(tm.state_dict(), whole.state_dict()), (first, second)
        tm.detach()
    whole.detach()


@pytest.mark.parametrize("after", [1, 2, 3, 5, 8])
def test_a_failed_step_with_one_copy_is_completed_by_its_retry(after, tmp_path):
    """NOTE [A failed step is rolled forward]: a bucket's new value is its state key and its weights'
    keys; a write that fails part-way leaves each bucket before or after the step in what it reads,
    and the retry gives the uninterrupted run bit for bit, the weights the module reads included."""
    ref = _gpt("keep_on_device", None, bucket_size=1000)
    tm = _gpt("zero_infinity", tmp_path, bucket_size=1000)
    train_steps(ref, 2)
    train_steps(tm, 2)
    x, y = gpt_batch(2)
    tm.backward(gpt_loss(tm(x), y))
    with _disk_fails(tm.stores[Tier.NVME], after=after, code=errno.EIO):
        with pytest.raises(StoreError, match=os.strerror(errno.EIO)):
            tm.step()
    tm.step()  # the retry
    train_steps(ref, 1, offset=2)
    assert same_state(tm.state_dict(), ref.state_dict())
    assert train_steps(tm, 2, offset=3) == train_steps(ref, 2, offset=3)
    assert same_state(tm.state_dict(), ref.state_dict())
    tm.detach()


@pytest.mark.parametrize(
    "failing,moves",
    [(("",), False), (("ln_f.weight.",), True), (EVERY_STATE, True)],
    ids=["nothing", "torn", "weights-only"],
)
def test_a_forward_between_a_failed_step_with_one_copy_and_its_retry(failing, moves, tmp_path):
    """The weights' keys are the master's: a bucket whose new value landed in part is torn on disk
    until the retry writes it whole (bucket 0's ``ln_f.weight`` fails, its state key and other
    weights land; or its weights land and its state key fails). A forward in between is refused with a ``tiermem:`` error
    saying to retry the step when anything moved (never a mix of two steps), and computes plain
    PyTorch's output at the pre-step weights when nothing did; after the retry, at one step's."""
    ref = _gpt("keep_on_device", None, bucket_size=1000)
    tm = _gpt("zero_infinity", tmp_path, bucket_size=1000)
    fail_then_retry(tm, ref, failing, moves)
    tm.detach()
