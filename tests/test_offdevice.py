"""Weights off the device are real wherever they are read (NOTE [Weights off the device are a tensor
subclass]): inside ``tm(...)`` and ``tm.backward(...)`` by any module's code and any op or view, in
recomputed forwards of both checkpointing modes, and outside them (with or without
``tm.resident(...)``); never a made-up value."""

from __future__ import annotations

import copy
import gc
import io

import pytest
import torch
import torch.nn.functional as F
from models import same_state
from torch import nn
from torch.utils.checkpoint import checkpoint

from tiermem import AdamW, TieredModel, TierMemError
from tiermem.memory import deferred
from tiermem.policies import ZeroInfinity, ZeroOffload
from tiermem.train.weights.offdevice import OffDeviceWeight

pytestmark = pytest.mark.usefixtures("one_thread")

V, D = 16, 8

#: ways a module's forward reads a weight that is not its own (``w``: a parameter of a
#: ParameterDict, a module that never runs forward); each returns a (..., D) tensor from ``h``
READS = {
    ".T": lambda h, w: h @ w.T,
    ".mT": lambda h, w: h @ w.mT,
    ".t()": lambda h, w: h @ w.t(),
    "transpose": lambda h, w: h @ w.transpose(0, 1),
    "F.linear": lambda h, w: F.linear(h, w),
    ".view": lambda h, w: h * w.view(-1)[:D],
    "indexing": lambda h, w: h * w[1] + w[:, 2],
    "elementwise *": lambda h, w: (h.unsqueeze(-1) * w).sum(-2),
    "torch.cat": lambda h, w: h @ torch.cat([w, w], 0)[D // 2 : D // 2 + D],
    "einsum": lambda h, w: torch.einsum("btd,de->bte", h, w),
    "chunk + stack": lambda h, w: h @ torch.cat(w.chunk(2, dim=0), 0),
    "expand + reduce": lambda h, w: h + w.unsqueeze(0).expand(3, D, D).sum(0).sum(0),
    "to fp32 and back": lambda h, w: (h.float() @ w.float()).to(h.dtype),
    "reshape + contiguous": lambda h, w: h @ w.reshape(D, D).t().contiguous(),
    "non-reentrant checkpoint": lambda h, w: checkpoint(lambda t: torch.tanh(t @ w.T), h, use_reentrant=False),
    "reentrant checkpoint": lambda h, w: checkpoint(lambda t: torch.tanh(t @ w.T), h, use_reentrant=True),
}


class Reader(nn.Module):
    """Reads ``pd["a"]`` (and, as a tied head, the embedding's weight) from its own forward."""

    def __init__(self, read):
        super().__init__()
        self.emb, self.lin = nn.Embedding(V, D), nn.Linear(D, D)
        self.pd = nn.ParameterDict({"a": nn.Parameter(torch.randn(D, D) / D)})
        self.read = read

    def forward(self, idx):
        h = self.lin(self.emb(idx))
        h = h + self.read(h, self.pd["a"])
        return F.linear(h, self.emb.weight)


class FrozenNormInCheckpoint(nn.Module):
    """The trigger the issue narrowed down: a frozen elementwise weight (an RMSNorm's) inside a
    non-reentrant checkpointed region, something trainable below it."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.emb, self.up, self.down = nn.Embedding(V, D), nn.Linear(D, 2 * D), nn.Linear(2 * D, V)
        self.norm = nn.Parameter(torch.rand(D) + 0.5, requires_grad=False)
        self.reentrant = reentrant

    def block(self, h):
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        return F.gelu(self.up(h))

    def forward(self, idx):
        h = self.emb(idx)
        return self.down(checkpoint(self.block, h, use_reentrant=self.reentrant))


def _train(make, policy, tmp_path, steps=3, precision="bf16", run="", **kw):
    torch.manual_seed(0)
    model = make()
    d = tmp_path / f"{type(policy).__name__}{run}"  # one run owns a directory
    d.mkdir()
    tm = TieredModel(model, policy, optimizer=AdamW(lr=1e-2), precision=precision, nvme_dir=str(d), **kw)
    losses = []
    for i in range(steps):
        torch.manual_seed(100 + i)
        idx = torch.randint(0, V, (3, 5))
        logits = tm(idx)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx.reshape(-1))
        tm.backward(loss)
        res = tm.step()
        assert not res.skipped, "a step was skipped: something computed with a non-finite value"
        losses.append(loss.item())
    return tm, losses


@pytest.mark.parametrize("read", list(READS), ids=list(READS))
def test_any_read_of_an_off_device_weight_gives_zero_offloads_numbers(tmp_path, read):
    ref, ref_losses = _train(lambda: Reader(READS[read]), ZeroOffload(), tmp_path)
    tm, losses = _train(lambda: Reader(READS[read]), ZeroInfinity(), tmp_path)
    assert type(tm.module.pd["a"]) is OffDeviceWeight and type(tm.module.emb.weight) is OffDeviceWeight
    assert losses == ref_losses
    assert same_state(tm.state_dict(), ref.state_dict())


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_frozen_elementwise_weight_in_a_checkpointed_region(tmp_path, reentrant, precision):
    ref, ref_losses = _train(lambda: FrozenNormInCheckpoint(reentrant), ZeroOffload(), tmp_path, precision=precision)
    tm, losses = _train(lambda: FrozenNormInCheckpoint(reentrant), ZeroInfinity(), tmp_path, precision=precision)
    assert losses == ref_losses
    assert same_state(tm.state_dict(), ref.state_dict())


def test_reads_outside_the_schedule_are_counted_then_learned(tmp_path):
    """A read by another module's code is fetched for its op in the first step (no trace yet);
    the trace records it, so later steps prefetch it: no read waits for an on-demand fetch."""
    tm, _ = _train(lambda: Reader(READS[".T"]), ZeroInfinity(), tmp_path, steps=4)
    assert tm.report().weights_on_demand == {}
    stats = tm.param_offload.scheduler.stats
    assert stats.prefetches > 0
    # with prefetch off, the read waits for its fetch in each of steps 2-4 (the first has no trace
    # yet); backward finds the copy still on the device (nothing needed the room); the embedding,
    # read by the head too, was brought by its own module first
    off, _ = _train(lambda: Reader(READS[".T"]), ZeroInfinity(), tmp_path, steps=4, run="-off", prefetch=False)
    rep = off.report()
    assert rep.weights_on_demand == {"pd.a": 3}
    assert "fetched on demand" in str(rep) and "pd.a" in str(rep)


def _value(tm, name):
    return tm.state_dict()[name].to(torch.bfloat16)


def test_reads_outside_forward_see_the_real_values(tmp_path):
    tm, _ = _train(lambda: Reader(READS[".T"]), ZeroInfinity(), tmp_path)
    w, expect = tm.module.pd["a"], _value(tm, "pd.a")
    assert torch.equal(w.sum(), expect.sum())
    assert torch.equal(w.detach().clone(), expect)
    assert w.tolist() == expect.tolist()
    assert torch.equal(torch.from_numpy(w.detach().float().numpy()), expect.float())
    assert repr(expect) in repr(w) and "'pd.a', homed off the device" in repr(w)
    buf = io.BytesIO()
    torch.save(tm.module.state_dict(), buf)  # what a user's own checkpoint code does
    saved = torch.load(io.BytesIO(buf.getvalue()))
    assert type(saved["pd.a"]) is torch.Tensor and torch.equal(saved["pd.a"], expect)
    twin = copy.deepcopy(tm.module.pd)  # a plain copy, real values
    assert type(twin["a"]) is nn.Parameter and torch.equal(twin["a"].detach(), expect)
    assert not any(torch.isnan(p.detach().float()).any() for p in tm.module.parameters())


def test_writes_outside_resident_are_refused_and_change_nothing(tmp_path):
    tm, _ = _train(lambda: Reader(READS[".T"]), ZeroInfinity(), tmp_path)
    before = tm.state_dict()
    with torch.no_grad(), pytest.raises(TierMemError) as refused:
        tm.module.pd["a"].mul_(2)
    assert str(refused.value) == (
        "tiermem: mul_ writes into the weight 'pd.a', which lives off the device; write to it inside "
        "`with tm.resident(...)`, which sends the new values home and to the optimizer's master weights"
    )
    with torch.no_grad(), pytest.raises(TierMemError, match="resident"):
        tm.module.emb.weight[0].zero_()  # through a view
    assert same_state(tm.state_dict(), before)
    assert torch.equal(tm.module.pd["a"].detach().clone(), before["pd.a"].to(torch.bfloat16))


@pytest.mark.parametrize("policy", [ZeroOffload(), ZeroInfinity()], ids=["zero-offload", "zero-infinity"])
def test_writes_inside_resident_reach_master_and_home(tmp_path, policy):
    """The same writes under both policies (weights on the device, and off it) give the same
    masters and the same training afterwards."""
    runs = []
    for p in (ZeroOffload(), policy):
        tm, _ = _train(lambda: Reader(READS[".T"]), p, tmp_path, steps=2, run=str(len(runs)))
        before = tm.state_dict()
        with tm.resident(tm.module.pd), torch.no_grad():
            tm.module.pd["a"].mul_(0.5)
        with tm.resident([tm.module.lin.bias, tm.module.emb]), torch.no_grad():
            tm.module.lin.bias.zero_()
            tm.module.emb.weight[3].fill_(0.25)
        after = tm.state_dict()
        assert torch.equal(after["pd.a"], before["pd.a"].to(torch.bfloat16).float() * 0.5)
        assert torch.equal(after["lin.bias"], torch.zeros(D))
        assert torch.equal(after["emb.weight"][3], torch.full((D,), 0.25))
        assert torch.equal(after["emb.weight"][4], before["emb.weight"][4])  # untouched rows keep fp32 masters
        assert torch.equal(after["lin.weight"], before["lin.weight"])
        idx = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(7))
        logits = tm(idx)
        tm.backward(F.cross_entropy(logits.float().reshape(-1, V), idx.reshape(-1)))
        tm.step()
        runs.append(tm.state_dict())
    assert same_state(*runs)


def test_resident_refuses_what_is_not_the_models(tmp_path):
    tm, _ = _train(lambda: Reader(READS[".T"]), ZeroInfinity(), tmp_path, steps=1)
    with pytest.raises(TierMemError, match="not one of its parameters"):
        with tm.resident(nn.Linear(2, 2)):
            pass


def test_detach_gives_plain_parameters_and_the_same_objects(tmp_path):
    torch.manual_seed(0)
    model = Reader(READS[".T"])
    ids = {n: id(p) for n, p in model.named_parameters()}
    tm, _ = _train(lambda: model, ZeroInfinity(), tmp_path, steps=2)
    weights = tm.state_dict()
    out = tm.detach()
    for n, p in out.named_parameters():
        assert id(p) == ids[n] and type(p) is nn.Parameter and torch.equal(p.detach(), weights[n])


def test_a_dropped_models_weights_raise_when_read(tmp_path):
    torch.manual_seed(0)
    model = Reader(READS[".T"])
    tm, _ = _train(lambda: model, ZeroInfinity(), tmp_path, steps=1)
    del tm
    gc.collect()
    deferred.settle()
    with pytest.raises(TierMemError, match="dropped without detach"):
        model.pd["a"].sum()
    with pytest.raises(TierMemError, match="dropped without detach"):
        model(torch.zeros(1, 2, dtype=torch.long))
