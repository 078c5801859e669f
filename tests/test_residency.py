"""Registry + keyed residency driven by hypothesis: random register / put / prefetch / evict /
read / delete sequences across the three tiers. Every value comes back bit-exact, budgets hold at
every step, and no handle is left pending."""

from __future__ import annotations

import shutil
import tempfile
import threading

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from tiermem import OutOfTierMemory, TensorClass, TensorInfo, Tier, TierMemError
from tiermem.memory.nvme import NvmeStore
from tiermem.memory.registry import Registry
from tiermem.memory.resident import DeviceStore, HostStore
from tiermem.transfer.engine import TransferEngine
from tiermem.transfer.residency import KeyedResidency

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.uint8]
TIERS = [Tier.DEVICE, Tier.HOST, Tier.NVME]


def _info(key: str, x: torch.Tensor, kind=TensorClass.OPTIM_STATE) -> TensorInfo:
    return TensorInfo(key, kind, x.numel() * x.element_size(), tuple(x.shape), x.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _residency(tmp: str, device_budget=16 << 20, host_budget=16 << 20) -> KeyedResidency:
    stores = {
        Tier.DEVICE: DeviceStore("cpu", device_budget),
        Tier.HOST: HostStore(host_budget),
        Tier.NVME: NvmeStore(tmp),
    }
    return KeyedResidency(TransferEngine(stores))


def _close(res: KeyedResidency) -> None:
    res.engine.close()
    res.engine.stores[Tier.NVME].close()


class ResidencyMachine(RuleBasedStateMachine):
    keys = Bundle("keys")

    def __init__(self):
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="tiermem-sm-")
        self.res = _residency(self.tmp, device_budget=48 * 1024, host_budget=64 * 1024)
        self.values: dict[str, torch.Tensor] = {}
        self.handles = []
        self.n = 0

    @rule(
        target=keys,
        numel=st.sampled_from([0, 1, 7, 1000, 4099]),
        dtype=st.sampled_from(DTYPES),
        home=st.sampled_from(TIERS),
    )
    def register(self, numel, dtype, home):
        self.n += 1
        key = f"blocks.{self.n}.w:exp_avg"
        x = (torch.randn(numel) * 50).to(dtype)
        self.res.register(_info(key, x), home)
        try:
            self.res.put(key, x)
        except OutOfTierMemory:
            self.res.delete(key)  # did not fit its home; later rules see it as absent
            return key
        self.values[key] = x
        return key

    @rule(key=keys, dst=st.sampled_from(TIERS), wait_now=st.booleans())
    def prefetch(self, key, dst, wait_now):
        if key not in self.values:
            return
        try:
            h = self.res.prefetch(key, dst)
        except OutOfTierMemory:
            return  # refused up front; the value must still read back (checked in `read`)
        (h.wait() if wait_now else self.handles.append(h))

    @rule(key=keys, tier=st.sampled_from([Tier.DEVICE, Tier.HOST]))
    def evict(self, key, tier):
        if key not in self.values:
            return
        try:
            self.handles.append(self.res.evict(key, tier))
        except OutOfTierMemory:
            return
        except TierMemError as e:
            assert "its home and only copy" in str(e)

    @rule(key=keys)
    def read(self, key):
        if key not in self.values:
            return
        x = self.values[key]
        out = torch.empty_like(x)
        self.res.fetch(key, out).wait()
        assert torch.equal(_bits(out), _bits(x))

    @rule(key=keys, seed=st.integers(0, 100))
    def overwrite(self, key, seed):
        if key not in self.values:
            return
        x = self.values[key]
        y = (torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)) * 9).to(x.dtype)
        r = self.res.registry.get(key)
        try:
            self.res.put(key, y, Tier.DEVICE if r.home != Tier.NVME else r.home)
        except OutOfTierMemory:
            self.res.put(key, y, r.home)
        self.values[key] = y

    @rule(key=consumes(keys))
    def delete(self, key):
        if key in self.values:
            self.res.delete(key)
            del self.values[key]

    @rule()
    def drain(self):
        for h in self.handles:
            h.wait()
        self.handles.clear()
        assert self.res.pending() == 0

    @invariant()
    def budgets_hold(self):
        for store in self.res.engine.stores.values():
            assert store.ledger.used <= store.ledger.allowed
            assert store.ledger.peak <= store.ledger.allowed

    def teardown(self):
        try:
            for h in self.handles:
                h.wait()
            assert self.res.pending() == 0
            for key, x in self.values.items():
                out = torch.empty_like(x)
                self.res.fetch(key, out).wait()
                assert torch.equal(_bits(out), _bits(x)), key
            self.res.engine.close()
        finally:
            self.res.engine.stores[Tier.NVME].close()
            shutil.rmtree(self.tmp, ignore_errors=True)


TestResidencyMachine = ResidencyMachine.TestCase
TestResidencyMachine.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)


@pytest.fixture
def res(tmp_path):
    r = _residency(str(tmp_path))
    yield r
    _close(r)


def test_evict_writes_back_home_then_frees_device(res):
    x = torch.randn(3, 1001)
    res.register(_info("w", x, TensorClass.PARAM), Tier.NVME)
    res.put("w", x)
    res.prefetch("w", Tier.DEVICE).wait()
    assert res.registry.get("w").valid == {Tier.DEVICE, Tier.NVME}
    assert res.engine.stores[Tier.DEVICE].used == x.nbytes
    res.engine.stores[Tier.DEVICE].get("w").mul_(2)  # updated on the device...
    res.registry.write_at("w", Tier.DEVICE)  # ...so the NVMe copy is stale
    res.evict("w", Tier.DEVICE).wait()
    assert res.registry.get("w").valid == {Tier.NVME}
    assert res.engine.stores[Tier.DEVICE].used == 0
    out = torch.empty_like(x)
    res.fetch("w", out).wait()
    assert torch.equal(out, x * 2)
    stats = res.engine.stats
    assert stats.bytes_moved[(Tier.NVME, Tier.DEVICE)] == x.nbytes
    assert stats.bytes_moved[(Tier.DEVICE, Tier.NVME)] == x.nbytes


def test_prefetch_is_async_and_stall_is_measured(res):
    x = torch.randn(1 << 20)
    res.register(_info("big", x), Tier.HOST)
    res.put("big", x)
    gate = threading.Event()
    res.engine.lanes.pools["h2d"].submit(gate.wait)  # hold the lane so the request must queue behind it
    h = res.prefetch("big", Tier.DEVICE)
    assert not h.done() and res.pending() == 1
    assert res.prefetch("big", Tier.DEVICE) is h  # a second request joins the one in flight
    threading.Timer(0.05, gate.set).start()
    h.wait()
    assert res.engine.stats.stall_seconds[Tier.DEVICE] >= 0.03
    assert res.pending() == 0 and torch.equal(res.engine.stores[Tier.DEVICE].get("big"), x)


def test_budget_refusal_changes_nothing(tmp_path):
    small = _residency(str(tmp_path), device_budget=1000)
    try:
        x = torch.randn(500)
        small.register(_info("w", x), Tier.HOST)
        small.put("w", x)
        with pytest.raises(OutOfTierMemory, match=r"'w': asked 1.95 KiB, 0 B in use of 1000 B allowed"):
            small.prefetch("w", Tier.DEVICE)
        assert small.registry.get("w").valid == {Tier.HOST} and small.pending() == 0
        out = torch.empty_like(x)
        small.fetch("w", out).wait()
        assert torch.equal(out, x)
    finally:
        _close(small)


def test_bad_requests_are_clear_errors(res):
    with pytest.raises(TierMemError, match="'ghost' is not registered"):
        res.prefetch("ghost")
    x = torch.ones(3)
    res.register(_info("a", x), Tier.HOST)
    with pytest.raises(TierMemError, match="holds no value yet"):
        res.prefetch("a")
    with pytest.raises(TierMemError, match="registered twice"):
        res.register(_info("a", x), Tier.HOST)
    with pytest.raises(TierMemError, match="not a Tier"):
        res.register(_info("b", x), "gpu")
    res.put("a", x)
    with pytest.raises(TierMemError, match="its home and only copy"):
        res.evict("a", Tier.HOST)
    no_nvme = KeyedResidency(TransferEngine({Tier.DEVICE: DeviceStore("cpu"), Tier.HOST: HostStore()}))
    with pytest.raises(TierMemError, match="pass nvme_dir"):
        no_nvme.register(_info("c", x), Tier.NVME)
    no_nvme.engine.close()


def test_registry_transitions_are_checked():
    reg = Registry()
    reg.register(_info("k", torch.ones(1)), Tier.HOST)
    reg.write_at("k", Tier.HOST)
    with pytest.raises(AssertionError, match="only valid copy"):
        reg.drop("k", Tier.HOST)
    with pytest.raises(AssertionError, match="holds no valid copy"):
        reg.begin("k", Tier.DEVICE, Tier.HOST)
    reg.begin("k", Tier.HOST, Tier.DEVICE)
    with pytest.raises(AssertionError, match="in flight"):
        reg.begin("k", Tier.HOST, Tier.NVME)
    reg.finish("k", ok=False)
    assert reg.get("k").valid == {Tier.HOST}


def test_every_move_is_counted_once_in_the_stats(res):
    x = torch.randn(1000)
    res.register(_info("w", x), Tier.NVME)
    res.put("w", x, src_tier=Tier.HOST)
    res.prefetch("w", Tier.DEVICE).wait()
    res.engine.copy_async(torch.empty(1000), x, src_tier=Tier.DEVICE, dst_tier=Tier.HOST, kind=TensorClass.GRAD).wait()
    res.engine.copy_async(torch.empty(1000), x, src_tier=Tier.HOST, dst_tier=Tier.HOST).wait()
    snap = res.engine.stats.snapshot()
    assert snap["bytes_moved"] == {
        (Tier.HOST, Tier.NVME): 4000,
        (Tier.NVME, Tier.DEVICE): 4000,
        (Tier.DEVICE, Tier.HOST): 4000,
        (Tier.HOST, Tier.HOST): 4000,
    }
    assert snap["class_bytes_moved"][(TensorClass.GRAD, Tier.DEVICE, Tier.HOST)] == 4000
    assert set(snap["busy_seconds"]) == {(Tier.HOST, Tier.NVME), (Tier.NVME, Tier.DEVICE), (Tier.DEVICE, Tier.HOST)}


@pytest.mark.parametrize("src", [Tier.HOST, Tier.NVME])
def test_a_moved_buffer_is_freed_when_dropped_without_a_garbage_collection(res, src):
    """A transfer's result (the device copy a prefetch made) goes the moment nothing uses it:
    the residency's done-callback must not hold the handle (future -> callback -> handle ->
    future would be a cycle keeping the buffer until Python's next full collection: gigabytes
    of weights per step in a 13B run)."""
    import gc
    import weakref

    x = torch.randn(4096)
    res.register(_info("w", x), src)
    res.put("w", x, src_tier=src)
    enabled = gc.isenabled()
    gc.disable()
    try:
        handle = res.prefetch("w", Tier.DEVICE)
        out = handle.wait()
        assert isinstance(out, torch.Tensor) and torch.equal(out, x)
        alive = weakref.ref(out)
        res.evict("w", Tier.DEVICE).wait()
        del out, handle
        assert res.pending() == 0
        assert alive() is None, "the device copy outlived every reference but a cycle"
    finally:
        if enabled:
            gc.enable()
