"""The GPU paths: run where a CUDA device exists (marked ``cuda``; skipped elsewhere). Each
mirrors a CPU test that the suite always runs."""
from __future__ import annotations

import pytest
import torch

from models import TinyGPT, gpt_batch, gpt_loss
from tiermem import AdamW, TensorClass, TensorInfo, TieredModel, Tier
from tiermem.transfer.engine import TransferEngine
from tiermem.optim import adam_step
from tiermem.policies import KeepOnDevice, ZeroInfinity, ZeroOffload
from tiermem.memory.resident import DeviceStore, HostStore

pytestmark = pytest.mark.cuda


def test_adam_step_on_the_gpu_agrees_with_the_cpu_kernel():
    g = torch.Generator().manual_seed(0)
    n = 100_003
    cpu = [torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.01, torch.rand(n, generator=g) * 0.01]
    grad = (torch.randn(n, generator=g) * 0.1).bfloat16()
    gpu = [t.cuda() for t in cpu]
    out_c, out_g = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16, device="cuda")
    kw = dict(step=3, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=4.0, clip_coef=0.5)
    assert not adam_step(*cpu, grad, out=out_c, **kw)
    assert not adam_step(*gpu, grad.cuda(), out=out_g, **kw)
    for a, b in zip(cpu, gpu):
        torch.testing.assert_close(a, b.cpu(), rtol=1e-6, atol=1e-7)


def test_engine_moves_are_bit_exact_on_the_gpu(tmp_path):
    from tiermem.memory.nvme import NvmeStore
    e = TransferEngine({Tier.DEVICE: DeviceStore("cuda"), Tier.HOST: HostStore(), Tier.NVME: NvmeStore(tmp_path)})
    x = torch.randn(3, 4099).bfloat16()
    e.register(TensorInfo("w", TensorClass.PARAM, x.nbytes, tuple(x.shape), x.dtype), Tier.NVME)
    e.put("w", x)
    for _ in range(3):
        e.prefetch("w", Tier.DEVICE).wait()
        assert torch.equal(e.stores[Tier.DEVICE].get("w").cpu(), x)
        e.stores[Tier.DEVICE].get("w").mul_(2)
        e.registry.write_at("w", Tier.DEVICE)
        x = x * 2
        e.evict("w", Tier.DEVICE).wait()
    out = torch.empty_like(x)
    e.fetch("w", out).wait()
    assert torch.equal(out, x)
    e.close()


@pytest.mark.parametrize("policy", [KeepOnDevice(), ZeroOffload(), ZeroInfinity()], ids=lambda p: type(p).__name__)
def test_training_on_the_gpu_agrees_with_the_cpu(tmp_path, policy):
    def run(device, pol):
        torch.manual_seed(0)
        tm = TieredModel(TinyGPT(), pol, optimizer=AdamW(lr=1e-2), precision="bf16", grad_clip=1.0,
                         bucket_size=3000, device=device, nvme_dir=str(tmp_path / f"{device}-{type(pol).__name__}"))
        losses = []
        for i in range(4):
            x, y = gpt_batch(i)
            loss = gpt_loss(tm(x.to(device)), y.to(device))
            tm.backward(loss)
            losses.append(loss.item())
            tm.step()
        return losses, tm.state_dict()
    for d in ("cpu", "cuda"):
        (tmp_path / f"{d}-{type(policy).__name__}").mkdir()
    cpu_losses, cpu_sd = run("cpu", ZeroOffload())
    gpu_losses, gpu_sd = run("cuda", policy)
    # GPU kernels round differently from the CPU ones (to rounding, not bit for bit)
    torch.testing.assert_close(gpu_losses, cpu_losses, rtol=2e-2, atol=2e-2)
    for k in cpu_sd:
        torch.testing.assert_close(gpu_sd[k], cpu_sd[k], rtol=0, atol=5e-2, msg=k)
