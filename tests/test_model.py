"""TieredModel against plain PyTorch: the same training loop with torch.optim must give the same
weights (fp32), the same math in low precision, and bit-identical results under every policy."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from models import Quirky, TinyGPT, gpt_batch, gpt_loss, same_state
from torch import nn

import tiermem.optim
from tiermem import (
    Adam,
    AdamW,
    Budgets,
    ConfigError,
    OutOfTierMemory,
    Phase,
    TensorClass,
    Tier,
    TieredModel,
    TierMemError,
)
from tiermem.plan.policy import Policy
from tiermem.policies import KeepOnDevice, ZeroOffload

STEPS = 6


def _torch_opt(spec, params):
    cls = torch.optim.AdamW if isinstance(spec, AdamW) else torch.optim.Adam
    return cls(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay, foreach=False)


def _train_torch(model, spec, *, steps=STEPS, clip=None, accum=1, sched=False):
    opt = _torch_opt(spec, model.parameters())
    s = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if sched else None
    losses = []
    for i in range(steps):
        for j in range(accum):
            x, y = gpt_batch(100 * i + j)
            loss = gpt_loss(model(x), y)
            loss.backward()
        losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if s:
            s.step()
    return losses


def _train_tm(tm, *, steps=STEPS, accum=1, sched=False, allow_skip=False):
    s = torch.optim.lr_scheduler.StepLR(tm.optimizer, step_size=2, gamma=0.5) if sched else None
    losses = []
    for i in range(steps):
        for j in range(accum):
            x, y = gpt_batch(100 * i + j)
            loss = gpt_loss(tm(x), y)
            tm.backward(loss)
        losses.append(loss.item())
        res = tm.step()
        assert allow_skip or not res.skipped
        if s:
            s.step()
    return losses


@pytest.mark.parametrize(
    "spec, clip, accum, sched",
    [
        (AdamW(lr=1e-2, weight_decay=0.1), None, 1, False),
        (Adam(lr=1e-2, weight_decay=0.05), None, 1, False),
        (AdamW(lr=1e-2, betas=(0.8, 0.99)), 0.05, 1, False),  # clipping active (norms are ~1)
        (Adam(lr=5e-3), 0.1, 3, True),  # gradient accumulation over 3 backward calls + scheduler
    ],
)
def test_fp32_matches_torch_adamw(spec, clip, accum, sched):
    torch.manual_seed(0)
    ref = TinyGPT()
    mine = copy.deepcopy(ref)
    ref_losses = _train_torch(ref, spec, clip=clip, accum=accum, sched=sched)
    tm = TieredModel(mine, optimizer=spec, precision="fp32", grad_clip=clip, bucket_size=3000)
    assert len(tm.layout.buckets) > 3  # many buckets, to exercise the per-bucket pipeline
    losses = _train_tm(tm, accum=accum, sched=sched)
    # fp32 tolerance: the fused kernel and torch's for-loop Adam may round differently in the last
    # bit (and the clip coefficient comes from a norm summed in another order), so allow a few
    # ulps per step on weights of order 0.1-1 over STEPS steps.
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    got = tm.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)


def _reference_low_precision(model, spec, precision, *, steps=STEPS, clip=None, scale=2.0**16):
    """Plain torch with low-precision working weights and fp32 master weights: the same math."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    master = [p.detach().clone().float().requires_grad_(False) for p in model.parameters()]
    for p, m in zip(model.parameters(), master):
        p.data = m.to(dtype)
    opt = _torch_opt(spec, [torch.nn.Parameter(m) for m in master])
    masters = [g for grp in opt.param_groups for g in grp["params"]]
    losses = []
    for i in range(steps):
        x, y = gpt_batch(100 * i)
        loss = gpt_loss(model(x), y)
        (loss * scale if precision == "fp16" else loss).backward()
        losses.append(loss.item())
        grads = [p.grad.float() / (scale if precision == "fp16" else 1.0) for p in model.parameters()]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        if not torch.isfinite(norm):  # fp16 overflow: skip the step, halve the scale
            scale /= 2
            for p in model.parameters():
                p.grad = None
            continue
        coef = torch.clamp(clip / (norm + 1e-6), max=1.0) if clip else 1.0
        for m, g in zip(masters, grads):
            m.grad = g * coef
        opt.step()
        for p, m in zip(model.parameters(), masters):
            p.data = m.detach().to(dtype)
            p.grad = None
    return losses, [m.detach() for m in masters]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_matches_plain_torch_reference(precision):
    torch.manual_seed(1)
    ref = TinyGPT()
    ref.head.weight = nn.Parameter(ref.head.weight.detach().clone())  # untie: plain torch loop is simpler
    mine = copy.deepcopy(ref)
    spec = AdamW(lr=1e-2, weight_decay=0.1)
    ref_losses, ref_masters = _reference_low_precision(ref, spec, precision, clip=1.0)
    tm = TieredModel(mine, optimizer=spec, precision=precision, grad_clip=1.0, bucket_size=4000)
    losses = _train_tm(tm, allow_skip=precision == "fp16")
    assert tm.module.wte.weight.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    # Same math, but the fused kernel may round the last fp32 bit differently; a flipped bf16
    # rounding of one weight then shifts later losses slightly. Losses agree to 1e-2 relative.
    torch.testing.assert_close(losses, ref_losses, rtol=1e-2, atol=1e-3)
    sd = tm.state_dict()
    for (name, _), m in zip(ref.named_parameters(), ref_masters):
        torch.testing.assert_close(sd[name], m, rtol=0, atol=2e-3, msg=name)


def _run_policy(policy, precision, steps=4, quirky=False):
    torch.manual_seed(2)
    model = Quirky() if quirky else TinyGPT()
    tm = TieredModel(model, policy, optimizer=AdamW(lr=1e-2), precision=precision, grad_clip=0.5, bucket_size=2000)
    losses = []
    for i in range(steps):
        if quirky:
            g = torch.Generator().manual_seed(i)
            y, z = tm(torch.randn(8, 13, generator=g), use_branch=i % 2 == 1)
            loss = y.float().pow(2).mean() + (z.float().mean() if z is not None else 0)
        else:
            x, yy = gpt_batch(i)
            loss = gpt_loss(tm(x), yy)
        tm.backward(loss)
        losses.append(loss.item())
        tm.step()
    return losses, tm.state_dict(), tm


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("quirky", [False, True])
def test_placement_never_changes_the_numbers(precision, quirky):
    a_losses, a_sd, _ = _run_policy(ZeroOffload(), precision, quirky=quirky)
    b_losses, b_sd, _ = _run_policy(KeepOnDevice(), precision, quirky=quirky)
    assert a_losses == b_losses
    assert a_sd.keys() == b_sd.keys()
    for k in a_sd:
        assert torch.equal(a_sd[k], b_sd[k]), k


def test_models_as_users_write_them_match_torch():
    """Tied weights, buffers, frozen params, a branch without grad in some steps, two outputs."""
    torch.manual_seed(3)
    ref = Quirky()
    mine = copy.deepcopy(ref)
    spec = AdamW(lr=1e-2, weight_decay=0.1)
    opt = _torch_opt(spec, [p for p in ref.parameters() if p.requires_grad])
    tm = TieredModel(mine, optimizer=spec, precision="fp32", bucket_size=300)
    for i in range(5):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, 13, generator=g)
        for model, step in ((ref, None), (tm, tm.step)):
            y, z = model(x, use_branch=i % 2 == 1)
            loss = y.pow(2).mean() + (z.mean() if z is not None else 0)
            if step is None:
                loss.backward()
                opt.step()
                opt.zero_grad()
            else:
                tm.backward(loss)
                step()
    got = tm.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert torch.equal(got["frozen.weight"], ref.frozen.weight)  # frozen stays bit-exact
    assert got["bn.num_batches_tracked"].item() == 5


def test_tied_weights_are_one_parameter():
    tm = TieredModel(TinyGPT(), precision="bf16")
    assert tm.module.head.weight is tm.module.wte.weight
    sd = tm.state_dict()
    assert torch.equal(sd["head.weight"], sd["wte.weight"])
    assert "wte.weight" in [n for g in tm.optimizer.param_groups for n in g["param_names"]]
    assert "head.weight" not in [n for g in tm.optimizer.param_groups for n in g["param_names"]]


def test_fp16_overflow_skips_and_halves_scale():
    torch.manual_seed(4)
    tm = TieredModel(TinyGPT(), optimizer=AdamW(lr=1e-2), precision="fp16", bucket_size=3000)
    x, y = gpt_batch(0)
    for _ in range(8):  # the initial scale 2**16 overflows fp16 at first; it backs off until it fits
        tm.backward(gpt_loss(tm(x), y))
        if not tm.step().skipped:
            break
    assert tm.stepper.steps == 1
    before = {k: v.clone() for k, v in tm.state_dict().items()}
    moments = [tm.layout.homes.state[b.index].read(b)[1].clone() for b in tm.layout.buckets]
    scale = tm.scaler.scale
    tm.backward(gpt_loss(tm(x), y) * float("inf"))
    res = tm.step()
    assert res.skipped and res.loss_scale == scale / 2 and res.step == 1
    assert not math.isfinite(res.grad_norm)
    after = tm.state_dict()
    assert same_state(before, after)
    assert all(torch.equal(m, tm.layout.homes.state[b.index].read(b)[1]) for m, b in zip(moments, tm.layout.buckets))
    tm.backward(gpt_loss(tm(x), y))  # and training goes on
    assert not tm.step().skipped


def test_resume_is_bit_identical(tmp_path):
    def make(bucket):
        torch.manual_seed(5)
        return TieredModel(TinyGPT(), optimizer=AdamW(lr=1e-2), precision="fp16", grad_clip=1.0, bucket_size=bucket)

    def train(tm, steps, offset):
        for i in range(offset, offset + steps):
            x, y = gpt_batch(i)
            tm.backward(gpt_loss(tm(x), y))
            tm.step()

    full = make(2000)
    train(full, 6, 0)
    first = make(2000)
    train(first, 3, 0)
    path = str(tmp_path / "ckpt.pt")
    first.save(path)
    second = make(5000)  # a different bucket size still loads: keyed by name
    second.load(path)
    assert second.stepper.steps == first.stepper.steps and second.scaler.scale == first.scaler.scale
    train(second, 3, 3)
    a, b = full.state_dict(), second.state_dict()
    assert same_state(a, b)
    assert torch.equal(full.module.wte.weight, second.module.wte.weight)


def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    tm = TieredModel(TinyGPT(), precision="bf16")
    path = str(tmp_path / "ckpt.pt")
    tm.save(path)
    before = open(path, "rb").read()
    x, y = gpt_batch(0)
    tm.backward(gpt_loss(tm(x), y))
    tm.step()

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    from tiermem import StoreError
    from tiermem.checkpoint import file as checkpoint

    monkeypatch.setattr(checkpoint.os, "fsync", full_disk)
    with pytest.raises(StoreError, match="No space left on device.*previous checkpoint there is unchanged"):
        tm.save(path)
    monkeypatch.undo()
    assert open(path, "rb").read() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left behind
    fresh = TieredModel(TinyGPT(), precision="bf16")
    fresh.load(path)


def test_load_rejects_bad_files(tmp_path):
    tm = TieredModel(TinyGPT(), precision="bf16")
    from tiermem import StoreError, TierMemError

    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\x00not a checkpoint" * 10)
    with pytest.raises(StoreError, match="not a readable tiermem checkpoint"):
        tm.load(str(junk))
    good = tmp_path / "good.pt"
    tm.save(str(good))
    data = bytearray(good.read_bytes())
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(StoreError, match="truncated"):
        tm.load(str(tmp_path / "truncated.pt"))
    spoilt = bytes(data).replace(b'"dtype": "float32"', b'"dtype": "floatXX"', 1)  # same length
    (tmp_path / "footer.pt").write_bytes(spoilt)
    with pytest.raises(StoreError, match="corrupt footer"):
        tm.load(str(tmp_path / "footer.pt"))
    data[100] ^= 0xFF  # one flipped byte in the tensor data
    (tmp_path / "flipped.pt").write_bytes(data)
    with pytest.raises(StoreError, match="fails its checksum"):
        tm.load(str(tmp_path / "flipped.pt"))
    with pytest.raises(StoreError, match="no checkpoint at"):
        tm.load(str(tmp_path / "missing.pt"))
    other = TieredModel(TinyGPT(d=16), precision="bf16")
    other.save(str(tmp_path / "other.pt"))
    before = tm.state_dict()
    with pytest.raises(TierMemError, match="has shape"):
        tm.load(str(tmp_path / "other.pt"))
    after = tm.state_dict()
    assert same_state(before, after)  # nothing changed


def test_detach_removes_hooks_and_trains_with_plain_torch():
    model = TinyGPT()
    tm = TieredModel(model, precision="bf16", bucket_size=3000)
    x, y = gpt_batch(0)
    tm.backward(gpt_loss(tm(x), y))
    tm.step()
    sd = tm.state_dict()
    m = tm.detach()
    assert m is model
    for name, p in m.named_parameters():
        assert p.dtype == torch.float32 and not p._post_accumulate_grad_hooks, name
        assert torch.equal(p.detach(), sd[name])
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    loss = gpt_loss(m(x), y)
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())
    opt.step()
    with pytest.raises(ConfigError, match="detached"):
        tm(x)


def test_inference_and_modes():
    tm = TieredModel(TinyGPT(), precision="bf16")
    x, _ = gpt_batch(0)
    tm.eval()
    assert not tm.module.training
    with torch.no_grad():
        out = tm(x)
    assert out.dtype == torch.bfloat16 and not out.requires_grad
    assert tm.report().class_peak_bytes.get((TensorClass.ACTIVATION, Tier.DEVICE), 0) == 0
    tm.train()
    assert tm.training


def test_report_shows_zero_offload_placement():
    tm = TieredModel(TinyGPT(d=32, n_layer=3), precision="bf16", bucket_size=4000)
    for i in range(2):
        x, y = gpt_batch(i)
        tm.backward(gpt_loss(tm(x), y))
        tm.step()
    rep = tm.report()
    n = tm.layout.n_params
    cp = rep.class_peak_bytes
    pages = 4096 * len(tm.layout.buckets)  # host buffers are page-aligned: each rounds up < 1 page
    assert cp[(TensorClass.PARAM, Tier.DEVICE)] == 2 * n
    assert 12 * n <= cp[(TensorClass.OPTIM_STATE, Tier.HOST)] < 12 * n + 3 * pages
    assert 4 * n <= cp[(TensorClass.GRAD, Tier.HOST)] < 4 * n + pages
    assert 0 < cp[(TensorClass.GRAD, Tier.DEVICE)] <= 2 * n  # bf16 grads in flight, freed once copied
    assert tm.stores[Tier.DEVICE].ledger.kind_used[TensorClass.GRAD] == 0
    assert cp[(TensorClass.ACTIVATION, Tier.DEVICE)] > 0
    assert (TensorClass.OPTIM_STATE, Tier.DEVICE) not in cp
    assert rep.bytes_moved[(Tier.DEVICE, Tier.HOST)] == 2 * 2 * n  # bf16 grads, two steps
    assert rep.class_bytes_moved[(TensorClass.GRAD, Tier.DEVICE, Tier.HOST)] == 2 * 2 * n
    if next(tm.module.parameters()).device.type == "cpu":  # NOTE [A CPU device]: Adam writes the weights in place
        assert (Tier.HOST, Tier.DEVICE) not in rep.bytes_moved
        assert (TensorClass.PARAM, Tier.HOST) not in cp  # no staging
        assert rep.peak_bytes[Tier.HOST] < 16 * n + 6 * pages
    else:
        assert rep.bytes_moved[(Tier.HOST, Tier.DEVICE)] == 2 * 2 * n  # bf16 weights, two steps
        assert rep.class_bytes_moved[(TensorClass.PARAM, Tier.HOST, Tier.DEVICE)] == 2 * 2 * n
        assert rep.peak_bytes[Tier.HOST] < 16 * n + 2 * 2 * 4000 + 6 * pages  # 16 B/param + 2 buckets of staging
    text = str(rep)
    assert "device" in text and "device->host" in text and "optim_state" in text


class _Bad(Policy):
    def place(self, info):
        return "gpu"


class _GradsOnNvmeStateOnDevice(Policy):
    def place(self, info):
        return Tier.NVME if info.kind is TensorClass.GRAD else Tier.DEVICE


@pytest.mark.parametrize(
    "make, err, match",
    [
        (lambda: TieredModel("not a module"), ConfigError, "needs a torch.nn.Module, got str"),
        (lambda: TieredModel(TinyGPT(), precision="fp8"), ConfigError, "precision='fp8' is not supported"),
        (lambda: TieredModel(TinyGPT(), _Bad()), ConfigError, r"returned 'gpu' for '.*'"),
        (lambda: TieredModel(TinyGPT(), "zero"), ConfigError, "is not a tiermem.Policy"),
        (
            lambda: TieredModel(TinyGPT(), _GradsOnNvmeStateOnDevice(), nvme_dir="."),
            ConfigError,
            r"grads on NVMe but its optimizer state on the device.*place OPTIM_STATE on HOST or NVME",
        ),
        (lambda: TieredModel(TinyGPT(), optimizer=torch.optim.SGD), ConfigError, "not an optimizer tiermem runs"),
        (lambda: TieredModel(TinyGPT(), grad_clip=-1), ConfigError, "grad_clip=-1 is invalid"),
        (
            lambda: TieredModel(TinyGPT(), budgets=Budgets(device="10KB")),
            OutOfTierMemory,
            r"out of device memory.*it needs .* \(working weights",
        ),
        (lambda: TieredModel(TinyGPT(), budgets=Budgets(host=1000)), OutOfTierMemory, r"raise Budgets\(host=\.\.\.\)"),
        (lambda: TieredModel(nn.Linear(3, 3).requires_grad_(False)), TierMemError, "no trainable parameters"),
        # issue 11's misuse list: answered at the call that receives it, never a raw error or silence
        (lambda: TieredModel(TinyGPT(), nvme_dir=123), ConfigError, r"nvme_dir=123 is not a path"),
        (lambda: TieredModel(TinyGPT(), device="gpu"), ConfigError, r"device='gpu' is not a device torch knows"),
        (lambda: TieredModel(TinyGPT(), device=123), ConfigError, r"device=123 is not a device; pass 'cpu'"),
        (lambda: TieredModel(TinyGPT(), device="meta"), ConfigError, r"trains on 'cpu' or 'cuda' devices"),
        (
            lambda: TieredModel(nn.Linear(3, 3, device="meta"), weights=3),
            ConfigError,
            r"weights=3 is not a path",
        ),
        (
            lambda: TieredModel(TinyGPT(), trace_path="/no/such/dir/t.json"),
            ConfigError,
            r"directory '/no/such/dir' does not exist",
        ),
        (lambda: TieredModel(TinyGPT(), trace_path=123), ConfigError, r"trace_path=123 is not a path"),
        (lambda: TieredModel(TinyGPT(), overlap_step="no"), ConfigError, r"overlap_step='no' is not a bool"),
        (lambda: TieredModel(TinyGPT(), prefetch="no"), ConfigError, r"prefetch='no' is not a bool"),
        (lambda: TieredModel(TinyGPT(), grad_clip=float("inf")), ConfigError, r"grad_clip=inf is invalid.*finite"),
        (lambda: TieredModel(TinyGPT(), grad_clip=True), ConfigError, r"grad_clip=True is invalid"),
    ],
)
def test_bad_input_is_a_clear_error(make, err, match):
    with pytest.raises(err, match=match) as e:
        make()
    assert str(e.value).startswith("tiermem:")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a torch without CUDA")
def test_cuda_on_a_torch_without_it_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"^tiermem: device='cuda' but this torch has no usable CUDA device"):
        TieredModel(TinyGPT(), device="cuda")


def test_bad_loss_and_closure():
    tm = TieredModel(TinyGPT())
    x, _ = gpt_batch(0)
    with pytest.raises(ConfigError, match="scalar loss"):
        tm.backward(tm(x))
    with pytest.raises(TierMemError, match=r"step\(closure\) is not supported"):
        tm.optimizer.step(lambda: 0)


def test_no_decay_groups():
    spec = AdamW(lr=1e-2, weight_decay=0.5, no_decay_1d=True)
    tm = TieredModel(TinyGPT(), optimizer=spec, precision="fp32")
    g0, g1 = tm.optimizer.param_groups
    assert g0["weight_decay"] == 0.5 and g1["weight_decay"] == 0.0
    assert all(n.endswith("weight") and "ln" not in n for n in g0["param_names"])
    assert any(n.endswith("bias") for n in g1["param_names"])
    # a param that gets zero grad still decays under AdamW; in the no-decay group it must not move
    x, y = gpt_batch(0)
    before = tm.state_dict()
    tm.backward(gpt_loss(tm(x), y) * 0.0)
    tm.step()
    after = tm.state_dict()
    assert torch.equal(before["blocks.0.ln.bias"], after["blocks.0.ln.bias"])
    assert not torch.equal(before["blocks.0.fc.weight"], after["blocks.0.fc.weight"])


def test_overlap_step_is_the_one_step_delayed_update():
    """overlap_step=True: step k's Adam runs while forward/backward of step k+1 run, so the
    gradient of step k+1 is taken at the weights before update k. Reference: the same delay
    written as a plain loop with torch.optim.AdamW on separate master weights."""
    torch.manual_seed(6)
    device_model = TinyGPT()
    mine = copy.deepcopy(device_model)
    master = copy.deepcopy(device_model)
    spec = AdamW(lr=1e-2, weight_decay=0.1)
    opt = _torch_opt(spec, master.parameters())
    ref_losses = []
    for i in range(STEPS):
        x, y = gpt_batch(100 * i)  # the batches _train_tm uses
        loss = gpt_loss(device_model(x), y)
        loss.backward()
        ref_losses.append(loss.item())
        device_model.load_state_dict(master.state_dict())  # land the previous update
        for pm, pd in zip(master.parameters(), device_model.parameters()):
            pm.grad, pd.grad = pd.grad, None
        opt.step()
        opt.zero_grad()
    tm = TieredModel(mine, optimizer=spec, precision="fp32", overlap_step=True, bucket_size=3000)
    losses = _train_tm(tm)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    got = tm.state_dict()  # lands the last update
    for k, v in master.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert torch.equal(tm.module.wte.weight.detach(), got["wte.weight"])  # the device has it too
    assert tm.report().bytes_moved[(Tier.HOST, Tier.DEVICE)] > 0


def test_overlap_step_matches_plain_step_placement_free():
    """With overlap, ZeroOffload and KeepOnDevice still agree bit for bit (CPU-only machine)."""
    out = []
    for policy in (ZeroOffload(), KeepOnDevice()):
        torch.manual_seed(7)
        tm = TieredModel(
            TinyGPT(), policy, optimizer=AdamW(lr=1e-2), precision="bf16", overlap_step=True, bucket_size=2500
        )
        losses = _train_tm(tm, steps=4)
        out.append((losses, tm.state_dict()))
    assert out[0][0] == out[1][0]
    assert all(torch.equal(out[0][1][k], out[1][1][k]) for k in out[0][1])


def test_trace_has_compute_transfers_and_adam(tmp_path):
    import json

    path = tmp_path / "t.json"
    tm = TieredModel(TinyGPT(), precision="bf16", bucket_size=3000, trace_path=str(path))
    for i in range(2):
        x, y = gpt_batch(i)
        tm.backward(gpt_loss(tm(x), y))
        tm.step()
    tm.detach()
    events = json.loads(path.read_text())["traceEvents"]
    cats = {e["cat"] for e in events}
    assert {"compute", "adam", "transfer"} <= cats
    names = {e["name"] for e in events}
    assert {"forward", "backward", "step", "device->host"} <= names
    if torch.cuda.is_available():  # on a CPU device Adam writes the weights in place (NOTE [A CPU device])
        assert "host->device" in names
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in events)


def test_failed_in_memory_step_is_never_applied_twice(monkeypatch):
    def make():
        torch.manual_seed(8)
        return TieredModel(TinyGPT(), optimizer=AdamW(lr=1e-2), precision="fp32", bucket_size=2000)

    ref, tm = make(), make()
    for m in (ref, tm):
        x, y = gpt_batch(0)
        m.backward(gpt_loss(m(x), y))
    ref.step()
    real, calls = tiermem.optim.functional.adam_update, {"n": 0}  # the update TieredModel calls

    def fails_on_the_fourth(*a, **k):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("kernel failure")
        return real(*a, **k)

    monkeypatch.setattr(tiermem.optim.functional, "adam_update", fails_on_the_fourth)
    with pytest.raises(RuntimeError, match="kernel failure"):
        tm.step()
    assert tm.phase is Phase.GRADS_READY  # the grads not yet applied are kept for the retry
    monkeypatch.setattr(tiermem.optim.functional, "adam_update", real)
    tm.step()  # the retry updates only what the failed step did not
    a, b = tm.state_dict(), ref.state_dict()
    assert same_state(a, b)
    assert tm.stepper.param_steps() == ref.stepper.param_steps()


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_non_finite_grads_skip_the_step_in_every_precision(precision, caplog):
    tm = TieredModel(TinyGPT(), optimizer=AdamW(lr=1e-2), precision=precision, bucket_size=3000)
    x, y = gpt_batch(0)
    before = tm.state_dict()
    tm.backward(gpt_loss(tm(x), y) * float("nan"))
    res = tm.step()
    assert res.skipped and res.step == 0 and res.loss_scale == 1.0
    assert "step skipped" in caplog.text
    after = tm.state_dict()
    assert same_state(before, after)


def test_a_stalled_run_names_the_parameters_and_stops(caplog):
    """NOTE [A stalled run is loud]: in bf16/fp32 a skipped step names the parameters whose grads
    are not finite, and max_skipped_steps in a row raise with that diagnosis."""
    torch.manual_seed(3)
    tm = TieredModel(TinyGPT(), optimizer=AdamW(lr=1e-2), precision="bf16", bucket_size=3000, max_skipped_steps=3)
    bad = tm.module.blocks[1].fc.weight.register_hook(lambda g: g * float("nan"))  # this parameter's grad only
    before = tm.state_dict()
    x, y = gpt_batch(0)
    for _ in range(2):
        tm.backward(gpt_loss(tm(x), y))
        assert tm.step().skipped
    assert "not finite: blocks.1.fc.weight" in caplog.text and "blocks.0" not in caplog.text
    tm.backward(gpt_loss(tm(x), y))
    with pytest.raises(
        TierMemError,
        match=r"3 steps in a row were skipped .*\(in blocks\.1\.fc\.weight\).*"
        r"max_skipped_steps",
    ):
        tm.step()
    assert same_state(before, tm.state_dict()) and tm.phase is Phase.IDLE
    bad.remove()
    tm.backward(gpt_loss(tm(x), y))  # a good step resets the count
    assert not tm.step().skipped and tm.stepper.skipped_in_a_row == 0


def test_max_skipped_steps_is_checked():
    with pytest.raises(ConfigError, match=r"max_skipped_steps=0 is invalid"):
        TieredModel(TinyGPT(), max_skipped_steps=0)


class _Rotary(nn.Module):
    """A buffer the model only reads (like Llama's rotary inv_freq) and BatchNorm's, which it writes."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)))
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.lin(x * self.inv_freq))


def test_buffers_keep_the_values_the_model_last_wrote():
    """NOTE [Buffers keep their values]: rounded to bf16 while attached, never for good."""
    torch.manual_seed(0)
    model = _Rotary()
    given = model.inv_freq.clone()
    assert not torch.equal(given, given.to(torch.bfloat16).float())  # bf16 would change it
    tm = TieredModel(model, precision="bf16")
    x = torch.randn(5, 8)
    tm.backward(tm(x).float().square().mean())
    tm.step()
    written = tm.module.bn.running_mean.detach().float().clone()  # what the model itself wrote, in bf16
    sd = tm.state_dict()
    assert torch.equal(sd["inv_freq"], given) and sd["inv_freq"].dtype == torch.float32
    assert torch.equal(sd["bn.running_mean"], written)
    back = tm.detach()
    assert torch.equal(back.inv_freq, given) and torch.equal(back.bn.running_mean, written)
    assert back.bn.num_batches_tracked.dtype == torch.int64 and back.bn.num_batches_tracked.item() == 1
