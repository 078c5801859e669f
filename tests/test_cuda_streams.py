"""Stream semantics on a GPU (issue 14): every copy is ordered after the caller's stream as it was
at the call, whichever thread issues it; GPU consumers wait on events; several copies of one
direction are in flight; waiting does not spin; pinned host memory is exact. Marked ``cuda``
(skipped without a device); the host-side halves run everywhere in test_gpu_paths.py.

``torch.cuda._sleep(cycles)`` holds a stream on the GPU: work queued behind it runs late, so a
copy that is not ordered after it reads or overwrites bytes too early, and the test sees it.
Bit-identical runs on two streams need cuBLAS to be deterministic across streams:
bench/gpu_check.sh sets CUBLAS_WORKSPACE_CONFIG=:4096:8 (set it too when running these by hand)."""

from __future__ import annotations

import contextlib
import copy
import threading
import time

import pytest
import torch
from models import TinyGPT, gpt_batch, gpt_loss
from torch import nn

from tiermem import AdamW, TensorClass, Tier, TieredModel
from tiermem.handles import Handle
from tiermem.memory.resident import DeviceStore, HostStore, default_device_budget, device_margin
from tiermem.policies import ActivationOffload, KeepOnDevice, ZeroInfinity, ZeroOffload
from tiermem.transfer.engine import TransferEngine

pytestmark = pytest.mark.cuda

SLEEP = 50_000_000  # GPU cycles: ~25 ms at 2 GHz, far longer than any copy below


@pytest.fixture
def engine():
    e = TransferEngine({Tier.DEVICE: DeviceStore("cuda"), Tier.HOST: HostStore(4 << 30)})
    yield e
    e.close()


def _gate(e: TransferEngine) -> tuple[Handle, threading.Event]:
    """A request on the NVMe lane that finishes when the event is set (from another thread)."""
    opened = threading.Event()
    return Handle(e.lanes.pools["nvme"].submit(opened.wait)), opened


def test_d2h_waits_for_the_callers_stream(engine):
    s = torch.cuda.Stream()
    n = 1 << 22
    host = engine.lease(4 * n, "<out>").view(torch.float32)
    with torch.cuda.stream(s):
        src = torch.zeros(n, device="cuda")
        torch.cuda._sleep(SLEEP)
        src.fill_(3.0)  # queued behind the sleep on s
        h = engine.copy_async(host, src, src_tier=Tier.DEVICE, dst_tier=Tier.HOST)
    h.wait()
    assert bool((host == 3.0).all()), "the copy ran before the caller's stream wrote its source"


def test_h2d_issued_from_another_thread_is_ordered_after_the_callers_stream(engine):
    """Finding 1: the copy starts on the NVMe lane's thread once `after` is done, but a block the
    caller's stream still reads (freed, reused for `out`) must not be overwritten early."""
    s = torch.cuda.Stream()
    n = 1 << 22
    src = engine.lease(4 * n, "<src>").view(torch.float32)
    src.fill_(-1.0)
    gate, opened = _gate(engine)
    with torch.cuda.stream(s):
        x = torch.ones(n, device="cuda")
        torch.cuda._sleep(SLEEP)
        y = x * 2  # reads x after the sleep
        del x  # its block may go to `out`: ordered on s, not on the lane's stream
        out = torch.empty(n, device="cuda")
        h = engine.copy_async(out, src, src_tier=Tier.HOST, dst_tier=Tier.DEVICE, after=gate)
        opened.set()  # the copy is issued from the lane thread, typically while s still sleeps
        got = engine.join(h)
        total = y.sum()
    assert got is out
    torch.cuda.synchronize()
    assert total.item() == 2.0 * n, "the copy overwrote a block the caller's stream still read"
    assert bool((out == -1.0).all())


def test_join_makes_the_consumer_stream_wait_for_a_late_copy(engine):
    n = 1 << 22
    src = engine.lease(4 * n, "<src>").view(torch.float32)
    src.copy_(torch.arange(n, dtype=torch.float32))
    with torch.cuda.stream(engine.lanes.streams["h2d"]):
        torch.cuda._sleep(SLEEP)  # the copy lands late
    out = torch.zeros(n, device="cuda")
    h = engine.copy_async(out, src, src_tier=Tier.HOST, dst_tier=Tier.DEVICE)
    engine.join(h)
    seen = out.clone()  # on the caller's stream, after the join
    assert torch.equal(seen.cpu(), src)


@pytest.mark.parametrize("accumulate", [False, True])
def test_converting_and_accumulating_copies_are_exact(engine, accumulate):
    g = torch.Generator().manual_seed(0)
    n = 300_007
    host32 = engine.lease(4 * n, "<h>").view(torch.float32)
    host32.copy_(torch.randn(n, generator=g))
    dev16 = torch.randn(n, generator=g).bfloat16().cuda()
    start = dev16.clone()
    engine.join(engine.copy_async(dev16, host32, src_tier=Tier.HOST, dst_tier=Tier.DEVICE, accumulate=accumulate))
    # the CPU path's own operation: bf16 += fp32 is computed in fp32 and rounded once
    want = start.cpu().add_(host32) if accumulate else host32.bfloat16()
    assert torch.equal(dev16.cpu(), want)
    acc = engine.lease(4 * n, "<acc>").view(torch.float32)
    acc.fill_(0.5)
    engine.copy_async(acc, dev16, src_tier=Tier.DEVICE, dst_tier=Tier.HOST, accumulate=accumulate).wait()
    assert torch.equal(acc, dev16.cpu().float() + (0.5 if accumulate else 0.0))


def test_several_copies_in_flight_per_direction_and_waiting_does_not_spin(engine):
    n = 1 << 24  # 64 MiB each
    srcs = [torch.full((n,), float(i), device="cuda") for i in range(4)]
    outs = [engine.lease(4 * n, f"<o{i}>").view(torch.float32) for i in range(4)]
    torch.cuda.synchronize()
    with torch.cuda.stream(engine.lanes.streams["d2h"]):
        torch.cuda._sleep(20 * SLEEP)  # ~0.5 s: the d2h stream is held
    cpu0, t0 = time.process_time(), time.perf_counter()
    hs = [engine.copy_async(o, s, src_tier=Tier.DEVICE, dst_tier=Tier.HOST) for o, s in zip(outs, srcs)]
    for h in hs:
        assert h.wait_issued() is not None  # issued without waiting for the previous one to land
    assert not any(h.done() for h in hs), "a copy completed while its stream was held"
    for h in hs:
        h.wait()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    assert all(bool((o == float(i)).all()) for i, o in enumerate(outs))
    assert wall > 0.2 and cpu < 0.5 * wall, f"{cpu:.2f}s of CPU in {wall:.2f}s of waiting: a thread spins"
    stats = engine.stats.snapshot()
    busy = stats["busy_seconds"][(Tier.DEVICE, Tier.HOST)]
    assert busy < wall / 2, "busy time counts the wait before the copy, not the copy"


def test_pinned_host_memory_is_exact_and_given_back(engine):
    host = HostStore(1 << 30, pin=True)
    sizes = (1 << 20, (1 << 20) + 8, 12345)
    bufs = [host.acquire(n, f"k{i}", TensorClass.GRAD) for i, n in enumerate(sizes)]
    assert all(b.is_pinned() for b in bufs)
    assert host.pinned_bytes == host.ledger.used == sum(-(-n // 4096) * 4096 for n in sizes)  # exact: no power of two
    state = host.acquire(1 << 20, "state", TensorClass.OPTIM_STATE)
    assert not state.is_pinned()
    keep = bufs[0][:16]
    for i, b in enumerate(bufs):
        host.release(f"k{i}", b)
    del bufs, b
    host.trim()
    assert host.pinned_bytes == 0 and not keep.is_pinned()
    assert host.ledger.used == host.ledger.held("state")
    free, total = torch.cuda.mem_get_info()
    assert DeviceStore("cuda").ledger.allowed <= free + torch.cuda.memory_reserved() - (1 << 30)
    assert default_device_budget(torch.device("cuda")) <= free + torch.cuda.memory_reserved() - device_margin(total)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_lanes_run_on_the_engines_device():
    e = TransferEngine({Tier.DEVICE: DeviceStore("cuda:1"), Tier.HOST: HostStore(1 << 30)})
    try:
        assert e.run_async(torch.cuda.current_device).wait() == 1
        assert e.run_async(torch.cuda.current_device, lane="h2d").wait() == 1
    finally:
        e.close()


# -- training on another stream ----------------------------------------------------------------
class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        torch.cuda._sleep(SLEEP)  # backward's kernels (and the grads they make) run late
        return g


class Sleepy(nn.Module):
    def __init__(self):
        super().__init__()
        self.gpt = TinyGPT(vocab=512, d=256, n_layer=2, seq=64)

    def forward(self, idx):
        torch.cuda._sleep(SLEEP)  # forward's kernels (and the activations they save) run late
        return _SleepInBackward.apply(self.gpt(idx))


SETUPS = {
    "zero-offload": dict(policy=ZeroOffload()),
    "activation-offload-nvme": dict(policy=ActivationOffload(ZeroOffload(), tier=Tier.NVME, min_bytes=0)),
    "activation-offload-host": dict(policy=ActivationOffload(ZeroOffload(), min_bytes=0)),
    "zero-infinity": dict(policy=ZeroInfinity()),
    "overlap-step": dict(policy=ZeroOffload(), overlap_step=True),
    "keep-on-device-overlap": dict(policy=KeepOnDevice(), overlap_step=True),
}


def _train(tmp_path, setup: dict, stream) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    d = tmp_path / f"nvme-{id(stream)}-{time.perf_counter_ns()}"
    d.mkdir()
    tm = TieredModel(
        Sleepy(),
        optimizer=AdamW(lr=1e-3),
        precision="bf16",
        grad_clip=1.0,
        bucket_size="1MiB",
        device="cuda",
        nvme_dir=str(d),
        **setup,
    )
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for i in range(4):  # no .item() in the loop: it would sync the stream and hide a race
            x, y = gpt_batch(i, vocab=512, batch=4, seq=64)
            tm.backward(gpt_loss(tm(x.cuda()), y.cuda()))
            tm.step()
        state = {k: v.detach().cpu().clone() for k, v in tm.state_dict().items()}
    tm.detach()
    return state


@pytest.mark.parametrize("name", list(SETUPS))
def test_training_on_a_side_stream_is_bit_identical(tmp_path, name):
    ref = _train(tmp_path, SETUPS[name], None)
    side = _train(tmp_path, SETUPS[name], torch.cuda.Stream())
    assert ref.keys() == side.keys()
    bad = [k for k in ref if not torch.equal(ref[k], side[k])]
    assert not bad, f"{name}: training under torch.cuda.stream(s) changed {bad}"


def test_host_gradient_buckets_equal_the_gpu_gradients_exactly():
    torch.manual_seed(0)
    model = TinyGPT(vocab=512, d=256, n_layer=2, seq=64)
    ref = copy.deepcopy(model).cuda().bfloat16()
    tm = TieredModel(
        model, ZeroOffload(), optimizer=AdamW(lr=1e-3), precision="bf16", bucket_size="1MiB", device="cuda"
    )
    x, y = gpt_batch(0, vocab=512, batch=4, seq=64)
    tm.backward(gpt_loss(tm(x.cuda()), y.cuda()))
    gpt_loss(ref(x.cuda()), y.cuda()).backward()
    want = {n: p.grad.float().cpu().reshape(-1) for n, p in ref.named_parameters()}
    tm.grads.settle()
    seen = 0
    for b in tm.layout.step_buckets:
        g, free = tm.layout.homes.grads[b.index].read(b, tm.grads.fill)
        try:
            for s in b.slots:
                assert torch.equal(g[s.offset : s.offset + s.numel].float().cpu(), want[s.name]), s.name
                seen += 1
        finally:
            free()
    assert seen == len(want)
    tm.detach()


def test_pinned_bytes_stay_flat_over_steps_and_match_the_ledger(tmp_path):
    torch.manual_seed(0)
    tm = TieredModel(
        TinyGPT(vocab=512, d=256, n_layer=2, seq=64),
        ActivationOffload(ZeroOffload(), min_bytes=0),
        optimizer=AdamW(lr=1e-3),
        precision="bf16",
        bucket_size="1MiB",
        device="cuda",
    )
    host = tm.stores[Tier.HOST]
    pinned = []
    for i in range(5):
        x, y = gpt_batch(i, vocab=512, batch=4, seq=64)
        tm.backward(gpt_loss(tm(x.cuda()), y.cuda()))
        tm.step()
        pinned.append(host.pinned_bytes)
        counted = host.ledger.used - host.ledger.kind_used.get(TensorClass.OPTIM_STATE, 0)
        assert counted * 0.9 <= host.pinned_bytes <= counted * 1.1, (host.pinned_bytes, counted)
    assert pinned[1:] == [pinned[1]] * 4, f"pinned bytes per step: {pinned}"
    tm.detach()
    assert host.pinned_bytes == 0
