"""The host-side halves of the GPU code, on any machine: exact pinned host buffers and their
bookkeeping (NOTE [Exact pinned memory]), the default device budget, and joining requests.
The GPU halves are in test_cuda.py / test_cuda_streams.py."""

from __future__ import annotations

import gc

import forked
import pytest
import torch

from tiermem import TensorClass, Tier
from tiermem.memory import aligned, deferred, resident
from tiermem.memory.resident import HostStore
from tiermem.transfer.engine import TransferEngine


def _mapped(ptr: int) -> bool:
    """Whether some mapping of this process covers address ``ptr`` (Linux)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


@pytest.fixture
def fake_pinning(monkeypatch):
    """Stand-in for cudaHostRegister/Unregister: records what would be pinned."""
    pinned: dict[int, int] = {}

    def register(ptr: int, nbytes: int) -> None:
        assert ptr % aligned.ALIGN == 0 and nbytes % aligned.ALIGN == 0 and ptr not in pinned
        pinned[ptr] = nbytes

    def unregister(ptr: int) -> None:
        del pinned[ptr]  # a KeyError: unpinning what was never pinned

    monkeypatch.setattr(aligned, "register_host", register)
    monkeypatch.setattr(aligned, "unregister_host", unregister)
    return pinned


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
def test_host_buffer_is_exact_page_aligned_and_unmapped_once_dropped():
    buf = aligned.host_buffer(3 * 4096 + 1, pin=False)
    assert buf.dtype == torch.uint8 and buf.numel() == 4 * 4096 and buf.data_ptr() % 4096 == 0
    buf.fill_(7)
    assert int(buf.sum()) == 7 * 4 * 4096
    ptr, view = buf.data_ptr(), buf[4096:8192]
    del buf
    gc.collect()
    assert _mapped(ptr)  # a view keeps the mapping
    del view
    gc.collect()
    assert not _mapped(ptr)  # given back to the system


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
def test_pool_pins_exactly_what_its_ledger_counts_and_trim_gives_it_back(fake_pinning):
    host = HostStore(1 << 30, pin=True)
    sizes = [2**20, 2**20 + 12, 4096 * 3 + 5, 100]  # a power of two, just above one, odd sizes
    ptrs = []
    for _ in range(3):  # steps: the same sizes every time
        bufs = [host.acquire(n, f"k{i}", TensorClass.GRAD) for i, n in enumerate(sizes)]
        state = host.acquire(2**20, "state", TensorClass.OPTIM_STATE)  # never pinned
        pinned = sum(fake_pinning.values())
        assert pinned == host.pinned_bytes == host.ledger.used - host.ledger.held("state")
        assert pinned == sum(aligned.round_up(n) for n in sizes)  # exact, not rounded to a power of two
        ptrs = [b.data_ptr() for b in bufs] + [state.data_ptr()]
        for i, b in enumerate(bufs):
            host.release(f"k{i}", b)
        host.release("state", state)
        del bufs, state, b
    assert host.allocations == len(sizes) + 1  # reused: pinned bytes stay flat over steps
    assert host.trim() == sum(aligned.round_up(n) for n in sizes) + 2**20
    gc.collect()
    assert fake_pinning == {} and host.pinned_bytes == 0 and host.ledger.used == 0
    assert not any(_mapped(p) for p in ptrs)


def test_a_store_dropped_without_close_unpins(fake_pinning):
    host = HostStore(1 << 30, pin=True)
    buf = host.acquire(8192, "k", TensorClass.GRAD)
    assert sum(fake_pinning.values()) == 8192
    del host
    deferred.collect()  # the finalizer only enqueues the unpinning (NOTE [Finalizers only enqueue])
    assert fake_pinning == {} and buf.numel() == 8192  # unpinned; the bytes stay valid for whoever holds them
    buf.fill_(1)


def _collect_a_pinned_pool_inside_the_pools_lock() -> int:
    """In a child process, with a stand-in for torch's cudart binding: a pinned pool that only a GC
    pass collects, collected while this thread holds concurrent.futures' module-wide lock; the
    bytes still pinned once released."""
    import concurrent.futures.thread
    import contextlib

    pinned: dict[int, int] = {}

    class Cudart:
        def cudaHostRegister(self, ptr, nbytes, flags):
            pinned[ptr] = nbytes
            return 0

        def cudaHostUnregister(self, ptr):
            del pinned[ptr]
            return 0

    torch.cuda.cudart = lambda: Cudart()
    torch.cuda.device = lambda i: contextlib.nullcontext()
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    torch._C._cuda_hasPrimaryContext = lambda i: True
    host = HostStore(1 << 30, pin=True)
    host.acquire(8192, "k", TensorClass.GRAD)
    assert sum(pinned.values()) == 8192, pinned
    cycle: list = [host]
    cycle.append(cycle)  # only a GC pass collects it
    del host, cycle
    with concurrent.futures.thread._global_shutdown_lock:  # what submit() holds
        gc.collect()  # the pool's finalizer runs here, on this thread, inside that lock
    deferred.settle()
    return len(pinned)


def test_a_pinned_pool_collected_inside_a_thread_pools_lock_does_not_deadlock():
    """Unpinning runs on the pinning thread's pool, whose submit() takes concurrent.futures'
    module-wide lock: a pool dropped without close() and collected by a GC pass inside that lock
    unpins on the release worker instead of waiting there (inline, it deadlocked). In a child
    process, with a stand-in for torch's cudart binding: a deadlock would wedge every pool."""
    child = forked.run(
        _collect_a_pinned_pool_inside_the_pools_lock,
        deadline=90,
        hang="a pinned pool collected inside concurrent.futures' lock deadlocked",
    )
    assert child.exitcode == 0, child.error
    assert child.value == 0  # unpinned after all


def test_default_device_budget_is_free_plus_what_torch_holds_minus_the_margin(monkeypatch):
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 141 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * gib)
    margin = resident.device_margin(141 * gib)
    assert margin == int(141 * gib * 0.05)
    assert resident.default_device_budget(torch.device("cuda", 0)) == 70 * gib - margin
    assert resident.device_margin(8 * gib) == gib  # a small card keeps at least 1 GiB out
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (gib // 2, 8 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    assert resident.default_device_budget(torch.device("cuda", 0)) == 0  # never negative


def test_join_on_the_cpu_is_wait():
    e = TransferEngine({Tier.DEVICE: resident.DeviceStore("cpu", 1 << 20), Tier.HOST: HostStore(1 << 20)})
    try:
        src, dst = torch.arange(1000, dtype=torch.float32), torch.zeros(1000, dtype=torch.bfloat16)
        h = e.copy_async(dst, src, src_tier=Tier.HOST, dst_tier=Tier.DEVICE)
        assert h.wait_issued() is None  # no GPU stage here
        assert e.join(h) is dst and torch.equal(dst, src.bfloat16())
        acc = torch.ones(1000)
        e.copy_async(acc, dst, src_tier=Tier.DEVICE, dst_tier=Tier.HOST, accumulate=True).wait()
        assert torch.equal(acc, src.bfloat16().float() + 1)
        bad = e.copy_async(torch.zeros(3), torch.zeros(4), src_tier=Tier.HOST, dst_tier=Tier.DEVICE)
        with pytest.raises(RuntimeError):
            e.join(bad)
        assert e.behind("h2d").wait() is None
    finally:
        e.close()


def test_gradients_leave_the_device_one_request_per_bucket():
    """Finding 8: one engine request (one turn of the copy lane, one completion) per bucket, not
    per parameter; the numbers are the golden tests' business."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from models import TinyGPT, gpt_batch, gpt_loss

    from tiermem import AdamW, TieredModel
    from tiermem.policies import ZeroOffload

    torch.manual_seed(0)
    tm = TieredModel(TinyGPT(), ZeroOffload(), optimizer=AdamW(lr=1e-3), bucket_size="16KiB", device="cpu")
    requests, single = [], []
    many, one = tm.engine.copy_many, tm.engine.copy_async
    tm.engine.copy_many = lambda copies, **kw: requests.append(len(copies)) or many(copies, **kw)
    tm.engine.copy_async = lambda *a, **kw: single.append(1) or one(*a, **kw)
    n_params = sum(len(b.slots) for b in tm.layout.step_buckets)
    assert len(tm.layout.step_buckets) > 1 and n_params > 2 * len(tm.layout.step_buckets), n_params
    for i in range(2):  # two micro-batches: the second adds
        x, y = gpt_batch(i)
        tm.backward(gpt_loss(tm(x), y))
    assert sorted(requests) == sorted([len(b.slots) for b in tm.layout.step_buckets] * 2)
    assert not single  # no gradient went on its own
    assert not tm.step().skipped
    tm.detach()


# -- the engine's GPU mode, with stand-ins for streams and events --------------------------------
class _FakeEvent:
    """A CUDA event stand-in: every wait on it is counted; it is always complete."""

    synced = 0

    def __init__(self, enable_timing: bool = False, blocking: bool = False):
        assert blocking, "every engine event is blocking (a host wait sleeps, never spins)"

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        type(self).synced += 1

    def elapsed_time(self, other: "_FakeEvent") -> float:
        return 1.0  # ms


class _FakeStream:
    waited = 0

    def __init__(self, device=None):
        pass

    def wait_event(self, ev) -> None:
        type(self).waited += 1


@pytest.fixture
def gpu_mode(monkeypatch):
    """The engine's GPU control flow (issue on the lane, land on the completion thread, join on
    the caller's stream) with CPU tensors: streams and events are stand-ins."""
    import contextlib
    import threading

    from tiermem.transfer import engine as engine_mod, lanes as lanes_mod

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    bound = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: bound.append((threading.current_thread().name, i)))
    _FakeEvent.synced = _FakeStream.waited = 0

    def make() -> TransferEngine:
        e = TransferEngine({Tier.DEVICE: resident.DeviceStore("cpu", 1 << 24), Tier.HOST: HostStore(1 << 24)})
        e.lanes.close()
        gpu = torch.device("cuda", 0)
        e.lanes = lanes_mod.Lanes(gpu)  # the GPU lanes: completion threads and (stand-in) streams
        e._copies.lanes = e.lanes  # the copies issue on them too
        return e

    yield make, bound
    assert engine_mod.event is lanes_mod.event


def test_gpu_mode_moves_land_on_the_completion_thread_and_join_waits_on_the_gpu(gpu_mode):
    from tiermem import TensorInfo
    from tiermem.transfer.residency import KeyedResidency

    make, bound = gpu_mode
    e = make()
    try:
        x = torch.arange(5000, dtype=torch.float32)
        res = KeyedResidency(e)
        res.register(TensorInfo("w", TensorClass.PARAM, x.nbytes, tuple(x.shape), x.dtype), Tier.HOST)
        res.put("w", x)
        h = res.prefetch("w", Tier.DEVICE)
        assert e.join(h) is e.stores[Tier.DEVICE].get("w")  # the request's value, once issued
        assert _FakeStream.waited >= 2  # the lane waited on `ready`, the caller's stream on `done`
        h.wait()
        assert res.registry.get("w").valid == {Tier.HOST, Tier.DEVICE}  # the completion thread's bookkeeping
        assert torch.equal(e.stores[Tier.DEVICE].get("w"), x)
        e.stores[Tier.DEVICE].get("w").mul_(2)
        res.registry.write_at("w", Tier.DEVICE)
        res.evict("w", Tier.DEVICE).wait()
        assert res.registry.get("w").valid == {Tier.HOST} and "w" not in e.stores[Tier.DEVICE]
        out = torch.empty_like(x)
        res.fetch("w", out)
        assert torch.equal(out, x * 2)
        stats = e.stats.snapshot()
        assert stats["busy_seconds"][(Tier.HOST, Tier.DEVICE)] == pytest.approx(1e-3)  # the events' time
        assert stats["bytes_moved"][(Tier.DEVICE, Tier.HOST)] == x.nbytes
        synced = _FakeEvent.synced
        ran = e.run_async(lambda: 7)
        assert e.join(ran) == 7 and ran.wait() == 7 and _FakeEvent.synced == synced + 1
        assert e.behind("d2h").wait() is None and e.behind("h2d").wait() is None
        failing = e.run_async(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            e.join(failing)
    finally:
        e.close()
    names = {name.split("_")[0] for name, i in bound}
    assert all(i == 0 for _, i in bound)
    assert {"tiermem-d2h", "tiermem-h2d", "tiermem-compute", "tiermem-d2h-done", "tiermem-h2d-done"} <= names


def test_gpu_mode_trains_bit_identical_to_the_cpu_mode(gpu_mode, tmp_path):
    """The whole GPU control flow under training (grads per bucket, uploads, overlap_step,
    activation offload to the host and to NVMe, weights on NVMe): the numbers do not move."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from models import TinyGPT, gpt_batch, gpt_loss

    from tiermem import AdamW, TieredModel
    from tiermem.policies import ActivationOffload, ZeroInfinity, ZeroOffload

    make, _ = gpu_mode

    def run(gpu: bool, **kw) -> dict:
        torch.manual_seed(0)
        nvme = tmp_path / f"nvme-{gpu}-{len(list(tmp_path.iterdir()))}"
        nvme.mkdir()
        tm = TieredModel(
            TinyGPT(), optimizer=AdamW(lr=1e-2), bucket_size="16KiB", device="cpu", nvme_dir=str(nvme), **kw
        )
        if gpu:
            tm.engine.lanes.close()
            fake = make()
            tm.engine.lanes = tm.engine._copies.lanes = fake.lanes
        for i in range(3):
            x, y = gpt_batch(i)
            tm.backward(gpt_loss(tm(x), y))
            tm.step()
        state = {k: v.clone() for k, v in tm.state_dict().items()}
        tm.detach()
        return state

    for kw in (
        dict(policy=ZeroOffload(), overlap_step=True),
        dict(policy=ActivationOffload(ZeroOffload(), min_bytes=0)),
        dict(policy=ActivationOffload(ZeroOffload(), tier=Tier.NVME, min_bytes=0)),  # chains, joined by waiting
        dict(policy=ZeroInfinity()),
    ):  # weights through the scheduler; the NVMe legs stage through the pool
        cpu, gpu = run(False, **kw), run(True, **kw)
        assert all(torch.equal(cpu[k], gpu[k]) for k in cpu), kw


def test_where_cuda_refuses_to_register_the_pool_falls_back_to_torchs_pinned_cache(monkeypatch, fake_pinning):
    asked = []

    def refuse(ptr: int, nbytes: int) -> None:
        asked.append(nbytes)
        raise RuntimeError("cudaHostRegister of 8192 bytes failed with CUDA error 801")

    monkeypatch.setattr(aligned, "register_host", refuse)
    cached = []
    monkeypatch.setattr(
        resident, "aligned_empty", lambda n, pin: cached.append(pin) or aligned.aligned_empty(n, pin=False)
    )
    host = HostStore(1 << 20, pin=True)
    buf = host.acquire(8000, "k", TensorClass.GRAD)
    assert cached == [True] and buf.numel() == 8192 and host.pinned_bytes == 8192
    host.release("k", buf)
    assert host.acquire(8000, "k2", TensorClass.GRAD) is buf  # pooled like any pinned buffer
    other = host.acquire(3 * 4096, "k3", TensorClass.GRAD)  # a new size: CUDA is not asked again
    assert asked == [8192] and cached == [True, True] and host.pinned_bytes == 8192 + 3 * 4096
    host.release("k2", buf)
    host.release("k3", other)
    assert host.trim() == 8192 + 3 * 4096 and host.pinned_bytes == 0  # nothing to unregister: fake_pinning saw nothing
    monkeypatch.setattr(aligned, "register_host", lambda ptr, nbytes: fake_pinning.__setitem__(ptr, nbytes))
    fresh = HostStore(1 << 20, pin=True)  # the refusal was that pool's: another one asks again
    fresh.release("k", fresh.acquire(8000, "k", TensorClass.GRAD))
    assert sum(fake_pinning.values()) == 8192 and fresh.trim() == 8192 and fake_pinning == {}


def test_host_registration_runs_on_its_own_thread_in_an_existing_context(monkeypatch):
    """NOTE [Registering host memory], with stand-ins for torch's cudart binding: the call runs on
    the pinning thread (never the caller's, where the error it leaves would surface later), in
    the context of a device that has one, and an error code is raised."""
    import contextlib
    import threading

    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append(("register", threading.current_thread().name, entered[-1], ptr, nbytes, flags))
            if nbytes == 3 * 4096:  # as a pool's finalizer would, run by a GC pass on the pinning thread
                aligned.unregister_host(ptr)
            return 0 if nbytes in (4096, 3 * 4096) else 2

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", threading.current_thread().name, entered[-1], ptr))
            return 0

    entered = [None]
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(torch.cuda, "device", lambda i: contextlib.nullcontext(entered.append(i)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda i: i == 2, raising=False)
    aligned.register_host(8192 * 4, 4096)
    aligned.unregister_host(8192 * 4)
    with pytest.raises(RuntimeError, match="cudaHostRegister of 8192 bytes failed with CUDA error 2"):
        aligned.register_host(8192 * 5, 8192)
    assert [c[0] for c in calls] == ["register", "unregister", "register"]
    assert all(c[1].startswith("tiermem-pin") and c[2] == 2 for c in calls)  # cuda:2 has the only context
    assert calls[0][3:] == (8192 * 4, 4096, 1)  # cudaHostRegisterPortable
    nested = threading.Thread(target=aligned.register_host, args=(8192 * 6, 3 * 4096), daemon=True)
    nested.start()
    nested.join(timeout=30)
    assert not nested.is_alive(), "a call made on the pinning thread itself waited for that thread"
    assert [c[0] for c in calls[3:]] == ["register", "unregister"] and calls[4][1] == calls[3][1]
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda i: True, raising=False)
    assert aligned.context_device() == 0  # the caller's current device, when it has a context


def test_device_adam_matches_torchs_fused_adamw_and_makes_its_step_once_per_step():
    """The device kernel (torch's fused AdamW, one launch) runs on CPU tensors too: two steps of it
    equal torch.optim.AdamW(fused=True) bit for bit, and the step scalar it reads is made once per
    step (per thread and stream), not per bucket."""
    from tiermem.optim.adam_hyper import AdamHyper
    from tiermem.optim.kernels import eager as _kernels

    g = torch.Generator().manual_seed(0)
    p0, grads = torch.randn(1031, generator=g), [torch.randn(1031, generator=g) for _ in range(2)]
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    master, m, v = p0.clone(), torch.zeros(1031), torch.zeros(1031)
    out = torch.empty(1031, dtype=torch.bfloat16)
    for step, grad in enumerate(grads, 1):
        ref.grad = grad.clone()
        opt.step()
        hyper = AdamHyper(step=step, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, adamw=True)
        _kernels._device_adam((master, m, v, grad, out), hyper)
        assert torch.equal(master, ref.detach()) and torch.equal(out, master.bfloat16())
    assert torch.equal(m, opt.state[ref]["exp_avg"]) and torch.equal(v, opt.state[ref]["exp_avg_sq"])
    one = _kernels._device_step(7, torch.device("cpu"))
    assert _kernels._device_step(7, torch.device("cpu")) is one and float(one) == 7.0
    assert float(_kernels._device_step(8, torch.device("cpu"))) == 8.0


def test_gpu_mode_staged_copies_share_one_pooled_buffer_per_request(gpu_mode):
    """Converting and adding copies between the device and the host go through host staging:
    one pooled buffer per request (a bucket's gradients), carved per copy, back in the pool once
    the request is done; every byte lands as plain torch would put it."""
    make, _ = gpu_mode
    e = make()
    host = e.stores[Tier.HOST]
    leased = []
    acquire = host.acquire
    host.acquire = lambda n, key, kind=None: leased.append((n, key)) or acquire(n, key, kind)
    try:
        g = torch.Generator().manual_seed(0)
        grads = [torch.randn(n, generator=g).bfloat16() for n in (7, 1000, 333)]
        plain = torch.randn(50, generator=g)
        accs = [torch.randn(n, generator=g) for n in (7, 1000, 333)]
        expect = [accs[0] + grads[0].float(), grads[1].float(), accs[2] + grads[2].float()]
        out_plain = torch.empty(50)
        for _ in range(2):  # the second request reuses the pooled buffer
            got = [a.clone() for a in accs]
            e.copy_many(
                [
                    (got[0], grads[0], True),
                    (got[1], grads[1], False),
                    (out_plain, plain, False),
                    (got[2], grads[2], True),
                ],
                src_tier=Tier.DEVICE,
                dst_tier=Tier.HOST,
            ).wait()
            assert all(torch.equal(a, b) for a, b in zip(got, expect)) and torch.equal(out_plain, plain)
        assert len(leased) == 2 and leased[0][0] == 256 + 2048 + 768  # one lease per request: 3 pieces
        assert host.allocations == 1 and host.ledger.used == host.ledger.held("<free host buffers>")
        dev = torch.empty(1000, dtype=torch.bfloat16)
        src = torch.randn(1000, generator=g)
        e.copy_async(dev, src, src_tier=Tier.HOST, dst_tier=Tier.DEVICE).wait()  # converting h2d
        assert torch.equal(dev, src.bfloat16()) and leased[-1][0] == 2048
        dev32 = torch.randn(1000, generator=g)
        ref = dev32 + dev.float()
        e.copy_async(dev32, dev, src_tier=Tier.HOST, dst_tier=Tier.DEVICE, accumulate=True).wait()
        assert torch.equal(dev32, ref) and len(leased) == 3  # an add on the device needs no staging
    finally:
        e.close()


# Every torch.cuda call tiermem's GPU paths make, with the arguments they pass: these exist (and
# bind) on a CPU-only build too, so a rename or a changed signature fails here, not on the first GPU.
_CUDA_CALLS = [
    (torch.cuda.Event, (), dict(enable_timing=True, blocking=True)),
    (torch.cuda.Stream, (torch.device("cuda", 1),), {}),
    (torch.cuda.stream, (None,), {}),
    (torch.cuda.current_stream, (torch.device("cuda", 1),), {}),
    (torch.cuda.set_device, (1,), {}),
    (torch.cuda.device, (1,), {}),
    (torch.cuda.current_device, (), {}),
    (torch.cuda.device_count, (), {}),
    (torch.cuda.mem_get_info, (torch.device("cuda", 1),), {}),
    (torch.cuda.memory_reserved, (torch.device("cuda", 1),), {}),
    (torch.cuda.max_memory_allocated, (torch.device("cuda", 1),), {}),
    (torch.cuda.synchronize, (torch.device("cuda", 1),), {}),
    (torch.cuda.get_device_name, (torch.device("cuda", 1),), {}),
    (torch.cuda._sleep, (1000,), {}),
    (torch.cuda.cudart, (), {}),
    (torch.cuda.set_sync_debug_mode, ("error",), {}),
    (torch.cuda.Event.record, (None, None), {}),
    (torch.cuda.Event.synchronize, (None,), {}),
    (torch.cuda.Event.elapsed_time, (None, None), {}),
    (torch.cuda.Stream.wait_event, (None, None), {}),
]


@pytest.mark.parametrize("fn,args,kwargs", _CUDA_CALLS, ids=lambda x: getattr(x, "__qualname__", None))
def test_the_cuda_calls_made_exist_with_the_arguments_passed(fn, args, kwargs):
    import inspect

    target = fn.__new__ if isinstance(fn, type) and fn.__new__ is not object.__new__ else fn
    sig = inspect.signature(target)
    sig.bind(*((fn,) if target is not fn else ()), *args, **kwargs)


def test_the_tensor_and_fused_adam_entry_points_exist():
    assert callable(torch.Tensor.record_stream) and callable(torch.Tensor.is_pinned)
    names = {s.name for s in torch._C._jit_get_all_schemas()}
    assert {"aten::_fused_adam_", "aten::_fused_adamw_", "aten::record_stream"} <= names
    for op in ("aten::_fused_adam_", "aten::_fused_adamw_"):  # the keyword arguments _device_adam passes
        args = [{a.name for a in s.arguments} for s in torch._C._jit_get_schemas_for_operator(op)]
        assert any({"lr", "beta1", "beta2", "weight_decay", "eps", "amsgrad", "maximize"} <= a for a in args), op
