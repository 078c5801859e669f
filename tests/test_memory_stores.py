from __future__ import annotations

import pytest
import torch

from tiermem import OutOfTierMemory, StoreError
from tiermem.memory.aligned import ALIGN, aligned_empty
from tiermem.memory.resident import DeviceStore, HostStore


def test_host_buffers_are_page_aligned_and_reused_across_steps():
    host = HostStore(budget=1 << 20)
    for _ in range(5):
        ts = [host.allocate(f"b{i}", (1000 + i,), torch.float32) for i in range(3)]
        assert all(t.data_ptr() % ALIGN == 0 for t in ts)
        for i in range(3):
            host.delete(f"b{i}")
    assert host.allocations == 3  # step 2..5 took every buffer from the pool
    assert host.used == host.ledger.held(HostStore._POOL_KEY) > 0


def test_host_pool_trims_cached_buffers_before_refusing():
    host = HostStore(budget=3 * ALIGN)
    host.allocate("a", (ALIGN,), torch.uint8)
    host.allocate("b", (ALIGN,), torch.uint8)
    host.delete("a")
    host.delete("b")  # 2 pages cached, none in use
    big = host.allocate("c", (3 * ALIGN,), torch.uint8)  # only fits once the cache is dropped
    assert big.numel() == 3 * ALIGN and host.used == 3 * ALIGN
    with pytest.raises(OutOfTierMemory, match="'d'"):
        host.allocate("d", (1,), torch.uint8)
    assert "c" in host  # the refusal took nothing away


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool])
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 5), (4097,)])
def test_memory_stores_round_trip_bit_exact(dtype, shape):
    x = (torch.randn(shape) * 100).to(dtype)
    for store in (DeviceStore("cpu"), HostStore()):
        store.write("k", x).wait()
        out = torch.empty(shape, dtype=dtype)
        store.read("k", out).wait()
        assert torch.equal(_bits(out), _bits(x))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_memory_store_errors():
    store = HostStore()
    with pytest.raises(StoreError, match="no tensor 'nope' on the host tier"):
        store.read("nope", torch.empty(1))
    store.write("k", torch.arange(6.0)).wait()
    with pytest.raises(StoreError, match="holds 6 x torch.float32"):
        store.read("k", torch.empty(5))
    out = torch.empty(6)
    store.read("k", out).wait()  # the failed read left the value intact
    assert torch.equal(out, torch.arange(6.0))


def test_device_store_budget_by_accounting_on_cpu():
    dev = DeviceStore("cpu", budget=100)
    dev.allocate("a", (20,), torch.float32)
    with pytest.raises(OutOfTierMemory, match=r"asked 24 B, 80 B in use of 100 B allowed"):
        dev.allocate("b", (6,), torch.float32)
    dev.adopt("p", torch.zeros(5))  # a module parameter already on the device: accounted, not copied
    assert dev.used == 100 and dev.ledger.peak == 100
    dev.delete("a")
    assert dev.used == 20
    assert aligned_empty(1).numel() == ALIGN
