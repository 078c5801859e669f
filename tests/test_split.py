"""The split optimizer: ``ZeroOffload(device_fraction=f)`` keeps part of the optimizer state (and
its grads) on the device (NOTE [Which optimizer state goes to the device first] in
tiermem/policies/zero_offload.py, NOTE [Split step] in tiermem/train/step/updates.py).

On a machine without an accelerator the device is the CPU and the device's Adam is the same kernel
as the host's, so every fraction must give ZeRO-Offload's numbers bit for bit; the cuda-marked test
at the end compares a GPU split with the CPU to rounding.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings, strategies as st
from models import Quirky, TinyGPT, gpt_batch, gpt_loss

from tiermem import AdamW, ConfigError, Policy, TensorClass, TensorInfo, Tier, TieredModel
from tiermem.plan.policy import ModelInfo
from tiermem.policies import ActivationOffload, ZeroOffload
from tiermem.policies.zero_offload import device_share

FRACTIONS = [0.0, 0.25, 0.5, 1.0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-identical tensors under the same keys (-0.0 is not 0.0 here)."""
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


def _model(policy, *, precision="bf16", grad_clip=1.0, **kw) -> TieredModel:
    torch.manual_seed(0)
    return TieredModel(
        TinyGPT(),
        policy,
        optimizer=AdamW(lr=1e-2, weight_decay=0.1),
        precision=precision,
        grad_clip=grad_clip,
        bucket_size=3000,
        **kw,
    )


def _train(tm: TieredModel, steps: range, micro: int = 2) -> list[float]:
    losses = []
    for i in steps:
        for m in range(micro):
            x, y = gpt_batch(100 * i + m)
            loss = gpt_loss(tm(x), y)
            tm.backward(loss)
            losses.append(loss.item())
        tm.step()
    return losses


def _infos(sizes: list[int]) -> ModelInfo:
    return ModelInfo(
        tuple(TensorInfo(f"p{i}", TensorClass.PARAM, 2 * n, (n,), torch.bfloat16) for i, n in enumerate(sizes))
    )


# -- the policy ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), float("inf"), True, "0.5", None])
def test_device_fraction_outside_0_to_1_is_refused(bad):
    with pytest.raises(ConfigError, match=r"^tiermem: ZeroOffload.device_fraction=.* from 0 .* to 1"):
        ZeroOffload(device_fraction=bad)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=12), f=st.floats(0, 1))
def test_device_share_is_the_longest_forward_prefix_within_the_fraction(sizes, f):
    chosen = device_share(_infos(sizes), f)
    k = len(chosen)
    assert chosen == {f"p{i}" for i in range(k)}, "not a prefix in forward order"
    assert sum(sizes[:k]) <= f * sum(sizes)
    if k < len(sizes):
        assert sum(sizes[: k + 1]) > f * sum(sizes), "stopped before the fraction was used up"


def test_split_policy_places_grads_and_state_by_parameter_and_the_rest_as_zero_offload():
    model = _infos([10, 10, 10, 10])
    p = ZeroOffload(device_fraction=0.5).for_model(model)
    for name, tier in [("p0", Tier.DEVICE), ("p1", Tier.DEVICE), ("p2", Tier.HOST), ("p3", Tier.HOST)]:
        assert p.place(TensorInfo(name, TensorClass.GRAD, 40, (10,), torch.float32)) == tier
        for part in ("master", "exp_avg", "exp_avg_sq"):
            assert p.place(TensorInfo(f"{name}:{part}", TensorClass.OPTIM_STATE, 40, (10,), torch.float32)) == tier
        assert p.place(TensorInfo(name, TensorClass.PARAM, 20, (10,), torch.bfloat16)) == Tier.DEVICE
    assert p.place(TensorInfo("blocks.0", TensorClass.ACTIVATION, 4096, (1024,), torch.float32)) == Tier.DEVICE
    assert repr(p) == "ZeroOffload(device_fraction=0.5)" and repr(ZeroOffload()) == "ZeroOffload()"


def test_an_unbound_split_policy_refuses_to_place_grads_alone():
    with pytest.raises(ConfigError, match="for_model"):
        ZeroOffload(device_fraction=0.5).place(TensorInfo("w", TensorClass.GRAD, 40, (10,), torch.float32))


def test_activation_offload_passes_the_model_to_the_split_policy_it_wraps():
    p = ActivationOffload(ZeroOffload(device_fraction=0.5)).for_model(_infos([10, 10]))
    assert p.place(TensorInfo("p0", TensorClass.GRAD, 40, (10,), torch.float32)) == Tier.DEVICE
    assert p.place(TensorInfo("p1", TensorClass.GRAD, 40, (10,), torch.float32)) == Tier.HOST


# -- the model's layout ----------------------------------------------------------------------------------
@pytest.mark.parametrize("f", FRACTIONS)
def test_the_layout_keeps_that_share_of_state_and_its_grads_on_the_device(f):
    tm = _model(ZeroOffload(device_fraction=f))
    buckets = tm.layout.buckets
    on_device = sum(b.numel for b in buckets if b.state_tier == Tier.DEVICE)
    assert all(b.grad_tier == b.state_tier for b in buckets)  # grads live where Adam runs on them
    assert on_device <= f * tm.layout.n_params
    if f in (0.0, 1.0):
        assert on_device == f * tm.layout.n_params
    else:
        assert 0 < on_device
    # the first parameter forward uses is the embedding (tied to the head): it goes first
    assert (tm.layout.slot_of[id(tm.module.wte.weight)][0].state_tier == Tier.DEVICE) == (on_device > 0)
    _train(tm, range(1), micro=1)
    peak = tm.report().class_peak_bytes
    assert peak.get((TensorClass.OPTIM_STATE, Tier.DEVICE), 0) == 12 * on_device
    host = peak.get((TensorClass.OPTIM_STATE, Tier.HOST), 0)  # the host pool rounds each buffer up to pages
    assert host >= 12 * (tm.layout.n_params - on_device) and (host == 0) == (on_device == tm.layout.n_params)


# -- the numbers ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("f", [0.25, 0.5, 1.0])
def test_every_fraction_gives_zero_offloads_weights_bit_for_bit(f, precision):
    ref = _model(ZeroOffload(), precision=precision)
    ref_losses = _train(ref, range(3))
    tm = _model(ZeroOffload(device_fraction=f), precision=precision)
    assert _train(tm, range(3)) == ref_losses
    assert _same(tm.state_dict(), ref.state_dict())
    assert tm.stepper.steps == ref.stepper.steps >= 2  # fp16 may skip its first step (the scale)


def test_a_parameter_without_a_grad_is_left_alone_on_either_side():
    def run(policy):
        torch.manual_seed(0)
        tm = TieredModel(Quirky(), policy, optimizer=AdamW(lr=1e-2), precision="bf16", bucket_size=400)
        g = torch.Generator().manual_seed(1)
        for i in range(3):  # the branch gets a grad on step 1 only
            x = torch.randn(8, 13, generator=g)
            y, z = tm(x, use_branch=i == 1)
            tm.backward(y.float().square().mean() + (z.float().mean() if z is not None else 0))
            tm.step()
        return tm

    ref = run(ZeroOffload())
    for f in (0.3, 0.7, 1.0):
        assert _same(run(ZeroOffload(device_fraction=f)).state_dict(), ref.state_dict()), f


@pytest.mark.parametrize("load_f", [0.0, 1.0, 0.25])
def test_a_checkpoint_moves_between_fractions(tmp_path, load_f):
    whole = _model(ZeroOffload(device_fraction=0.5))
    losses = _train(whole, range(4))
    first = _model(ZeroOffload(device_fraction=0.5))
    assert _train(first, range(2)) == losses[:4]
    first.save(str(tmp_path / "ckpt"))
    second = _model(ZeroOffload(device_fraction=load_f))
    second.load(str(tmp_path / "ckpt"))
    assert _train(second, range(2, 4)) == losses[4:]
    assert _same(second.state_dict(), whole.state_dict())
    assert second.stepper.steps == 4


def test_the_device_adam_is_launched_before_the_cpu_adam(tmp_path):
    trace = tmp_path / "trace.json"
    tm = _model(ZeroOffload(device_fraction=0.5), trace_path=str(trace))
    _train(tm, range(1), micro=1)
    tm.tracer.write()
    events = json.loads(trace.read_text())["traceEvents"]
    order = [e["name"].split()[1] for e in sorted(events, key=lambda e: e["ts"]) if e["name"].startswith("adam ")]
    tier = {b.key: b.state_tier for b in tm.layout.buckets}
    assert sorted(order) == sorted(tier), "every bucket is updated once"
    kinds = [tier[k] for k in order]
    assert Tier.DEVICE in kinds and Tier.HOST in kinds
    assert kinds == sorted(kinds, key=lambda t: t != Tier.DEVICE), f"device buckets first: {order}"


class _HostStateOnNvme(Policy):
    """Builds on a whole-model policy as NOTE [Whole-model policies] says: wraps it, forwards for_model."""

    def __init__(self, base: Policy):
        self.base = base

    def for_model(self, model):
        return _HostStateOnNvme(self.base.for_model(model))

    def place(self, info):
        tier = self.base.place(info)
        return Tier.NVME if info.kind is TensorClass.OPTIM_STATE and tier == Tier.HOST else tier

    def __repr__(self):
        return f"_HostStateOnNvme({self.base!r})"


def test_a_subclass_that_overrides_place_of_a_split_is_refused_with_the_way_to_build_on_it():
    class Split(ZeroOffload):
        def place(self, info):
            return super().place(info)

    with pytest.raises(ConfigError, match=r"^tiermem: Split overrides place\(\) .* wrap ZeroOffload"):
        Split(device_fraction=0.5).for_model(_infos([10, 10]))
    assert (
        Split()
        .for_model(_infos([10, 10]))
        .place(  # without a split nothing needs the whole model
            TensorInfo("p0", TensorClass.GRAD, 40, (10,), torch.float32)
        )
        == Tier.HOST
    )


def test_binding_returns_a_separate_policy_and_leaves_the_one_bound_as_it_was():
    policy = ZeroOffload(device_fraction=0.5)
    before = dict(vars(policy))
    p = policy.for_model(_infos([10, 10]))
    assert p is not policy and vars(policy) == before
    assert p.for_model(_infos([10, 10])) is p  # binding a bound policy gives it back


def test_a_device_share_goes_first_beside_state_on_nvme(tmp_path):
    """The device's Adam is launched first, then NVMe's pipeline (NOTE [Split step]); a failure there
    is rolled forward by the retry (tested in test_nvme_state)."""
    trace = tmp_path / "trace.json"
    tm = _model(_HostStateOnNvme(ZeroOffload(device_fraction=0.5)), trace_path=str(trace), nvme_dir=str(tmp_path))
    ref = _model(ZeroOffload())
    assert _train(tm, range(2), micro=1) == _train(ref, range(2), micro=1)
    assert _same(tm.state_dict(), ref.state_dict())
    tm.tracer.write()
    events = sorted(json.loads(trace.read_text())["traceEvents"], key=lambda e: e["ts"])
    tier = {b.key: b.state_tier for b in tm.layout.buckets}
    kinds = [tier[e["name"].split()[1]] for e in events if e["name"].startswith("adam ")][: len(tier)]
    assert kinds == sorted(kinds, key=lambda t: {Tier.DEVICE: 0, Tier.NVME: 1, Tier.HOST: 2}[t])
    assert set(kinds) == {Tier.NVME, Tier.DEVICE}


# -- on a GPU ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_a_split_on_the_gpu_agrees_with_zero_offload_on_the_cpu():
    """The device share runs torch's fused Adam on the GPU: equal to rounding, with the tolerances
    of tests/test_cuda.py (NOTE [GPU against CPU training] there)."""
    from test_cuda import GPU_VS_CPU_ALL, GPU_VS_CPU_LOSS_RTOL

    cpu = _model(ZeroOffload(), device="cpu")
    w0 = {k: v.clone() for k, v in cpu.state_dict().items()}
    cpu_losses = _train(cpu, range(4))
    gpu = _model(ZeroOffload(device_fraction=0.5), device="cuda")
    assert any(b.state_tier == Tier.DEVICE for b in gpu.layout.buckets)
    losses = []
    for i in range(4):
        for m in range(2):
            x, y = gpt_batch(100 * i + m)
            loss = gpt_loss(gpu(x.cuda()), y.cuda())
            gpu.backward(loss)
            losses.append(loss.item())
        gpu.step()
    torch.testing.assert_close(losses, cpu_losses, rtol=GPU_VS_CPU_LOSS_RTOL, atol=0)
    g, c = gpu.state_dict(), cpu.state_dict()
    diff = torch.cat([(g[k].cpu() - c[k]).flatten() for k in w0]).norm()
    update = torch.cat([(c[k] - w0[k]).flatten() for k in w0]).norm()
    assert update > 0 and diff <= GPU_VS_CPU_ALL * update


@pytest.mark.cuda
def test_the_device_adam_never_waits_for_the_device():
    """NOTE [Split step]: the CPU's Adam runs while the device's is queued, so queueing it must not
    synchronise with the device (torch raises on a synchronising call in "error" mode)."""
    from tiermem.optim import adam_step

    g = torch.Generator(device="cuda").manual_seed(0)
    master, grad = (torch.randn(4099, device="cuda", generator=g) for _ in range(2))
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    out = torch.empty(4099, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        adam_step(
            master,
            exp_avg,
            exp_avg_sq,
            grad,
            step=3,
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.1,
            grad_scale=2.0,
            clip_coef=0.5,
            out=out,
            check_finite=False,
        )
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(master).all() and exp_avg.abs().sum() > 0
