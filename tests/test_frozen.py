"""Frozen weights keep one copy (NOTE [Frozen weights keep one copy]): a frozen parameter in the
working dtype has no second copy on the host, wherever its working copy lives (device, host, NVMe),
and every read of its value (checkpoints, DCP, ``state_dict()``, ``detach()``, unfreezing) gets
exactly what it holds; one of another dtype keeps its exact value in a host copy, as before."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn.functional as F
from models import same_state
from torch import nn

from tiermem import AdamW, StoreError, TensorClass, Tier, TieredModel
from tiermem.policies import KeepOnDevice, ZeroInfinity, ZeroOffload

pytestmark = pytest.mark.usefixtures("one_thread")

V, D = 16, 256
POLICIES = {"zero-offload": ZeroOffload, "zero-infinity": ZeroInfinity, "keep-on-device": KeepOnDevice}


class Base(nn.Module):
    """A frozen base (embedding, two layers, a norm weight) with a small trainable head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList([nn.Linear(D, D) for _ in range(2)])
        self.norm = nn.Parameter(torch.rand(D) + 0.5)
        self.head = nn.Linear(D, V)
        for m in (self.emb, *self.layers):
            m.requires_grad_(False)
        self.norm.requires_grad_(False)

    def forward(self, idx):
        h = self.emb(idx)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h * self.norm)


def _model(dtype):
    torch.manual_seed(0)
    return Base().to(dtype)


def _step(tm, i):
    torch.manual_seed(100 + i)
    idx = torch.randint(0, V, (3, 5))
    logits = tm(idx)
    loss = F.cross_entropy(logits.float().reshape(-1, V), idx.reshape(-1))
    tm.backward(loss)
    assert not tm.step().skipped
    return loss.item()


def _wrap(model, policy, tmp_path, run):
    d = tmp_path / run
    d.mkdir()
    return TieredModel(model, POLICIES[policy](), optimizer=AdamW(lr=1e-2), precision="bf16", nvme_dir=str(d))


FROZEN = ["emb.weight", "layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias", "norm"]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_frozen_in_the_working_dtype_keep_no_host_copy(tmp_path, policy):
    model = _model(torch.bfloat16)
    given = {n: p.detach().clone() for n, p in model.named_parameters()}
    tm = _wrap(model, policy, tmp_path, "a")
    host = tm.stores[Tier.HOST]
    assert not [k for k in host.keys() if k.endswith(":frozen")]
    frozen_bytes = sum(given[n].numel() * 2 for n in FROZEN)
    assert host.used < frozen_bytes  # the head's grads and state only (a few KiB), not the base
    losses = [_step(tm, i) for i in range(2)]
    state = tm.state_dict()
    for n in FROZEN:  # exactly the values given: nothing rounded, nothing lost
        assert state[n].dtype == torch.bfloat16 and torch.equal(state[n], given[n]), n
    path = str(tmp_path / "ckpt.pt")
    tm.save(path)
    # a fresh model whose frozen weights differ takes the checkpoint's, and continues bit-exact
    other = _model(torch.bfloat16)
    with torch.no_grad():
        for n in FROZEN:
            other.get_parameter(n).add_(1.0)
    tm2 = _wrap(other, policy, tmp_path, "b")
    tm2.load(path)
    assert same_state(tm2.state_dict(), state)
    assert _step(tm2, 2) == _step(tm, 2)
    assert same_state(tm2.state_dict(), tm.state_dict())
    out = tm.detach()
    for n in FROZEN:
        assert torch.equal(out.get_parameter(n).detach(), given[n]), n
    assert losses[1] < losses[0] * 1.5  # it trained (and computed with real values: no skipped step)


def test_frozen_keep_one_copy_and_the_same_numbers_on_every_tier(tmp_path):
    runs = {}
    for policy in POLICIES:
        tm = _wrap(_model(torch.bfloat16), policy, tmp_path, policy)
        losses = [_step(tm, i) for i in range(3)]
        runs[policy] = (losses, tm.state_dict())
    first = runs["zero-offload"]
    for policy, (losses, state) in runs.items():
        assert losses == first[0] and same_state(state, first[1]), policy


def test_unfreezing_a_weight_homed_on_nvme_trains_from_its_value(tmp_path):
    runs = []
    for policy in ("zero-offload", "zero-infinity"):
        model = _model(torch.bfloat16)
        tm = _wrap(model, policy, tmp_path, policy)
        _step(tm, 0)
        model.layers[1].weight.requires_grad_(True)  # unfrozen: trained from the next step
        losses = [_step(tm, i) for i in range(1, 4)]
        state = tm.state_dict()
        assert not torch.equal(state["layers.1.weight"], _model(torch.bfloat16).layers[1].weight.detach().float())
        runs.append((losses, state))
    assert runs[0][0] == runs[1][0] and same_state(runs[0][1], runs[1][1])


#: where an fp32 frozen parameter trained in bf16 keeps its fp32 copy: beside its working copy's
#: home when that is NVMe, else on the host (NOTE [Frozen weights keep one copy])
COPY_TIER = {"zero-offload": Tier.HOST, "zero-infinity": Tier.NVME}


@pytest.mark.parametrize("policy", list(COPY_TIER))
def test_frozen_of_another_dtype_keep_their_exact_value_in_a_copy(tmp_path, caplog, policy):
    model = _model(torch.float32)  # fp32 weights, bf16 working copies: rounding cannot be undone
    given = {n: p.detach().clone() for n, p in model.named_parameters()}
    with caplog.at_level(logging.INFO, logger="tiermem"):
        tm = _wrap(model, policy, tmp_path, "a")
    on, off = COPY_TIER[policy], ({Tier.HOST, Tier.NVME} - {COPY_TIER[policy]}).pop()
    copies = sorted(f"{n}:frozen" for n in FROZEN)
    assert sorted(k for k in tm.stores[on].keys() if k.endswith(":frozen")) == copies
    assert off not in tm.stores or not [k for k in tm.stores[off].keys() if k.endswith(":frozen")]
    where = {Tier.HOST: "on the host", Tier.NVME: "on NVMe"}[on]
    assert any("keep a float32 copy" in r.getMessage() and where in r.getMessage() for r in caplog.records)
    copy_bytes = sum(given[n].numel() * 4 for n in FROZEN)
    host_params = tm.report().class_peak_bytes.get((TensorClass.PARAM, Tier.HOST), 0)
    if on == Tier.NVME:  # host memory holds none of the base: not its fp32 copy either
        assert host_params < copy_bytes
        assert sum(tm.stores[Tier.NVME].nbytes(k) for k in copies) == copy_bytes
    else:
        assert host_params >= copy_bytes
    _step(tm, 0)
    state = tm.state_dict()
    for n in FROZEN:
        assert state[n].dtype == torch.float32 and torch.equal(state[n], given[n]), n
    path = str(tmp_path / "ckpt.pt")
    tm.save(path)
    other = _model(torch.float32)  # a fresh model whose frozen weights differ takes the checkpoint's
    with torch.no_grad():
        for n in FROZEN:
            other.get_parameter(n).add_(1.0)
    tm2 = _wrap(other, policy, tmp_path, "b")
    tm2.load(path)
    for n in FROZEN:
        assert torch.equal(tm2.state_dict()[n], given[n]), n
    model.layers[1].weight.requires_grad_(True)  # unfrozen: its fp32 master starts from the exact value
    tm.optimizer.param_groups[0]["lr"] = 0.0  # a step that leaves the master as it was
    _step(tm, 1)
    assert torch.equal(tm.state_dict()["layers.1.weight"], given["layers.1.weight"])
    assert "layers.1.weight:frozen" not in tm.stores[on]
    out = tm.detach()
    for n in FROZEN:
        assert torch.equal(out.get_parameter(n).detach(), given[n]), n


def test_a_failed_read_of_a_copy_on_nvme_names_the_parameter(tmp_path):
    import errno

    tm = _wrap(_model(torch.float32), "zero-infinity", tmp_path, "a")
    store = tm.stores[Tier.NVME]
    real = store._preadv

    def copies_fail(fd, bufs, offset):
        if "frozen" in os.path.basename(os.readlink(f"/proc/self/fd/{fd}")):  # a copy's file
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, bufs, offset)

    store._preadv = copies_fail
    try:
        with pytest.raises(
            StoreError, match=r"^tiermem: the float32 copy of frozen parameter '[\w.]+': .*Input/output error"
        ):
            tm.state_dict()
    finally:
        store._preadv = real
    assert torch.equal(tm.state_dict()["emb.weight"], _model(torch.float32).emb.weight.detach())
    tm.detach()


def test_a_construction_failing_at_a_copy_on_nvme_leaves_no_files(tmp_path, monkeypatch):
    from tiermem.memory.nvme import NvmeStore

    real, written = NvmeStore.write, []

    def third_copy_fails(self, key, src, kind=None):
        written.append(key)
        if sum(k.endswith(":frozen") for k in written) == 3:
            raise StoreError(f"tiermem: cannot write {key!r} (injected)")
        return real(self, key, src, kind)

    monkeypatch.setattr(NvmeStore, "write", third_copy_fails)
    model = _model(torch.float32)
    with pytest.raises(StoreError, match="injected"):
        _wrap(model, "zero-infinity", tmp_path, "a")
    assert sum(k.endswith(":frozen") for k in written) == 3  # two copies were on NVMe when it failed
    assert os.listdir(tmp_path / "a") == []
    for n, p in _model(torch.float32).named_parameters():  # the module is as it was
        assert torch.equal(model.get_parameter(n).detach(), p.detach()), n


@pytest.mark.parametrize("policy", list(COPY_TIER))
def test_writes_inside_resident_reach_the_copy_of_a_frozen_weight(tmp_path, policy):
    model = _model(torch.float32)
    given = model.layers[0].weight.detach().clone()
    tm = _wrap(model, policy, tmp_path, "a")
    with tm.resident([model.layers[0].weight]), torch.no_grad():
        model.layers[0].weight[2].fill_(0.25)  # written in bf16: the other rows keep their fp32 value
    want = given.clone()
    want[2] = 0.25
    assert torch.equal(tm.state_dict()["layers.0.weight"], want)
    tm.detach()
