"""Activation offload: saved tensors leave the device during forward and come back for backward.

Oracles: ZeroOffload on the same data (placement never changes the numbers: bit for bit on this
CPU-only machine), plain PyTorch's own saved tensors (what may move, and what must not), and
brute-force element offsets (which layouts overlap)."""

from __future__ import annotations

import copy
import gc
import os
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st
from models import Quirky, TinyGPT, gpt_batch, gpt_loss, same_state
from torch import nn

from tiermem import AdamW, Budgets, ConfigError, OutOfTierMemory, TensorClass, TensorInfo, Tier, TieredModel
from tiermem.memory.aligned import round_up
from tiermem.plan.policy import Policy
from tiermem.policies import ActivationOffload, KeepOnDevice, ZeroOffload
from tiermem.train.activations import MIN_OFFLOAD_BYTES

ACT = TensorClass.ACTIVATION
BATCH = 8  # TinyGPT's residual stream is then 8*11*24*2 = 4224 bytes in bf16: above one page


def _drain(tm: TieredModel) -> None:
    """Wait until every copy queued so far landed: the lanes run requests in order."""
    tm.engine.copy_async(torch.empty(1), torch.empty(1), src_tier=Tier.DEVICE, dst_tier=Tier.HOST).wait()
    tm.engine.run_async(lambda: None).wait()  # NVMe deletes of retired activations


def _gpt(policy, precision="bf16", *, steps=3, accum=1, together=False, nvme_dir=None, check=None):
    """Train TinyGPT; ``together``: all micro-batches' forwards first, then their backwards (several
    graphs alive at once). ``check(tm, alive)`` runs after every backward; ``alive``: graphs left."""
    torch.manual_seed(0)
    tm = TieredModel(
        TinyGPT(),
        policy,
        optimizer=AdamW(lr=1e-2, weight_decay=0.1),
        precision=precision,
        grad_clip=1.0,
        bucket_size=2000,
        nvme_dir=nvme_dir,
    )
    losses = []
    for i in range(steps):
        batches = [gpt_batch(10 * i + j, batch=BATCH) for j in range(accum)]
        if together:
            pending = [gpt_loss(tm(x), y) for x, y in batches]
        for j, (x, y) in enumerate(batches):
            loss = pending[j] if together else gpt_loss(tm(x), y)
            tm.backward(loss)
            losses.append(loss.item())
            if check is not None:
                check(tm, accum - 1 - j if together else 0)
        tm.step()
    return losses, tm.state_dict(), tm


def _same_run(a, b) -> None:
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


# -- the policy ---------------------------------------------------------------------------------
def _info(kind, nbytes, name="blocks.0.fc"):
    return TensorInfo(name, kind, nbytes, (nbytes // 2,), torch.bfloat16, name)


@pytest.mark.parametrize(
    "policy, info, tier",
    [
        (ActivationOffload(ZeroOffload()), _info(ACT, 2**20), Tier.HOST),
        (ActivationOffload(ZeroOffload()), _info(ACT, 2**20 - 2), Tier.DEVICE),
        (ActivationOffload(ZeroOffload(), tier=Tier.NVME, min_bytes="64KiB"), _info(ACT, 65536), Tier.NVME),
        (ActivationOffload(ZeroOffload(), min_bytes=0), _info(ACT, 0), Tier.HOST),
        (ActivationOffload(ZeroOffload(), min_bytes=0), _info(TensorClass.PARAM, 2**30), Tier.DEVICE),
        (ActivationOffload(ZeroOffload(), min_bytes=0), _info(TensorClass.GRAD, 2**30), Tier.HOST),
        (ActivationOffload(KeepOnDevice(), min_bytes=0), _info(TensorClass.OPTIM_STATE, 8), Tier.DEVICE),
        (
            ActivationOffload(ActivationOffload(ZeroOffload(), tier=Tier.NVME, min_bytes=100), min_bytes=10),
            _info(ACT, 50),
            Tier.HOST,
        ),
    ],
)
def test_policy_places_large_activations_on_its_tier(policy, info, tier):
    assert policy.place(info) is tier


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(list(TensorClass)),
    nbytes=st.integers(0, 2**40),
    min_bytes=st.integers(0, 2**40),
    tier=st.sampled_from([Tier.HOST, Tier.NVME]),
    base=st.sampled_from([ZeroOffload(), KeepOnDevice()]),
)
def test_policy_is_its_base_except_for_large_activations(kind, nbytes, min_bytes, tier, base):
    info = TensorInfo("m", kind, nbytes, (), torch.float32, "m")
    expect = tier if kind is ACT and nbytes >= min_bytes else base.place(info)
    assert ActivationOffload(base, tier=tier, min_bytes=min_bytes).place(info) is expect


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ActivationOffload("zero"), r"ActivationOffload.base='zero' is not a tiermem.Policy"),
        (lambda: ActivationOffload(ZeroOffload(), tier=Tier.DEVICE), r"tier=<Tier.DEVICE.*Tier.HOST or Tier.NVME"),
        (lambda: ActivationOffload(ZeroOffload(), tier="host"), r"tier='host' is invalid"),
        (lambda: ActivationOffload(ZeroOffload(), min_bytes=-1), r"ActivationOffload.min_bytes=-1 is negative"),
        (lambda: ActivationOffload(ZeroOffload(), min_bytes="lots"), r"min_bytes='lots' does not parse"),
    ],
)
def test_policy_refuses_bad_arguments(make, match):
    with pytest.raises(ConfigError, match=match) as e:
        make()
    assert str(e.value).startswith("tiermem:")


def test_policy_repr_and_min_bytes_parsed():
    p = ActivationOffload(ZeroOffload(), tier=Tier.NVME, min_bytes="1KiB")
    assert p.min_bytes == 1024
    assert repr(p) == "ActivationOffload(ZeroOffload(), tier=nvme, min_bytes=1024)"


# -- numbers ------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("tier", [Tier.HOST, Tier.NVME])
def test_offload_never_changes_the_numbers(precision, tier, tmp_path):
    base = _gpt(ZeroOffload(), precision)
    off = _gpt(ActivationOffload(ZeroOffload(), tier=tier, min_bytes=0), precision, nvme_dir=str(tmp_path))
    _same_run(base, off)
    tm = off[2]
    assert tm.activations.stats.offloaded[tier] >= 3 * 8  # every block's big tensors, every step
    rep = tm.report()
    assert rep.class_peak_bytes[(ACT, tier)] > 0
    assert rep.bytes_moved[(Tier.DEVICE, Tier.HOST)] > base[2].report().bytes_moved[(Tier.DEVICE, Tier.HOST)]
    if tier is Tier.NVME:
        assert rep.bytes_moved[(Tier.HOST, Tier.NVME)] == tm.activations.stats.offloaded_bytes[Tier.NVME]
        assert rep.bytes_moved[(Tier.NVME, Tier.HOST)] > 0


@pytest.mark.parametrize("together", [False, True])
def test_gradient_accumulation(together):
    """Three micro-batches per step; ``together``: three graphs alive at once before backward."""

    def empty_pool(tm, alive):  # nothing of a micro-batch outlives its backward
        for t in (Tier.DEVICE, Tier.HOST):
            assert (tm.stores[t].ledger.kind_used[ACT] > 0) == (alive > 0), (t, alive)

    base = _gpt(ZeroOffload(), accum=3, together=together)
    off = _gpt(ActivationOffload(ZeroOffload(), min_bytes=0), accum=3, together=together, check=empty_pool)
    _same_run(base, off)
    for t in (Tier.DEVICE, Tier.HOST):
        assert off[2].stores[t].ledger.kind_used[ACT] == 0
    assert off[2].report().class_peak_bytes[(ACT, Tier.HOST)] > 0


def test_models_with_buffers_and_frozen_layers_match():
    def run(policy):
        torch.manual_seed(3)
        tm = TieredModel(Quirky(), policy, optimizer=AdamW(lr=1e-2), precision="bf16", bucket_size=300)
        for i in range(3):
            g = torch.Generator().manual_seed(i)
            y, z = tm(torch.randn(256, 13, generator=g), use_branch=i % 2 == 1)
            tm.backward(y.float().pow(2).mean() + (z.float().mean() if z is not None else 0))
            tm.step()
        return tm.state_dict(), tm

    (a, _), (b, tm) = run(ZeroOffload()), run(ActivationOffload(ZeroOffload(), min_bytes=0))
    assert same_state(a, b)
    assert tm.activations.stats.offloaded[Tier.HOST] > 0


# -- what moves, and what never does ---------------------------------------------------------------
class _OneModule(Policy):
    """ZeRO-Offload, with the activations of one named module on the host; records what it is
    asked about activations."""

    def __init__(self, module: str):
        self.module, self.asked = module, []

    def place(self, info):
        if info.kind is ACT:
            self.asked.append(info)
            return Tier.HOST if info.module == self.module else Tier.DEVICE
        return ZeroOffload().place(info)


def test_a_policy_offloading_one_module_is_honoured():
    torch.manual_seed(0)
    base = TieredModel(TinyGPT(), precision="bf16")
    policy = _OneModule("blocks.1")  # the block saves the input of its gelu: 8*11*72*2 bytes
    torch.manual_seed(0)
    tm = TieredModel(TinyGPT(), policy, precision="bf16")
    x, y = gpt_batch(0, batch=BATCH)
    used = {}
    for name, m in (("base", base), ("offload", tm)):
        dev = m.stores[Tier.DEVICE].ledger
        loss = gpt_loss(m(x), y)
        _drain(m)
        used[name] = dev.kind_used[ACT]
        dev.reset_peak()
        m.backward(loss)
        used[name + " backward peak"] = dev.kind_peak[ACT]
    stats = tm.activations.stats
    assert dict(stats.by_module) == {"blocks.1": 1} and stats.offloaded_bytes[Tier.HOST] == 8 * 11 * 72 * 2
    # the device holds exactly that much less once the copy landed, and less during backward too
    assert used["offload"] == used["base"] - stats.offloaded_bytes[Tier.HOST]
    assert used["offload backward peak"] < used["base"]
    assert tm.report().class_peak_bytes[(ACT, Tier.HOST)] >= 8 * 11 * 72 * 2
    modules = dict(tm.module.named_modules())
    assert {i.module for i in policy.asked} >= {"blocks.0.fc", "blocks.1", "ln_f", "head"}
    for info in policy.asked:  # real descriptions of real tensors
        assert info.name == info.module and info.module in modules and info.kind is ACT
        assert info.nbytes >= info.numel * info.dtype.itemsize  # the storage the tensor views
        assert info.nbytes >= MIN_OFFLOAD_BYTES
        assert info.dtype == torch.bfloat16


class _Weights(nn.Module):
    """Weights and a buffer larger than the activations, used through views (w.t(), a slice)."""

    def __init__(self, d: int = 96):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.v = nn.Linear(d, d)
        self.u = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        h = torch.tanh(x @ self.w.t())
        h = self.v(h) * self.scale
        return torch.sigmoid(h @ self.u[:, :64])


def _saved_by_plain_torch(model, x):
    """(weights saved, sizes of the storages that may move), by plain PyTorch's own hooks."""
    weights = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen, counts, sizes = [], [0], []

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in weights:
            counts[0] += 1
        elif not any(ptr == s.untyped_storage().data_ptr() for s in seen):  # a storage moves once
            seen.append(t)  # held, so no later storage takes its address
            if t.untyped_storage().nbytes() >= MIN_OFFLOAD_BYTES:
                sizes.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).float().sum().backward()
    return counts[0], sizes


def test_parameters_and_buffers_are_never_offloaded():
    torch.manual_seed(0)
    model = _Weights()
    plain = copy.deepcopy(model).to(torch.bfloat16)
    x = torch.randn(64, 96, requires_grad=True)  # so matmuls save the weights' views too
    weights, sizes = _saved_by_plain_torch(plain, x.to(torch.bfloat16))
    assert weights >= 4 and len(sizes) >= 3  # w.t(), v.weight, scale, u[:, :64]; x, tanh, v's output, ...
    tm = TieredModel(model, ActivationOffload(ZeroOffload(), min_bytes=0), precision="bf16")
    tm.backward(tm(x).float().sum())
    stats = tm.activations.stats
    assert stats.weights == weights
    assert stats.offloaded[Tier.HOST] == len(sizes) and stats.offloaded_bytes[Tier.HOST] == sum(sizes)
    # all of a forward's offloaded activations are alive at its end: the host holds them, no more
    assert tm.report().class_peak_bytes[(ACT, Tier.HOST)] == sum(round_up(n) for n in sizes)


# -- layouts: every view comes back as it was --------------------------------------------------
class _CheckSaved(torch.autograd.Function):
    """Saves its input; in backward, records what came back next to what was saved."""

    log: list = []

    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        ctx.expect = (a.shape, a.stride(), a.storage_offset(), a.detach().clone())
        return a.sum()

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        _CheckSaved.log.append((ctx.expect, (a.shape, a.stride(), a.storage_offset(), a.detach().clone())))
        return g.expand(a.shape)


class _Viewer(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.ones(()))

    def forward(self, x, make):
        h = x * self.p  # saves x
        return _CheckSaved.apply(make(h)) + _CheckSaved.apply(make(h)[-1:])  # two views of h


@pytest.fixture(scope="module")
def viewer_tm():
    return TieredModel(_Viewer(), ActivationOffload(ZeroOffload(), min_bytes=0), precision="fp32")


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 12), min_size=2, max_size=4), data=st.data())
def test_saved_views_come_back_with_their_layout_and_bits(viewer_tm, shape, data):
    """Permuted, strided, offset and expanded (overlapping) views: same size, stride, offset and
    bits after the round trip; the two views of one storage move it once."""
    perm = data.draw(st.permutations(range(len(shape) + 1)))
    step = data.draw(st.integers(1, 3))
    expand = data.draw(st.booleans())

    def make(h):
        v = h.permute(*perm)[..., ::step]
        return v[..., :1].expand(*v.shape[:-1], 40) if expand else v

    x = torch.randn(*shape, 40)  # the last dim keeps most storages above one page
    stats = viewer_tm.activations.stats
    before = stats.offloaded[Tier.HOST]
    _CheckSaved.log.clear()
    viewer_tm.backward(viewer_tm(x, make).float())
    assert len(_CheckSaved.log) == 2
    for expect, got in _CheckSaved.log:
        assert got[:3] == expect[:3]
        assert torch.equal(got[3], expect[3])
    assert stats.offloaded[Tier.HOST] - before == 2 * (x.numel() * 4 >= MIN_OFFLOAD_BYTES)  # x and h


# -- prefetch and stall ---------------------------------------------------------------------------
class _Chain(nn.Module):
    def __init__(self, d: int = 96, n: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("window", [0, 2])
def test_backward_fetches_ahead_in_reverse_order(window):
    tm = TieredModel(_Chain(), ActivationOffload(ZeroOffload(), min_bytes=0), precision="bf16")
    tm.activations.window = window
    steps = 3
    for _ in range(steps):
        tm.backward(tm(torch.randn(32, 96)).float().pow(2).mean())
    s = tm.activations.stats
    assert s.offloaded[Tier.HOST] == steps * 7  # the input and each tanh output (the next layer's input)
    assert s.fetched_ahead + s.fetched_on_demand + s.still_on_device == s.offloaded[Tier.HOST]
    if window == 0:
        assert s.fetched_ahead == 0
    else:  # a chain unpacks in exact reverse order: only the first unpack of a backward is unprepared
        assert s.fetched_on_demand <= steps and s.fetched_ahead > 0


def test_waiting_on_a_slow_tier_counts_as_device_stall(tmp_path):
    tm = TieredModel(
        _Chain(),
        ActivationOffload(ZeroOffload(), tier=Tier.NVME, min_bytes=0),
        precision="bf16",
        nvme_dir=str(tmp_path),
    )
    store = tm.stores[Tier.NVME]
    fast = store._preadv

    def slow(fd, bufs, offset):  # the seam test_nvme uses to inject failures
        time.sleep(0.03)
        return fast(fd, bufs, offset)

    store._preadv = slow
    loss = tm(torch.randn(32, 96)).float().pow(2).mean()
    _drain(tm)  # every activation reached the host (a fetch before that keeps the device copy: no read)
    tm.backward(loss)
    rep = tm.report()
    assert rep.stall_seconds_per_tier[Tier.DEVICE] >= 0.02
    assert rep.bytes_moved[(Tier.NVME, Tier.HOST)] > 0
    _drain(tm)
    assert tm.stores[Tier.NVME].ledger.kind_used[ACT] == 0
    assert not [f for f in os.listdir(tmp_path) if f.startswith("activation")]


# -- buffers go back; inference; detach; errors ---------------------------------------------------
@pytest.mark.parametrize("tier", [Tier.HOST, Tier.NVME])
def test_offloaded_buffers_return_to_the_pool(tier, tmp_path):
    allocations = []

    def check(tm, alive):
        for t in (Tier.DEVICE, Tier.HOST):
            assert tm.stores[t].ledger.kind_used[ACT] == 0, t
        allocations.append(tm.stores[Tier.HOST].allocations)

    _, _, tm = _gpt(
        ActivationOffload(ZeroOffload(), tier=tier, min_bytes=0), steps=4, nvme_dir=str(tmp_path), check=check
    )
    if tier is Tier.HOST:  # at most all of a forward's records at once, every step: the pool has them
        # (the grads' buffers alone are new each step: their memory goes back to the system after it,
        # NOTE [Grads come and go])
        assert allocations[-1] - allocations[0] == (len(allocations) - 1) * len(tm.layout.buckets)
    assert tm.report().class_peak_bytes[(ACT, Tier.HOST)] > 0
    _drain(tm)
    if tier is Tier.NVME:
        assert tm.stores[Tier.NVME].ledger.kind_used[ACT] == 0
        assert tm.report().class_peak_bytes[(ACT, Tier.NVME)] > 0
        assert not [f for f in os.listdir(tmp_path) if f.startswith("activation")]


def test_inference_and_eval_pack_nothing():
    x, y = gpt_batch(0, batch=BATCH)
    torch.manual_seed(0)
    base = TieredModel(TinyGPT(), precision="bf16")
    torch.manual_seed(0)
    tm = TieredModel(TinyGPT(), ActivationOffload(ZeroOffload(), min_bytes=0), precision="bf16")
    with torch.no_grad():
        assert torch.equal(tm(x), base(x))  # train mode, no grad
        tm.eval()
        assert torch.equal(tm(x), base.eval()(x))
    loss = gpt_loss(tm(x), y)  # eval with grad: nothing packed, backward still works
    tm.backward(loss)
    assert tm.activations.stats.saved == 0
    assert tm.report().class_peak_bytes.get((ACT, Tier.HOST), 0) == 0
    tm.train()
    tm.backward(gpt_loss(tm(x), y))
    assert tm.activations.stats.offloaded[Tier.HOST] > 0


def test_detach_removes_the_module_hooks():
    model = TinyGPT()
    tm = TieredModel(model, _OneModule("blocks.1"), precision="bf16")  # a policy that needs the module hooks
    x, y = gpt_batch(0, batch=BATCH)
    tm.backward(gpt_loss(tm(x), y))
    alive = gpt_loss(tm(x), y)  # a graph still holding offloaded activations at detach
    assert len(tm.hooks) >= 2 * len(list(model.modules()))
    m = tm.detach()
    del alive
    for mod in m.modules():
        assert not mod._forward_hooks and not mod._forward_pre_hooks
    gpt_loss(m(x), y).backward()  # plain torch again
    assert all(p.grad is not None for p in m.parameters())


class _Junk(Policy):
    def place(self, info):
        return "pinned" if info.kind is ACT else ZeroOffload().place(info)


def _tight(budget_tier: Tier) -> TieredModel:
    """A model whose budget on ``budget_tier`` holds its training state and little more."""
    torch.manual_seed(0)
    probe = TieredModel(TinyGPT(), precision="bf16")
    used = probe.stores[budget_tier].used
    if budget_tier is Tier.DEVICE:
        largest_grad = max(p.numel() for p in probe.module.parameters()) * 2
        budgets = Budgets(device=used + largest_grad)
    else:
        budgets = Budgets(host=used + 4096)  # less than one TinyGPT activation, page-rounded
    return TieredModel(
        TinyGPT(),
        ActivationOffload(ZeroOffload(), min_bytes=0) if budget_tier is Tier.HOST else ZeroOffload(),
        precision="bf16",
        budgets=budgets,
    )


@pytest.mark.parametrize(
    "make, err, match",
    [
        (
            lambda: TieredModel(TinyGPT(), ActivationOffload(ZeroOffload(), tier=Tier.NVME, min_bytes=0)),
            ConfigError,
            r"places an activation of module '.*' \(.*\) on nvme, but no nvme store.*pass nvme_dir",
        ),
        (lambda: TieredModel(TinyGPT(), _Junk()), ConfigError, r"returned 'pinned' for '.*' \(activation\)"),
        (
            lambda: _tight(Tier.HOST),
            OutOfTierMemory,
            r"out of host memory placing 'an offloaded activation'.*raise Budgets\(host=\.\.\.\), raise "
            r"ActivationOffload's min_bytes",
        ),
        (
            lambda: _tight(Tier.DEVICE),
            OutOfTierMemory,
            r"out of device memory placing 'activations saved for backward'.*offload activations",
        ),
    ],
)
def test_errors_in_forward_say_what_to_change(make, err, match):
    tm = make()
    x, y = gpt_batch(0, batch=BATCH)
    with pytest.raises(err, match=match) as e:
        tm.backward(gpt_loss(tm(x), y))
    assert str(e.value).startswith("tiermem:")
    del e  # its traceback holds the half-built graph
    gc.collect()
    for t in (Tier.DEVICE, Tier.HOST):  # a failed forward leaves nothing behind
        assert tm.stores[t].ledger.kind_used.get(ACT, 0) == 0


# -- one async mechanism: every leg through the engine -------------------------------------------
@pytest.mark.parametrize("tier", [Tier.HOST, Tier.NVME])
def test_a_step_leaves_no_reference_cycle(tier, tmp_path):
    """Records, chains and leases let go of each other once retired: nothing waits for the GC."""
    tm = TieredModel(
        _Chain(), ActivationOffload(ZeroOffload(), tier=tier, min_bytes=0), precision="bf16", nvme_dir=str(tmp_path)
    )
    tm.backward(tm(torch.randn(32, 96)).float().pow(2).mean())
    tm.step()  # the first step compiles the optimizer, which leaves cycles of its own
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):
            tm.backward(tm(torch.randn(32, 96)).float().pow(2).mean())
            tm.step()
        _drain(tm)
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_the_nvme_legs_are_counted_by_the_engine(tmp_path):
    tm = TieredModel(
        _Chain(),
        ActivationOffload(ZeroOffload(), tier=Tier.NVME, min_bytes=0),
        precision="bf16",
        nvme_dir=str(tmp_path),
    )
    tm.backward(tm(torch.randn(32, 96)).float().pow(2).mean())
    rep, stats = tm.report(), tm.activations.stats
    sent = stats.offloaded_bytes[Tier.NVME]
    back = rep.class_bytes_moved[(ACT, Tier.NVME, Tier.HOST)]  # what was not still on the device
    assert (
        rep.class_bytes_moved[(ACT, Tier.DEVICE, Tier.HOST)]
        == rep.class_bytes_moved[(ACT, Tier.HOST, Tier.NVME)]
        == sent
    )
    assert rep.class_bytes_moved[(ACT, Tier.HOST, Tier.DEVICE)] == back
    assert back == sent * (stats.fetched_ahead + stats.fetched_on_demand) // stats.offloaded[Tier.NVME] > 0
    for leg in ((Tier.DEVICE, Tier.HOST), (Tier.HOST, Tier.NVME), (Tier.NVME, Tier.HOST), (Tier.HOST, Tier.DEVICE)):
        assert rep.busy_seconds[leg] > 0, leg


def test_a_failed_nvme_read_surfaces_at_backward_and_gives_staging_back(tmp_path):
    torch.manual_seed(0)
    model = _Chain()
    plain = TieredModel(copy.deepcopy(model), ZeroOffload(), precision="bf16")  # the oracle: same numbers
    tm = TieredModel(
        model, ActivationOffload(ZeroOffload(), tier=Tier.NVME, min_bytes=0), precision="bf16", nvme_dir=str(tmp_path)
    )
    store = tm.stores[Tier.NVME]
    real = store._preadv

    def broken(fd, bufs, offset):
        raise OSError(5, "Input/output error")

    store._preadv = broken
    dev = tm.stores[Tier.DEVICE].ledger
    dev_before = dev.used
    loss = tm(torch.randn(32, 96)).float().pow(2).mean()
    host = tm.stores[Tier.HOST].ledger
    assert _soon(lambda: not host.kind_used.get(ACT, 0))  # the forward's writes landed
    with pytest.raises(OSError, match="Input/output error"):
        tm.backward(loss)
    tm.activations.release()
    assert _soon(lambda: not host.kind_used.get(ACT, 0))  # the failed fetches gave their staging back
    # and their device bytes, though the failed graph is still referenced (``loss``)
    assert _soon(lambda: dev.used == dev_before and not dev.kind_used.get(ACT, 0)), dev.kind_used
    store._preadv = real  # the disk is back: the documented recovery is forward and backward again
    x = torch.randn(32, 96)
    for m in (tm, plain):
        m.backward(m(x).float().pow(2).mean())
        m.step()
    assert same_state(tm.state_dict(), plain.state_dict())
    assert _soon(lambda: dev.used == dev_before)


def _soon(cond, timeout: float = 30.0) -> bool:
    """Whether ``cond()`` holds within ``timeout`` seconds (NVMe requests end on their own threads)."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return cond()
