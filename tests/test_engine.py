"""The keyless copy service: chains, leases, ordering against the caller, the stats every move is
counted in, and the protocol the homes depend on. Keyed moves are tests/test_residency.py's."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tiermem import OutOfTierMemory, TensorClass, TensorInfo, Tier, TierMemError
from tiermem.memory.nvme import NvmeStore
from tiermem.memory.resident import DeviceStore, HostStore
from tiermem.transfer.engine import TransferEngine

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.uint8]
TIERS = [Tier.DEVICE, Tier.HOST, Tier.NVME]


def _info(key: str, x: torch.Tensor, kind=TensorClass.OPTIM_STATE) -> TensorInfo:
    return TensorInfo(key, kind, x.numel() * x.element_size(), tuple(x.shape), x.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _engine(tmp: str, device_budget=16 << 20, host_budget=16 << 20) -> TransferEngine:
    stores = {
        Tier.DEVICE: DeviceStore("cpu", device_budget),
        Tier.HOST: HostStore(host_budget),
        Tier.NVME: NvmeStore(tmp),
    }
    return TransferEngine(stores)


@pytest.fixture
def engine(tmp_path):
    e = _engine(str(tmp_path))
    yield e
    _Gate.open_all()  # a test that failed holding a lane must not hang close()
    e.close()
    e.stores[Tier.NVME].close()


# -- chains, leases, stats (NOTE [Chained requests], NOTE [Pooled staging]) -----------------------
class _Gate:
    """A request held on a lane until ``open()``: ``handle`` completes when the gate opens."""

    made: list = []

    def __init__(self, engine, lane="d2h"):
        self.event = threading.Event()
        self.handle = engine.run_async(self.event.wait, lane=lane)
        _Gate.made.append(self)

    def open(self):
        self.event.set()

    @classmethod
    def open_all(cls):
        for gate in cls.made:
            gate.open()
        cls.made.clear()


def _failing(engine, error):
    def boom():
        raise error

    return engine.run_async(boom)


def test_chain_runs_then_after_first_and_follows_its_request(engine):
    gate, order = _Gate(engine), []
    inner = _Gate(engine, lane="h2d")
    h = engine.chain(gate.handle, lambda: order.append("then") or inner.handle, cleanup=lambda: order.append("cleanup"))
    assert not h.done() and order == []
    gate.open()
    engine.behind("d2h").wait()
    assert order == ["then"] and not h.done()  # it follows the request `then` issued
    inner.open()
    assert h.wait() is True and order == ["then", "cleanup"]  # Event.wait's result; cleanup first


@pytest.mark.parametrize("where", ["first", "second of two", "then", "then's request", "cleanup"])
def test_an_error_anywhere_ends_the_chain_and_cleanup_runs_once(engine, where):
    err, ran, cleaned = ValueError(where), [], []
    ok = engine.run_async(lambda: 1)
    first = {"first": [_failing(engine, err), ok], "second of two": [ok, _failing(engine, err)]}.get(where, [ok])

    def then():
        ran.append(1)
        if where == "then":
            raise err
        return _failing(engine, err) if where == "then's request" else 7

    def cleanup():
        cleaned.append(1)
        if where == "cleanup":
            raise err

    h = engine.chain(first, then, cleanup=cleanup)
    with pytest.raises(ValueError, match=where):
        h.wait()
    assert cleaned == [1] and ran == ([] if where in ("first", "second of two") else [1])


def test_chain_without_then_ends_with_the_results(engine):
    a, b = engine.run_async(lambda: "a"), engine.run_async(lambda: "b")
    assert engine.chain(a).wait() == "a"
    assert engine.chain([a, b]).wait() == ["a", "b"]
    assert engine.chain([]).wait() == []
    first_error = engine.chain([_failing(engine, KeyError("x")), _failing(engine, ValueError("y"))])
    with pytest.raises(KeyError):  # the first in the order given, whichever finished first
        first_error.wait()


def test_then_runs_at_once_on_the_caller_when_first_is_done(engine):
    done = engine.run_async(lambda: None)
    done.wait()
    seen = []
    engine.chain(done, lambda: seen.append(threading.current_thread())).wait()
    assert seen == [threading.current_thread()]


def test_behind_runs_then_on_the_lane_after_its_queued_requests(engine):
    gate, seen = _Gate(engine), []
    h = engine.chain(engine.behind("d2h"), lambda: seen.append(threading.current_thread().name))
    assert not h.done()
    gate.open()
    h.wait()
    assert gate.handle.done() and seen[0].startswith("tiermem-d2h")


def test_a_cpu_devices_copies_home_run_on_the_callers_thread(engine):
    """NOTE [A CPU device]: a device->host request is done when the call returns, whatever the d2h
    lane's thread is busy with (a gradient going home during backward does not wait for it, nor
    share the cores with it); host->device requests keep their lane."""
    gate, src = _Gate(engine), torch.randn(3, 257).bfloat16()
    dst = torch.zeros(3, 257)
    h = engine.copy_many([(dst[i], src[i], False) for i in range(3)], src_tier=Tier.DEVICE, dst_tier=Tier.HOST)
    assert h.done() and torch.equal(dst, src.float())
    up_gate, back = _Gate(engine, lane="h2d"), torch.empty(3, 257, dtype=torch.bfloat16)
    up = engine.copy_async(back, src, src_tier=Tier.HOST, dst_tier=Tier.DEVICE)
    assert not up.done()
    gate.open(), up_gate.open()
    up.wait()
    assert torch.equal(back, src)


def test_stall_on_a_chain_counts_to_its_tier(engine):
    gate = _Gate(engine)
    h = engine.chain(gate.handle, stall=Tier.NVME)
    threading.Timer(0.05, gate.open).start()
    h.wait()
    assert engine.stats.stall_seconds[Tier.NVME] >= 0.03


def test_copy_after_waits_for_its_request_and_orders_on_the_callers_thread(engine, monkeypatch):
    """The CUDA rule of NOTE [Chained requests]: the ordering event is taken at the call, on the
    caller's thread, not when the copy finally starts on another one."""
    marks, real = [], engine.ready
    monkeypatch.setattr(engine, "ready", lambda: marks.append(threading.current_thread()) or real())
    gate = _Gate(engine, lane="nvme")
    src, dst = torch.arange(4099, dtype=torch.float32), torch.zeros(4099)
    h = engine.copy_async(dst, src, src_tier=Tier.HOST, dst_tier=Tier.DEVICE, after=gate.handle)
    assert marks == [threading.current_thread()]
    engine.behind("h2d").wait()
    assert not h.done() and not dst.any()  # not started while `after` runs
    gate.open()
    assert h.wait() is dst and torch.equal(dst, src)
    again = torch.zeros(4099)
    assert engine.copy_async(again, src, src_tier=Tier.HOST, dst_tier=Tier.DEVICE, after=h).wait() is again
    assert torch.equal(again, src) and marks == [threading.current_thread()] * 2
    failed = engine.copy_async(
        dst, src, src_tier=Tier.HOST, dst_tier=Tier.DEVICE, after=_failing(engine, OSError("disk"))
    )
    with pytest.raises(OSError, match="disk"):
        failed.wait()
    with pytest.raises(TierMemError, match=r"chains copies between two tiers"):
        engine.copy_async(dst, src, src_tier=Tier.HOST, dst_tier=Tier.HOST, after=h)


def test_lease_is_pooled_released_once_and_refused_over_budget(engine):
    host = engine.stores[Tier.HOST]
    with engine.lease(4 * 1001, "<a>", TensorClass.GRAD) as lease:
        assert lease.view(torch.float32).shape == (1001,) and lease.view(torch.float32, (7, 143)).shape == (7, 143)
        assert host.ledger.kind_used[TensorClass.GRAD] > 0
    lease.release()  # again: nothing
    assert host.ledger.kind_used[TensorClass.GRAD] == 0 and host.ledger.held("<a>") == 0
    before = host.allocations
    engine.lease(4 * 1001, "<b>").release()
    assert host.allocations == before  # the same buffer again
    with pytest.raises(OutOfTierMemory, match="'<big>'"):
        engine.lease(64 << 20, "<big>")
    assert host.ledger.held("<big>") == 0


def test_flush_behind_queued_copies_then_give_the_buffer_back(engine):
    """What NVMe gradients do (NOTE [Gradients on NVMe]): accumulate in a leased host buffer
    from device->host copies, write it to NVMe behind them, give it back when the write lands."""
    host, grads = engine.stores[Tier.HOST], torch.randn(4, 1001)
    lease = engine.lease(grads.nbytes, "<grad landing b0>", TensorClass.GRAD)
    acc = lease.view(torch.float32, grads.shape)
    acc.zero_()
    gate = _Gate(engine)
    copies = [
        engine.copy_async(acc[i], grads[i], src_tier=Tier.DEVICE, dst_tier=Tier.HOST, accumulate=True) for i in range(4)
    ]
    flush = engine.chain(
        engine.behind("d2h"),
        lambda: engine.store_write(Tier.NVME, "b0:grad", acc, kind=TensorClass.GRAD),
        cleanup=lease.release,
        stall=Tier.NVME,
    )
    assert not flush.done()
    gate.open()
    flush.wait()
    assert all(c.done() for c in copies) and host.ledger.held("<grad landing b0>") == 0
    out = torch.empty_like(grads)
    engine.store_read(Tier.NVME, "b0:grad", out).wait()
    assert torch.equal(out, grads)
    assert engine.stats.bytes_moved[(Tier.HOST, Tier.NVME)] == grads.nbytes  # counted once
    assert engine.stats.class_bytes_moved[(TensorClass.GRAD, Tier.HOST, Tier.NVME)] == grads.nbytes
    assert engine.stats.busy_seconds[(Tier.HOST, Tier.NVME)] > 0


@settings(max_examples=60, deadline=None)
@given(
    firsts=st.lists(st.one_of(st.integers(), st.none()), max_size=4),
    then=st.sampled_from(["none", "value", "raise", "request", "failed request"]),
    cleanup_fails=st.booleans(),
)
def test_chain_outcome_is_the_first_error_or_the_last_result(firsts, then, cleanup_fails):
    """``None`` in ``firsts`` is a failed request. The chain ends with the first error along the
    way (``first`` in order, then ``then``, then ``cleanup``), else with its last result."""
    e = TransferEngine({Tier.HOST: HostStore(1 << 20)})
    try:
        handles = [e.run_async(lambda v=v: v) if v is not None else _failing(e, KeyError("first")) for v in firsts]
        fns = {
            "none": None,
            "value": lambda: "v",
            "raise": lambda: {}["then"],
            "request": lambda: e.run_async(lambda: "r"),
            "failed request": lambda: _failing(e, KeyError("req")),
        }
        cleaned = []

        def cleanup():
            cleaned.append(1)
            if cleanup_fails:
                raise KeyError("cleanup")

        h = e.chain(handles, fns[then], cleanup=cleanup)
        if None in firsts:
            expect = "first"
        elif then in ("raise", "failed request"):
            expect = {"raise": "then", "failed request": "req"}[then]
        else:
            expect = "cleanup" if cleanup_fails else None
        if expect is None:
            assert h.wait() == {"none": firsts, "value": "v", "request": "r"}[then]
        else:
            with pytest.raises(KeyError, match=expect):
                h.wait()
        assert cleaned == [1]
    finally:
        e.close()


def test_the_engine_provides_the_copy_service_the_homes_depend_on():
    """tiermem.transfer.service.CopyService is what the homes, the grad collector and the step call:
    every member is on TransferEngine, taking at least the protocol's arguments, by the same names."""
    import inspect

    from tiermem.transfer.service import CopyService

    members = [n for n, v in vars(CopyService).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert {
        "copy_async",
        "copy_many",
        "store_write",
        "store_read",
        "run_async",
        "join",
        "lease",
        "behind",
        "chain",
    } <= set(members)
    for name in members:
        want = inspect.signature(getattr(CopyService, name)).parameters
        have = inspect.signature(getattr(TransferEngine, name)).parameters
        assert [(p.name, p.kind) for p in want.values()] == [
            (p.name, p.kind) for p in have.values() if p.name in want
        ], name
    with TransferEngine({Tier.HOST: HostStore()}, device="cpu") as engine:
        assert engine.device == torch.device("cpu")  # the one attribute of the protocol
