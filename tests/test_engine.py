"""Registry + engine driven by hypothesis: random register / put / prefetch / evict / read /
delete sequences across the three tiers. Every value comes back bit-exact, budgets hold at every
step, and no handle is left pending."""
from __future__ import annotations

import shutil
import tempfile
import threading

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from tiermem import OutOfTierMemory, TensorClass, TensorInfo, Tier, TierMemError
from tiermem.transfer.engine import TransferEngine
from tiermem.memory.registry import Registry
from tiermem.memory.resident import DeviceStore, HostStore
from tiermem.memory.nvme import NvmeStore

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.uint8]
TIERS = [Tier.DEVICE, Tier.HOST, Tier.NVME]


def _info(key: str, x: torch.Tensor, kind=TensorClass.OPTIM_STATE) -> TensorInfo:
    return TensorInfo(key, kind, x.numel() * x.element_size(), tuple(x.shape), x.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _engine(tmp: str, device_budget=16 << 20, host_budget=16 << 20) -> TransferEngine:
    stores = {Tier.DEVICE: DeviceStore("cpu", device_budget), Tier.HOST: HostStore(host_budget),
              Tier.NVME: NvmeStore(tmp)}
    return TransferEngine(stores)


class EngineMachine(RuleBasedStateMachine):
    keys = Bundle("keys")

    def __init__(self):
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="tiermem-sm-")
        self.engine = _engine(self.tmp, device_budget=48 * 1024, host_budget=64 * 1024)
        self.values: dict[str, torch.Tensor] = {}
        self.handles = []
        self.n = 0

    @rule(target=keys, numel=st.sampled_from([0, 1, 7, 1000, 4099]), dtype=st.sampled_from(DTYPES),
          home=st.sampled_from(TIERS))
    def register(self, numel, dtype, home):
        self.n += 1
        key = f"blocks.{self.n}.w:exp_avg"
        x = (torch.randn(numel) * 50).to(dtype)
        self.engine.register(_info(key, x), home)
        try:
            self.engine.put(key, x)
        except OutOfTierMemory:
            self.engine.delete(key)  # did not fit its home; later rules see it as absent
            return key
        self.values[key] = x
        return key

    @rule(key=keys, dst=st.sampled_from(TIERS), wait_now=st.booleans())
    def prefetch(self, key, dst, wait_now):
        if key not in self.values:
            return
        try:
            h = self.engine.prefetch(key, dst)
        except OutOfTierMemory:
            return  # refused up front; the value must still read back (checked in `read`)
        (h.wait() if wait_now else self.handles.append(h))

    @rule(key=keys, tier=st.sampled_from([Tier.DEVICE, Tier.HOST]))
    def evict(self, key, tier):
        if key not in self.values:
            return
        try:
            self.handles.append(self.engine.evict(key, tier))
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
        self.engine.fetch(key, out).wait()
        assert torch.equal(_bits(out), _bits(x))

    @rule(key=keys, seed=st.integers(0, 100))
    def overwrite(self, key, seed):
        if key not in self.values:
            return
        x = self.values[key]
        y = (torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)) * 9).to(x.dtype)
        r = self.engine.registry.get(key)
        try:
            self.engine.put(key, y, Tier.DEVICE if r.home != Tier.NVME else r.home)
        except OutOfTierMemory:
            self.engine.put(key, y, r.home)
        self.values[key] = y

    @rule(key=consumes(keys))
    def delete(self, key):
        if key in self.values:
            self.engine.delete(key)
            del self.values[key]

    @rule()
    def drain(self):
        for h in self.handles:
            h.wait()
        self.handles.clear()
        assert self.engine.pending() == 0

    @invariant()
    def budgets_hold(self):
        for store in self.engine.stores.values():
            assert store.ledger.used <= store.ledger.allowed
            assert store.ledger.peak <= store.ledger.allowed

    def teardown(self):
        try:
            for h in self.handles:
                h.wait()
            assert self.engine.pending() == 0
            for key, x in self.values.items():
                out = torch.empty_like(x)
                self.engine.fetch(key, out).wait()
                assert torch.equal(_bits(out), _bits(x)), key
            self.engine.close()
        finally:
            self.engine.stores[Tier.NVME].close()
            shutil.rmtree(self.tmp, ignore_errors=True)


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)


@pytest.fixture
def engine(tmp_path):
    e = _engine(str(tmp_path))
    yield e
    e.close()
    e.stores[Tier.NVME].close()


def test_evict_writes_back_home_then_frees_device(engine):
    x = torch.randn(3, 1001)
    engine.register(_info("w", x, TensorClass.PARAM), Tier.NVME)
    engine.put("w", x)
    engine.prefetch("w", Tier.DEVICE).wait()
    assert engine.registry.get("w").valid == {Tier.DEVICE, Tier.NVME}
    assert engine.stores[Tier.DEVICE].used == x.nbytes
    engine.stores[Tier.DEVICE].get("w").mul_(2)  # updated on the device...
    engine.registry.write_at("w", Tier.DEVICE)  # ...so the NVMe copy is stale
    engine.evict("w", Tier.DEVICE).wait()
    assert engine.registry.get("w").valid == {Tier.NVME}
    assert engine.stores[Tier.DEVICE].used == 0
    out = torch.empty_like(x)
    engine.fetch("w", out).wait()
    assert torch.equal(out, x * 2)
    stats = engine.stats
    assert stats.bytes_moved[(Tier.NVME, Tier.DEVICE)] == x.nbytes
    assert stats.bytes_moved[(Tier.DEVICE, Tier.NVME)] == x.nbytes


def test_prefetch_is_async_and_stall_is_measured(engine):
    x = torch.randn(1 << 20)
    engine.register(_info("big", x), Tier.HOST)
    engine.put("big", x)
    gate = threading.Event()
    engine._lanes["h2d"].submit(gate.wait)  # hold the lane so the request must queue behind it
    h = engine.prefetch("big", Tier.DEVICE)
    assert not h.done() and engine.pending() == 1
    assert engine.prefetch("big", Tier.DEVICE) is h  # a second request joins the one in flight
    threading.Timer(0.05, gate.set).start()
    h.wait()
    assert engine.stats.stall_seconds[Tier.DEVICE] >= 0.03
    assert engine.pending() == 0 and torch.equal(engine.stores[Tier.DEVICE].get("big"), x)


def test_budget_refusal_changes_nothing(tmp_path):
    small = _engine(str(tmp_path), device_budget=1000)
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
        small.close()
        small.stores[Tier.NVME].close()


def test_bad_requests_are_clear_errors(engine):
    with pytest.raises(TierMemError, match="'ghost' is not registered"):
        engine.prefetch("ghost")
    x = torch.ones(3)
    engine.register(_info("a", x), Tier.HOST)
    with pytest.raises(TierMemError, match="holds no value yet"):
        engine.prefetch("a")
    with pytest.raises(TierMemError, match="registered twice"):
        engine.register(_info("a", x), Tier.HOST)
    with pytest.raises(TierMemError, match="not a Tier"):
        engine.register(_info("b", x), "gpu")
    engine.put("a", x)
    with pytest.raises(TierMemError, match="its home and only copy"):
        engine.evict("a", Tier.HOST)
    no_nvme = TransferEngine({Tier.DEVICE: DeviceStore("cpu"), Tier.HOST: HostStore()})
    with pytest.raises(TierMemError, match="pass nvme_dir"):
        no_nvme.register(_info("c", x), Tier.NVME)
    no_nvme.close()


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
