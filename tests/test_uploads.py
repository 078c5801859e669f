"""Outputs and Uploads: where Adam writes a bucket's new weights, and when the staging buffers
they go home from may be reused.

The weight home here is a test double whose ``write`` returns handles the test completes by
hand; a future records when someone waits on it, so every ordering below is checked by flags
and events, never by timing.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch

from tiermem.handles import Handle
from tiermem.memory.resident import DeviceStore, HostStore
from tiermem.observe.trace import Tracer
from tiermem.plan.buckets import Bucket, Placed, plan_buckets
from tiermem.train.homes.bucket_homes import Homes
from tiermem.train.homes.state_homes import MemoryState
from tiermem.train.homes.update_runs import Runs
from tiermem.train.homes.uploads import Outputs
from tiermem.train.homes.weight_homes import DeviceWeights, WeightHome
from tiermem.transfer.engine import TransferEngine
from tiermem.types import Tier

DTYPE = torch.bfloat16
PATIENCE = 10.0  # seconds before a wait that should have ended counts as a hang (a failure, not a stall)


class HandFuture(Future):
    """A transfer the test finishes by hand; ``waited`` is set once anyone waits on it."""

    def __init__(self):
        super().__init__()
        self.waited = threading.Event()

    def result(self, timeout=None):
        self.waited.set()
        return super().result(PATIENCE if timeout is None else timeout)

    def exception(self, timeout=None):
        self.waited.set()
        return super().exception(PATIENCE if timeout is None else timeout)


@dataclass
class Write:
    bucket: int
    src: torch.Tensor
    sent: torch.Tensor  # a copy of src when it was handed over
    runs: Runs
    src_tier: Tier
    future: HandFuture


class HandWeights(WeightHome):
    """Working weights on the device as a test double: ``write`` records what was sent and returns
    a handle per call that the test completes; ``own`` buffers are what Adam on the device writes
    into directly."""

    def __init__(self, own: Optional[dict[int, torch.Tensor]] = None):
        self.own = own or {}
        self.writes: list[Write] = []
        self.wrote = threading.Event()  # set at the first write

    def initialize(self, b, master):
        pass

    def in_place(self, b, compute_tier):
        return self.own.get(b.index) if compute_tier == Tier.DEVICE else None

    def write(self, b, src, runs, src_tier):
        f = HandFuture()
        self.writes.append(Write(b.index, src, src.clone(), list(runs), src_tier, f))
        self.wrote.set()
        return [Handle(f)]


def _stores():
    return {Tier.DEVICE: DeviceStore("cpu"), Tier.HOST: HostStore()}


def _buckets(numels, states) -> list[Bucket]:
    """One bucket per numel, its optimizer state on the tier given (so Adam runs there)."""
    params = [
        Placed(f"p{i}", torch.nn.Parameter(torch.zeros(n)), Tier.HOST, state, 0, Tier.DEVICE)
        for i, (n, state) in enumerate(zip(numels, states))
    ]
    buckets = plan_buckets(params, 1)
    assert [b.numel for b in buckets] == list(numels)
    return buckets


def _homes(buckets, stores, weights) -> Homes:
    state = {}
    for tier in {b.state_tier for b in buckets}:
        mine = [b for b in buckets if b.state_tier == tier]
        home = MemoryState(stores[tier], mine)
        state.update({b.index: home for b in mine})
    return Homes(grads={}, state=state, weights={b.index: weights for b in buckets})


def _runs(b: Bucket) -> Runs:
    return [(0, b.numel, 1)]


def _is(view: torch.Tensor, buffer: torch.Tensor, numel: int) -> bool:
    """``view`` is the first ``numel`` elements of ``buffer`` itself, not a copy."""
    return (
        view.data_ptr() == buffer.data_ptr()
        and view.numel() == numel
        and view.dtype == buffer.dtype
        and view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    )


class Call:
    """``fn()`` on another thread, so a call that must block can be watched from this one."""

    def __init__(self, fn: Callable[[], object]):
        self.result: list = []
        self.error: list = []

        def run():
            try:
                self.result.append(fn())
            except BaseException as e:  # noqa: BLE001 - checked by the test
                self.error.append(e)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self):
        self.thread.join(PATIENCE)
        assert not self.thread.is_alive(), "the call did not return"
        if self.error:
            raise self.error[0]
        return self.result[0]


def _adam(out: torch.Tensor, value: float) -> None:
    out.fill_(value)  # what Adam writes into its target


# -- staging: state on the host, weights on the device ----------------------------------------------
def test_staging_alternates_two_buffers_and_waits_for_the_previous_transfer():
    stores = _stores()
    buckets = _buckets([7, 19, 4, 11, 5], [Tier.HOST] * 5)
    weights = HandWeights()
    outputs = Outputs(buckets, _homes(buckets, stores, weights), stores, DTYPE, overlap=False, tracer=Tracer(None))
    staging = outputs.staging[Tier.HOST]
    assert list(outputs.staging) == [Tier.HOST] and len(staging) == 2
    assert all(s.dtype == DTYPE and s.numel() == 19 for s in staging)  # as large as the largest bucket
    assert staging[0].data_ptr() != staging[1].data_ptr()
    up = outputs.session()
    b0, b1, b2, b3, b4 = buckets

    t0 = up.target(b0)
    assert _is(t0, staging[0], 7)
    _adam(t0, 1.0)
    up.done(b0, t0, _runs(b0))
    assert [(w.bucket, w.runs, w.src_tier) for w in weights.writes] == [(0, _runs(b0), Tier.HOST)]
    assert weights.writes[0].src.data_ptr() == t0.data_ptr()

    t1 = up.target(b1)  # the other buffer: no wait for bucket 0's transfer, still in flight
    assert _is(t1, staging[1], 19)
    assert not weights.writes[0].future.waited.is_set()
    _adam(t1, 2.0)
    up.done(b1, t1, _runs(b1))

    # bucket 2 reuses buffer 0: target() waits for bucket 0's transfer (and only that one)
    landed = []
    call = Call(lambda: (up.target(b2), list(landed)))
    assert weights.writes[0].future.waited.wait(PATIENCE), "target() did not wait for buffer 0's transfer"
    assert call.thread.is_alive() and not call.result  # blocked: buffer 0 is still being sent
    assert torch.equal(staging[0][:7], torch.full((7,), 1.0, dtype=DTYPE))  # untouched while in flight
    assert not weights.writes[1].future.waited.is_set()
    landed.append(0)
    weights.writes[0].future.set_result(None)
    t2, landed_when_returned = call.join()
    assert landed_when_returned == [0]  # returned only after the transfer had landed
    assert _is(t2, staging[0], 4)
    _adam(t2, 3.0)
    up.done(b2, t2, _runs(b2))

    weights.writes[1].future.set_result(None)  # buffer 1 free already: target() returns at once
    t3 = up.target(b3)
    assert _is(t3, staging[1], 11)
    _adam(t3, 4.0)
    up.done(b3, t3, _runs(b3))

    weights.writes[2].future.set_result(None)
    t4 = up.target(b4)
    assert _is(t4, staging[0], 5)
    up.done(b4, t4, _runs(b4))
    assert not weights.writes[3].future.waited.is_set()
    assert [(w.bucket, float(w.sent[0]), w.sent.numel()) for w in weights.writes[:4]] == [
        (0, 1.0, 7),
        (1, 2.0, 19),
        (2, 3.0, 4),
        (3, 4.0, 11),
    ]

    for w in weights.writes[3:]:
        w.future.set_result(None)
    up.finish()
    assert all(w.future.waited.is_set() for w in weights.writes[3:])


def test_a_single_bucket_gets_one_staging_buffer():
    stores = _stores()
    buckets = _buckets([13], [Tier.HOST])
    weights = HandWeights()
    outputs = Outputs(buckets, _homes(buckets, stores, weights), stores, DTYPE, overlap=False, tracer=Tracer(None))
    (staging,) = outputs.staging[Tier.HOST]
    assert staging.numel() == 13 and staging.dtype == DTYPE
    up = outputs.session()
    (b,) = buckets
    t = up.target(b)
    assert _is(t, staging, 13)
    up.done(b, t, _runs(b))
    call = Call(lambda: up.target(b))  # the one buffer again: wait for its transfer first
    assert weights.writes[0].future.waited.wait(PATIENCE)
    assert call.thread.is_alive() and not call.result
    weights.writes[0].future.set_result(None)
    assert _is(call.join(), staging, 13)


def test_only_buckets_whose_weights_are_elsewhere_take_turns_on_the_staging_buffers():
    stores = _stores()
    numels = [6, 40, 9, 3, 17]
    tiers = [Tier.HOST, Tier.DEVICE, Tier.HOST, Tier.DEVICE, Tier.HOST]
    buckets = _buckets(numels, tiers)
    own = {b.index: torch.zeros(b.numel, dtype=DTYPE) for b in buckets if b.state_tier == Tier.DEVICE}
    weights = HandWeights(own)
    outputs = Outputs(buckets, _homes(buckets, stores, weights), stores, DTYPE, overlap=False, tracer=Tracer(None))
    staging = outputs.staging[Tier.HOST]
    assert list(outputs.staging) == [Tier.HOST]
    assert [s.numel() for s in staging] == [17, 17]  # the largest bucket staged; the device's 40 is not
    up = outputs.session()
    expected = [staging[0], own[1], staging[1], own[3], staging[0]]
    for k, (b, buf) in enumerate(zip(buckets, expected)):
        if k == 4:
            weights.writes[0].future.set_result(None)
        out = up.target(b)
        assert _is(out, buf, b.numel), b.key
        up.done(b, out, _runs(b))
    assert [w.bucket for w in weights.writes] == [0, 2, 4]  # in place: nothing sent
    assert weights.writes[0].future.waited.is_set() and not weights.writes[1].future.waited.is_set()
    for w in weights.writes[1:]:
        w.future.set_result(None)
    up.finish()


# -- state and weights on the device ----------------------------------------------------------------
def test_state_and_weights_on_the_device_write_in_place_and_send_nothing():
    stores = _stores()
    buckets = _buckets([5, 12, 3], [Tier.DEVICE] * 3)
    own = {b.index: torch.zeros(b.numel, dtype=DTYPE) for b in buckets}
    weights = HandWeights(own)
    outputs = Outputs(buckets, _homes(buckets, stores, weights), stores, DTYPE, overlap=False, tracer=Tracer(None))
    assert outputs.staging == {} and outputs.param_out == {}
    up = outputs.session()
    for b in buckets:
        out = up.target(b)
        assert _is(out, own[b.index], b.numel)
        up.done(b, out, _runs(b))
    assert weights.writes == []
    up.finish()


def test_real_device_weights_are_the_target_when_adam_runs_on_the_device():
    stores = _stores()
    engine = TransferEngine(stores, device=torch.device("cpu"))
    try:
        buckets = _buckets([5, 12], [Tier.DEVICE] * 2)
        weights = DeviceWeights(stores[Tier.DEVICE], buckets, DTYPE, engine)
        homes = _homes(buckets, stores, weights)
        for b in buckets:
            weights.initialize(b, torch.zeros(b.numel))
        outputs = Outputs(buckets, homes, stores, DTYPE, overlap=False, tracer=Tracer(None))
        up = outputs.session()
        for b in buckets:
            out = up.target(b)
            out.copy_(torch.arange(b.numel))
            up.done(b, out, _runs(b))
            for s in b.slots:  # the module's parameters see what Adam wrote
                assert torch.equal(s.param, torch.arange(s.offset, s.offset + s.numel).to(DTYPE).view(s.shape))
        up.finish()
    finally:
        engine.close()


# -- overlap_step -----------------------------------------------------------------------------------
def test_overlap_targets_each_param_out_and_land_background_sends_them_home():
    stores = _stores()
    buckets = _buckets([6, 11, 4], [Tier.HOST, Tier.DEVICE, Tier.HOST])
    own = {b.index: torch.zeros(b.numel, dtype=DTYPE) for b in buckets if b.state_tier == Tier.DEVICE}
    weights = HandWeights(own)
    homes = _homes(buckets, stores, weights)
    outputs = Outputs(buckets, homes, stores, DTYPE, overlap=True, tracer=Tracer(None))
    assert outputs.staging == {}
    assert sorted(outputs.param_out) == [b.index for b in buckets]
    ptrs = {outputs.param_out[b.index].data_ptr() for b in buckets}
    assert len(ptrs) == len(buckets)  # one buffer per bucket
    up = outputs.session()
    for b in buckets:
        out = up.target(b)
        # even with the weights on the device: the next forward still reads the old ones
        assert _is(out, outputs.param_out[b.index], b.numel) and out.dtype == DTYPE
        assert b.index not in own or out.data_ptr() != own[b.index].data_ptr()
        _adam(out, float(b.index + 1))
        up.done(b, out, _runs(b))
    up.finish()
    assert weights.writes == []  # nothing is sent by the step itself

    plan = [(b, [] if b is buckets[2] else _runs(b)) for b in buckets]
    call = Call(lambda: outputs.land_background(plan))
    assert weights.wrote.wait(PATIENCE) and weights.writes[0].future.waited.wait(PATIENCE)
    assert [(w.bucket, w.runs, w.src_tier) for w in weights.writes] == [
        (b.index, runs, b.state_tier) for b, runs in plan
    ]
    assert all(w.src.data_ptr() == outputs.param_out[w.bucket].data_ptr() for w in weights.writes)
    assert [float(w.sent[0]) for w in weights.writes] == [1.0, 2.0, 3.0]
    for w in weights.writes:
        assert call.thread.is_alive()  # waits for every write
        w.future.set_result(None)
    call.join()
    assert all(w.future.waited.is_set() for w in weights.writes)


# -- finish -----------------------------------------------------------------------------------------
def _three_uploads(failures: dict[int, BaseException]):
    """Three host buckets sent home; bucket 0's transfer lands, the others end with ``failures``."""
    stores = _stores()
    buckets = _buckets([3, 8, 5], [Tier.HOST] * 3)
    weights = HandWeights()
    outputs = Outputs(buckets, _homes(buckets, stores, weights), stores, DTYPE, overlap=False, tracer=Tracer(None))
    up = outputs.session()
    for b in buckets:
        if b.index == 2:
            weights.writes[0].future.set_result(None)  # bucket 2 reuses bucket 0's buffer
        out = up.target(b)
        up.done(b, out, _runs(b))
    for k, w in enumerate(weights.writes[1:], start=1):
        if k in failures:
            w.future.set_exception(failures[k])
        else:
            w.future.set_result(None)
    return up, weights


@pytest.mark.parametrize(
    "failures, message",
    [
        ({1: RuntimeError("first"), 2: RuntimeError("second")}, "first"),
        ({2: RuntimeError("second")}, "second"),
        ({1: OSError("first")}, "first"),
    ],
)
def test_finish_raises_the_first_failed_transfer_after_waiting_for_all(failures, message):
    up, weights = _three_uploads(failures)
    with pytest.raises(type(failures[min(failures)]), match=f"^{message}$"):
        up.finish()
    assert all(w.future.waited.is_set() for w in weights.writes)
    up.finish()  # nothing left in flight: the error was reported once


def test_finish_quietly_waits_for_all_and_raises_nothing():
    up, weights = _three_uploads({1: RuntimeError("first"), 2: RuntimeError("second")})
    up.finish(quiet=True)
    assert all(w.future.waited.is_set() for w in weights.writes)


def test_finish_with_every_transfer_landed_returns():
    up, weights = _three_uploads({})
    up.finish()
    assert len(weights.writes) == 3 and all(w.future.waited.is_set() for w in weights.writes)
