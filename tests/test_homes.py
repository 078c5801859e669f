"""Contract tests for the homes (NOTE [Homes] in tiermem/train/homes/bucket_homes.py).

Each interface is tested once, in its own words, against every home that implements it: the
cases below are tables, so a new home (another rank's memory) is one more row. A backward is
driven here as :class:`tiermem.train.step.grads.GradCollector` drives it: each slot's device grad
copied into ``landing`` (added when the slot already got one in this step), then ``arrived``.
Gradients are integer-valued floats, so every sum is exact and every check is bit-exact.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tiermem.errors import OutOfTierMemory, StoreError
from tiermem.handles import wait_all
from tiermem.memory.aligned import ALIGN, round_up
from tiermem.memory.nvme import NvmeStore
from tiermem.memory.resident import DeviceStore, HostStore
from tiermem.observe.trace import Tracer
from tiermem.optim.formats import state_format
from tiermem.plan.buckets import Bucket, Placed, plan_buckets
from tiermem.plan.placement import compute_tier
from tiermem.train.homes.grad_homes import GradHome, MemoryGrads
from tiermem.train.homes.nvme_grads import NvmeGrads
from tiermem.train.homes.nvme_state import NvmeState
from tiermem.train.homes.state_homes import MemoryState, StateHome
from tiermem.train.homes.store_keys import Part, StoreKey, bucket_key, master_key, state_key
from tiermem.train.homes.weight_homes import DeviceWeights, WeightHome
from tiermem.train.hooks import HookSet
from tiermem.train.weights.frozen import copy_key
from tiermem.train.weights.param_offload import ParamOffload
from tiermem.train.weights.weight_shards import MasterShards, shard_key
from tiermem.transfer.engine import TransferEngine
from tiermem.transfer.residency import KeyedResidency
from tiermem.transfer.schedule import ResidencyScheduler
from tiermem.types import TensorClass, Tier

# odd sizes; with BUCKET_NUMEL they make four buckets of one to three slots, of unequal sizes
SHAPES = [(3, 5), (7,), (2, 3, 3), (11,), (1,), (13, 2), (5,), (9,)]
BUCKET_NUMEL = 30


# -- setup ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _engine() -> Iterator[TransferEngine]:
    """Device (the CPU), host and NVMe stores behind one engine, all closed afterwards."""
    with tempfile.TemporaryDirectory(prefix="tiermem-homes-") as tmp:
        nvme = NvmeStore(tmp, keep_previous=False)  # as TieredModel makes it: one value per key
        engine = TransferEngine(
            {Tier.DEVICE: DeviceStore("cpu"), Tier.HOST: HostStore(), Tier.NVME: nvme}, device=torch.device("cpu")
        )
        try:
            yield engine
        finally:
            engine.close()
            nvme.close()


@pytest.fixture
def engine() -> Iterator[TransferEngine]:
    with _engine() as e:
        yield e


def _buckets(
    shapes=SHAPES,
    bucket_numel=BUCKET_NUMEL,
    *,
    grad=Tier.HOST,
    state=Tier.HOST,
    weights=Tier.DEVICE,
    params: Optional[list] = None,
) -> list[Bucket]:
    if params is None:
        params = [(f"p{i}", torch.nn.Parameter(torch.zeros(shape))) for i, shape in enumerate(shapes)]
    return plan_buckets([Placed(name, p, grad, state, 0, weights) for name, p in params], bucket_numel)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``: equal bits, not merely equal values (-0.0, NaN)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _host_grad_bytes(engine) -> int:
    return engine.stores[Tier.HOST].ledger.kind_used.get(TensorClass.GRAD, 0)


# -- gradients ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GradCase:
    id: str
    grad_tier: Tier
    state_tier: Tier  # decides where Adam runs, so whether gather() must bring the grads there
    holds_open: bool  # a backward that stops early leaves buckets open until end_backward
    make: Callable[[list[Bucket], TransferEngine, int], GradHome]  # (buckets, engine, buffers)


def _memory_grads(buckets, engine, buffers=1) -> GradHome:
    store = engine.stores[buckets[0].grad_tier]
    return MemoryGrads(
        store, buckets, {b.index: compute_tier(b) for b in buckets}, engine.stores, engine, buffers=buffers
    )


def _nvme_grads(buckets, engine, buffers=1) -> GradHome:
    assert buffers == 1, "NvmeGrads refuses overlap_step: one buffer"
    return NvmeGrads(buckets, engine, engine.stores[Tier.HOST])


MEMORY_GRADS = [
    GradCase("device", Tier.DEVICE, Tier.DEVICE, False, _memory_grads),
    GradCase("device, Adam on host", Tier.DEVICE, Tier.HOST, False, _memory_grads),
    GradCase("host", Tier.HOST, Tier.HOST, False, _memory_grads),
    GradCase("host, Adam on device", Tier.HOST, Tier.DEVICE, False, _memory_grads),
]
GRAD_CASES = MEMORY_GRADS + [
    GradCase("nvme", Tier.NVME, Tier.HOST, True, _nvme_grads),
    GradCase("nvme, state on nvme", Tier.NVME, Tier.NVME, True, _nvme_grads),
]


def _grad_home(case: GradCase, engine, shapes=SHAPES, bucket_numel=BUCKET_NUMEL, buffers=1):
    buckets = _buckets(shapes, bucket_numel, grad=case.grad_tier, state=case.state_tier)
    return buckets, case.make(buckets, engine, buffers)


def _grads(buckets, seed: int) -> dict[tuple[int, int], torch.Tensor]:
    """One micro-batch's device gradients, integer-valued, by (bucket, slot offset)."""
    g = torch.Generator().manual_seed(seed)
    return {
        (b.index, s.offset): torch.randint(-100, 100, (s.numel,), generator=g).float() for b in buckets for s in b.slots
    }


def _backward(engine, home: GradHome, buckets, grads, got: set, *, fill=0, only=None, end=True) -> None:
    """One backward as GradCollector drives it; ``only`` limits it to some (bucket, offset);
    ``end=False`` stops before end_backward (a backward that raised half way)."""
    copies = []
    for b in buckets:
        for s in b.slots:
            key = (b.index, s.offset)
            if only is not None and key not in only:
                continue
            acc = home.landing(b, fill)[s.offset : s.offset + s.numel]
            copies.append(
                engine.copy_async(
                    acc,
                    grads[key],
                    src_tier=Tier.DEVICE,
                    dst_tier=home.landing_tier,
                    accumulate=key in got,
                    kind=TensorClass.GRAD,
                )
            )
            got.add(key)
            home.arrived(b)
    if end:
        home.end_backward()
    wait_all(copies)


def _read(home: GradHome, buckets, fill=0) -> dict[tuple[int, int], torch.Tensor]:
    """What the step sees: gather, then each bucket read and freed."""
    wait_all(home.gather(fill))
    out = {}
    for b in buckets:
        t, free = home.read(b, fill)
        assert t.dtype == torch.float32 and t.shape == (b.numel,)
        out.update({(b.index, s.offset): t[s.offset : s.offset + s.numel].clone() for s in b.slots})
        free()
    return out


def _check_grads(seen, expected) -> None:
    for key in expected:
        assert _same(seen[key], expected[key]), f"slot {key}: {seen[key]} != {expected[key]}"


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.id)
def test_grads_of_two_micro_batches_read_back_as_their_sum(engine, case):
    buckets, home = _grad_home(case, engine)
    a, b = _grads(buckets, 1), _grads(buckets, 2)
    got: set = set()
    _backward(engine, home, buckets, a, got)
    _backward(engine, home, buckets, b, got)
    home.wait()
    host_before = _host_grad_bytes(engine)
    _check_grads(_read(home, buckets), {k: a[k] + b[k] for k in a})
    assert _host_grad_bytes(engine) == host_before  # free() gave back what read() took
    _check_grads(_read(home, buckets), {k: a[k] + b[k] for k in a})  # reading does not consume
    home.end_step()


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.id)
def test_grads_accumulating_only_between_a_partial_backward_and_its_end(engine, case):
    buckets, home = _grad_home(case, engine)
    multi = [b for b in buckets if len(b.slots) > 1]
    assert multi, "the plan needs a bucket of several slots"
    first_slots = {(b.index, b.slots[0].offset) for b in multi}
    a, b = _grads(buckets, 3), _grads(buckets, 4)
    got: set = set()
    assert not home.accumulating()
    _backward(engine, home, buckets, a, got, only=first_slots, end=False)
    assert home.accumulating() == case.holds_open
    home.end_backward()
    assert not home.accumulating()
    _backward(engine, home, buckets, b, got, end=False)  # every slot arrives: nothing left open
    assert not home.accumulating()
    home.end_backward()
    home.wait()
    expected = {k: a[k] + b[k] if k in first_slots else b[k] for k in b}
    _check_grads(_read(home, buckets), expected)


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.id)
def test_grads_drop_leaves_the_home_ready_for_a_fresh_backward(engine, case):
    buckets, home = _grad_home(case, engine)
    host_before = _host_grad_bytes(engine)
    a, b, c = _grads(buckets, 5), _grads(buckets, 6), _grads(buckets, 7)
    got: set = set()
    _backward(engine, home, buckets, a, got)
    some = {(bk.index, bk.slots[-1].offset) for bk in buckets}
    _backward(engine, home, buckets, b, got, only=some, end=False)  # the second micro-batch raised
    home.drop()
    assert not home.accumulating()
    assert _host_grad_bytes(engine) == host_before  # nothing in flight holds host memory
    got = set()  # the collector forgets which slots got a grad
    _backward(engine, home, buckets, c, got)
    home.wait()
    _check_grads(_read(home, buckets), c)


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.id)
def test_grads_next_step_starts_afresh(engine, case):
    buckets, home = _grad_home(case, engine)
    a, b, c = _grads(buckets, 8), _grads(buckets, 9), _grads(buckets, 10)
    got: set = set()
    _backward(engine, home, buckets, a, got)
    _backward(engine, home, buckets, b, got)
    home.wait()
    _check_grads(_read(home, buckets), {k: a[k] + b[k] for k in a})
    home.end_step()
    got = set()
    _backward(engine, home, buckets, c, got)
    _backward(engine, home, buckets, a, got)
    home.wait()
    _check_grads(_read(home, buckets), {k: c[k] + a[k] for k in a})


def _grad_memory(engine, buckets) -> dict:
    """The grad buffers holding memory now (by key), the GRAD bytes the device's and the host's
    ledgers count, and what the host pool caches."""
    stores = [engine.stores[t] for t in (Tier.DEVICE, Tier.HOST)]
    keys = [f"{b.key}:{n}" for b in buckets for n in ("grad", "grad_alt", "grad_in")]
    return {
        "resident": sorted(k for k in keys for st in stores if k in st),
        **{st.tier: st.ledger.kind_used.get(TensorClass.GRAD, 0) for st in stores},
        "cached": engine.stores[Tier.HOST].ledger.held(HostStore._POOL_KEY),
    }


@pytest.mark.parametrize("case", MEMORY_GRADS, ids=lambda c: c.id)
def test_memory_grads_hold_memory_from_their_first_landing_to_the_end_of_the_step(engine, case):
    """NOTE [Grads come and go]: no grad buffer holds memory before a backward or after the step
    (none cached by the host pool either: these are not pinned), a bucket's from its first
    landing; the budget counts every bucket's room throughout; the step's grads as landed."""
    buckets, home = _grad_home(case, engine)
    before = _grad_memory(engine, buckets)
    room = {Tier.DEVICE: 0, Tier.HOST: 0}
    for b in buckets:
        for t in {case.grad_tier, case.state_tier}:  # where they land, and where Adam reads them (grad_in)
            room[t] += round_up(4 * b.numel) if t == Tier.HOST else 4 * b.numel
    assert before == {"resident": [], **room, "cached": 0}
    for seed in (14, 15):
        a, b = _grads(buckets, seed), _grads(buckets, seed + 10)
        got: set = set()
        _backward(engine, home, buckets[:1], a, got)
        # that bucket's alone (the grads Adam reads on another tier come at the step)
        assert _grad_memory(engine, buckets) == {**before, "resident": [f"{buckets[0].key}:grad"]}
        _backward(engine, home, buckets[1:], a, got)
        _backward(engine, home, buckets, b, got)
        home.wait()
        _check_grads(_read(home, buckets), {k: a[k] + b[k] for k in a})
        home.end_step()
        assert _grad_memory(engine, buckets) == before


@pytest.mark.parametrize("case", MEMORY_GRADS, ids=lambda c: c.id)
def test_overlap_steps_grad_buffers_stay_for_the_run(engine, case):
    """Under overlap_step the update in the background reads one buffer after its step returned:
    both are allocated once, and a step's end frees neither."""
    buckets, home = _grad_home(case, engine, buffers=2)
    held = _grad_memory(engine, buckets)
    assert len(held["resident"]) == len(buckets) * (2 + (case.grad_tier != case.state_tier))
    a = _grads(buckets, 16)
    _backward(engine, home, buckets, a, set())
    home.wait()
    home.end_step()
    assert _grad_memory(engine, buckets) == held
    _check_grads(_read(home, buckets), a)  # the background update still reads them


@pytest.mark.parametrize(
    "store, page", [(lambda: HostStore(budget=5 * ALIGN, pin=False), ALIGN), (lambda: DeviceStore("cpu", 5 * 4), 4)]
)
def test_room_held_without_memory_counts_against_the_budget(store, page):
    """hold_room and vacate keep a key's bytes counted with no tensor behind them: allocate(key)
    takes its room back (never refused for it), delete(key) gives it up; a host buffer vacated goes
    back to the system, not to the pool's cache."""
    st = store()  # a budget of 5 pages (the host pool's; of 4 bytes on the device)
    st.hold_room("g", (3 * page // 4,), torch.float32, TensorClass.GRAD)
    assert "g" not in st and st.used == 3 * page == st.ledger.kind_used[TensorClass.GRAD] == st.room
    st.allocate("other", (page,), torch.uint8)
    with pytest.raises(OutOfTierMemory, match="'more'"):  # the room is the grads'
        st.allocate("more", (2 * page,), torch.uint8)
    g = st.allocate("g", (3 * page // 4,), torch.float32, TensorClass.GRAD)
    g.fill_(2.0)
    assert "g" in st and st.used == 4 * page and st.room == 0
    assert st.vacate("g") and "g" not in st and st.used == 4 * page and st.room == 3 * page
    if st.tier == Tier.HOST:
        assert st.ledger.held(HostStore._POOL_KEY) == 0 and st.allocations == 2  # nothing cached
    assert not st.vacate("unknown") and not st.vacate("g")  # no tensor: nothing to give back
    st.delete("g")
    assert st.used == page and st.room == 0
    st.allocate("more", (2 * page,), torch.uint8)  # its room is free now


@pytest.mark.cuda
def test_a_pinned_host_buffer_is_never_vacated():
    """Pinning is what costs on a GPU machine: a pinned grad buffer stays (NOTE [Grads come and go])."""
    host = HostStore(pin=True)
    t = host.allocate("g", (5000,), torch.float32, TensorClass.GRAD)
    assert not host.vacate("g") and host.get("g") is t and host.pinned_bytes == t.nbytes
    host.release_all()


@pytest.mark.parametrize("case", MEMORY_GRADS, ids=lambda c: c.id)
def test_two_grad_buffers_are_independent(engine, case):
    buckets, home = _grad_home(case, engine, buffers=2)
    a, b, c = _grads(buckets, 11), _grads(buckets, 12), _grads(buckets, 13)
    got0: set = set()
    got1: set = set()
    _backward(engine, home, buckets, a, got0, fill=0)
    _backward(engine, home, buckets, b, got1, fill=1)
    _backward(engine, home, buckets, c, got0, fill=0)
    home.wait()
    _check_grads(_read(home, buckets, fill=0), {k: a[k] + c[k] for k in a})
    _check_grads(_read(home, buckets, fill=1), b)
    _check_grads(_read(home, buckets, fill=0), {k: a[k] + c[k] for k in a})


@settings(max_examples=8, deadline=None)
@given(
    numels=st.lists(st.integers(1, 40), min_size=1, max_size=7), bucket_numel=st.integers(1, 60), partial=st.booleans()
)
def test_grads_sum_for_any_slot_sizes(numels, bucket_numel, partial):
    with _engine() as engine:
        for case in GRAD_CASES:
            buckets, home = _grad_home(case, engine, [(n,) for n in numels], bucket_numel)
            a, b = _grads(buckets, 14), _grads(buckets, 15)
            some = {(bk.index, bk.slots[0].offset) for bk in buckets} if partial else None
            got: set = set()
            _backward(engine, home, buckets, a, got, only=some)  # some parameters got no grad
            _backward(engine, home, buckets, b, got)
            home.wait()
            _check_grads(_read(home, buckets), {k: a[k] + b[k] if some is None or k in some else b[k] for k in b})
            home.end_step()


# -- optimizer state -------------------------------------------------------------------------------
@dataclass(frozen=True)
class StateCase:
    id: str
    tier: Tier
    revertible: bool  # what the home must say, and do
    master_resident: bool  # master() is a view of the fp32 master, not a meta tensor
    make: Callable[[list[Bucket], TransferEngine], StateHome]


STATE_CASES = [
    StateCase("device", Tier.DEVICE, False, True, lambda bs, e: MemoryState(e.stores[Tier.DEVICE], bs)),
    StateCase("host", Tier.HOST, False, True, lambda bs, e: MemoryState(e.stores[Tier.HOST], bs)),
    StateCase("nvme", Tier.NVME, False, False, lambda bs, e: NvmeState(bs, e, e.stores[Tier.HOST])),
]
NVME_STATE = STATE_CASES[-1]


class Boom(RuntimeError):
    pass


def _state_home(case: StateCase, engine, shapes=SHAPES, bucket_numel=BUCKET_NUMEL):
    buckets = _buckets(shapes, bucket_numel, grad=Tier.HOST, state=case.tier)
    home = case.make(buckets, engine)
    assert home.revertible == case.revertible
    return buckets, home


def _masters(buckets, seed=0) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {b.index: torch.randn(b.numel, generator=g) * 3 for b in buckets}


def _initialize(home: StateHome, buckets, masters) -> None:
    for b in buckets:  # as layout.build does: fill one bucket's master, initialize it, then the next
        home.initial_master(b).copy_(masters[b.index])
        home.initialize(b)


def _snapshot(home: StateHome, buckets) -> dict[int, tuple[torch.Tensor, ...]]:
    return {b.index: tuple(v.clone() for v in home.read(b)) for b in buckets}


def _check_state(home: StateHome, buckets, expected) -> None:
    for b in reversed(buckets):  # another order than the one written in
        views = home.read(b)
        assert all(v.shape == (b.numel,) and v.dtype == torch.float32 for v in views)
        for part, got, want in zip(("master", "exp_avg", "exp_avg_sq"), views, expected[b.index]):
            assert _same(got, want), f"{b.key}:{part}"


def _plan(buckets):
    """Every bucket, each with its own runs: one per slot, the last bucket with none."""
    return [(b, [] if b is buckets[-1] else [(s.offset, s.offset + s.numel, 1) for s in b.slots]) for b in buckets]


def _bump(b, runs, views) -> None:
    """A stand-in for Adam: master +index+1, exp_avg +0.5, exp_avg_sq = master^2 (0.25 with no runs)."""
    master, m, v = views
    master.add_(b.index + 1)
    m.add_(0.5)
    v.copy_(master * master if runs else torch.full_like(v, 0.25))


def _bumped(before, buckets):
    """The state after ``_bump`` over ``_plan(buckets)``."""
    out = {}
    for i, (master, m, v) in before.items():
        new = master + (i + 1)
        out[i] = (new, m + 0.5, torch.full_like(v, 0.25) if i == buckets[-1].index else new * new)
    return out


@pytest.mark.parametrize("case", STATE_CASES, ids=lambda c: c.id)
def test_state_initialize_gives_the_master_and_zero_moments(engine, case):
    buckets, home = _state_home(case, engine)
    masters = _masters(buckets)
    _initialize(home, buckets, masters)
    _check_state(home, buckets, {i: (m, torch.zeros_like(m), torch.zeros_like(m)) for i, m in masters.items()})


@pytest.mark.parametrize("case", STATE_CASES, ids=lambda c: c.id)
def test_state_store_then_read_gives_it_back(engine, case):
    buckets, home = _state_home(case, engine)
    _initialize(home, buckets, _masters(buckets))
    g = torch.Generator().manual_seed(1)
    stored = {b.index: tuple(torch.randn(b.numel, generator=g) for _ in range(3)) for b in buckets}
    for k, b in enumerate(buckets):
        views = home.load_views(b)
        for v, value in zip(views, stored[b.index]):
            v.copy_(value)
        home.store(b, views)
        other = buckets[k - 1]  # read another bucket in between: its buffers must not be this one's
        if other is not b and k > 0:
            assert all(_same(v, w) for v, w in zip(home.read(other), stored[other.index]))
    _check_state(home, buckets, stored)


@pytest.mark.parametrize("case", STATE_CASES, ids=lambda c: c.id)
def test_state_step_updates_every_bucket_once(engine, case):
    buckets, home = _state_home(case, engine)
    _initialize(home, buckets, _masters(buckets))
    tracer = Tracer(None)
    for _ in range(2):  # the second step starts from the first one's writes
        before = _snapshot(home, buckets)
        calls, updated = [], set()

        def update(b, runs, views):
            assert all(v.shape == (b.numel,) and v.dtype == torch.float32 for v in views)
            assert all(_same(v, w) for v, w in zip(views, before[b.index]))  # the current state
            calls.append((b.index, runs))
            _bump(b, runs, views)

        plan = _plan(buckets)
        home.step(plan, update, tracer, updated)
        assert calls == [(b.index, runs) for b, runs in plan]
        assert updated == (set() if case.revertible else {b.index for b in buckets})
        _check_state(home, buckets, _bumped(before, buckets))


def _stepped_once(case, engine):
    """A state home after one step, and its state then."""
    buckets, home = _state_home(case, engine)
    _initialize(home, buckets, _masters(buckets))
    tracer = Tracer(None)
    home.step(_plan(buckets), _bump, tracer, set())
    return buckets, home, tracer, _snapshot(home, buckets)


@pytest.mark.parametrize("case", STATE_CASES, ids=lambda c: c.id)
def test_state_step_that_fails_on_the_second_bucket(engine, case):
    buckets, home, tracer, before = _stepped_once(case, engine)

    def update(b, runs, views):
        if b is buckets[1]:
            raise Boom("the update failed")  # as Adam's upload target would: before writing
        _bump(b, runs, views)

    updated: set = set()
    with pytest.raises(Boom, match="the update failed"):
        home.step(_plan(buckets), update, tracer, updated)
    expected = dict(before)
    if case.revertible:
        assert updated == set()
    else:  # the first bucket's update happened and cannot be undone: the caller is told
        assert updated == {buckets[0].index}
        expected[buckets[0].index] = _bumped(before, buckets)[buckets[0].index]
    _check_state(home, buckets, expected)


class _TornWrites:
    """The NVMe store's data writes to ``key``'s file fail with EIO once its header is blanked:
    the write is torn half-way, as a failing disk would leave it."""

    def __init__(self, store, key: str):
        import errno
        import os

        from tiermem.memory import nvme_layout as layout

        self.store, self.real = store, store._pwritev
        names = {layout.file_name(key, slot) for slot in (0, 1)}

        def pwritev(fd, bufs, offset):
            if offset > 0 and os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) in names:
                raise OSError(errno.EIO, "Input/output error")
            return self.real(fd, bufs, offset)

        store._pwritev = pwritev

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.store._pwritev = self.real


@pytest.mark.parametrize("failing", [0, 1, -1], ids=["first", "second", "last"])
def test_nvme_state_write_torn_mid_step_keeps_every_bucket_whole_and_a_retry_completes(engine, failing):
    """NOTE [A failed step is rolled forward]: a bucket whose state write fails keeps its whole
    state from before the step (never a torn one), the buckets whose write landed are reported
    updated, and running the rest again completes the step exactly."""
    buckets, home, tracer, before = _stepped_once(NVME_STATE, engine)
    bad = buckets[failing]
    updated: set = set()
    with _TornWrites(engine.stores[Tier.NVME], str(home.key(bad))):
        with pytest.raises(StoreError, match=rf"NVMe write of '{bad.key}:state'.*Input/output error"):
            home.step(_plan(buckets), _bump, tracer, updated)
    assert bad.index not in updated
    bumped = _bumped(before, buckets)
    _check_state(home, buckets, {i: bumped[i] if i in updated else before[i] for i in before})
    home.step([(b, runs) for b, runs in _plan(buckets) if b.index not in updated], _bump, tracer, updated)
    assert updated == {b.index for b in buckets}
    _check_state(home, buckets, bumped)


@pytest.mark.parametrize("case", STATE_CASES, ids=lambda c: c.id)
def test_state_stored_between_steps_is_what_the_next_step_reads(engine, case):
    """NvmeState reads the next step's first bucket ahead when a step ends: a checkpoint load
    between the steps (store) must win over that read."""
    buckets, home, tracer, _ = _stepped_once(case, engine)
    g = torch.Generator().manual_seed(5)
    stored = {b.index: tuple(torch.randn(b.numel, generator=g) for _ in range(3)) for b in buckets}
    for b in buckets:
        views = home.load_views(b)
        for v, value in zip(views, stored[b.index]):
            v.copy_(value)
        home.store(b, views)
    seen = {}

    def update(b, runs, views):
        seen[b.index] = tuple(v.clone() for v in views)
        _bump(b, runs, views)

    home.step(_plan(buckets), update, tracer, set())
    assert all(_same(a, w) for b in buckets for a, w in zip(seen[b.index], stored[b.index]))
    _check_state(home, buckets, _bumped(stored, buckets))


@pytest.mark.parametrize("case", STATE_CASES, ids=lambda c: c.id)
def test_state_master_is_a_view_or_a_meta_tensor(engine, case):
    buckets, home = _state_home(case, engine)
    masters = _masters(buckets)
    _initialize(home, buckets, masters)
    for b in buckets:
        for s in b.slots:
            t = home.master(b, s)
            assert t.shape == s.shape
            if not case.master_resident:
                assert t.device.type == "meta"
                continue
            assert t.dtype == torch.float32 and t.device.type != "meta"
            assert _same(t, masters[b.index][s.offset : s.offset + s.numel].view(s.shape))
            t.fill_(-7.0)  # a view: the home's master changes with it
            assert torch.equal(home.read(b)[0][s.offset : s.offset + s.numel], torch.full((s.numel,), -7.0))


@settings(max_examples=8, deadline=None)
@given(
    numels=st.lists(st.integers(1, 50), min_size=1, max_size=8),
    bucket_numel=st.integers(1, 80),
    failing=st.integers(0, 7),
)
def test_state_steps_and_failures_for_any_slot_sizes(numels, bucket_numel, failing):
    """Buckets of any sizes (the NVMe pipeline rotates three buffer sets of the largest one): two
    steps, then one that fails on some bucket; every home ends as its contract says."""
    with _engine() as engine:
        tracer = Tracer(None)
        for case in STATE_CASES:
            buckets, home = _state_home(case, engine, [(n,) for n in numels], bucket_numel)
            _initialize(home, buckets, _masters(buckets, seed=len(numels)))
            for _ in range(2):
                home.step(_plan(buckets), _bump, tracer, set())
            before = _snapshot(home, buckets)
            bad = buckets[failing % len(buckets)]

            def update(b, runs, views):
                if b is bad:
                    raise Boom("no")
                _bump(b, runs, views)

            updated: set = set()
            with pytest.raises(Boom):
                home.step(_plan(buckets), update, tracer, updated)
            done = [b.index for b in buckets[: buckets.index(bad)]]
            assert updated == (set() if case.revertible else set(done))
            expected = dict(before)
            bumped = _bumped(before, buckets)
            for i in updated:
                expected[i] = bumped[i]
            _check_state(home, buckets, expected)


# -- working weights -------------------------------------------------------------------------------
class Holder(torch.nn.Module):
    """One parameter; forward returns what the module computes with (a copy of the weight)."""

    def __init__(self, shape):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(shape))

    def forward(self):
        return self.w.detach().clone()


@dataclass(frozen=True)
class WeightCase:
    id: str
    tier: Tier  # the weights' home
    in_place_on_device: bool  # Adam on the device may write the new weights straight into them
    make: Callable[[torch.nn.Module, list[Bucket], TransferEngine, HookSet], WeightHome]


def _param_offload(module, buckets, engine, hooks) -> WeightHome:
    homes = {s.name: b.param_tier for b in buckets for s in b.slots}
    res = KeyedResidency(engine)
    return ParamOffload(
        module, homes, res, ResidencyScheduler(Tier.DEVICE).connect(res), torch.bfloat16, torch.device("cpu"), hooks
    )


WEIGHT_CASES = [
    WeightCase(
        "device", Tier.DEVICE, True, lambda m, bs, e, h: DeviceWeights(e.stores[Tier.DEVICE], bs, torch.bfloat16, e)
    ),
    WeightCase("host (offloaded)", Tier.HOST, False, _param_offload),
    WeightCase("nvme (offloaded)", Tier.NVME, False, _param_offload),
]


def _weight_home(case: WeightCase, engine):
    module = torch.nn.ModuleList(Holder(shape) for shape in SHAPES)
    buckets = _buckets(params=list(module.named_parameters()), state=Tier.HOST, weights=case.tier)
    hooks = HookSet()
    return module, buckets, case.make(module, buckets, engine, hooks), hooks


def _working(module, s) -> torch.Tensor:
    """The weight the module computes with."""
    return module[int(s.name.split(".")[0])]()


def _bf16_masters(buckets, seed):
    """fp32 values that bf16 cannot hold: rounding shows."""
    return {i: m + 1e-3 for i, m in _masters(buckets, seed).items()}


@pytest.mark.parametrize("case", WEIGHT_CASES, ids=lambda c: c.id)
def test_weights_initialize_to_the_master_rounded(engine, case):
    module, buckets, home, hooks = _weight_home(case, engine)
    masters = _bf16_masters(buckets, 2)
    for b in buckets:
        master = masters[b.index].clone()
        home.initialize(b, master)
        master.fill_(float("nan"))  # a pipeline buffer the next bucket reuses: the home kept a copy
    for b in buckets:
        for s in b.slots:
            want = masters[b.index][s.offset : s.offset + s.numel].to(torch.bfloat16).view(s.shape)
            assert _same(_working(module, s), want), s.name
    hooks.remove()


@pytest.mark.parametrize("src_tier", [Tier.HOST, Tier.DEVICE])
@pytest.mark.parametrize("case", WEIGHT_CASES, ids=lambda c: c.id)
def test_weights_write_changes_exactly_the_runs(engine, case, src_tier):
    module, buckets, home, hooks = _weight_home(case, engine)
    masters = _bf16_masters(buckets, 3)
    for b in buckets:
        home.initialize(b, masters[b.index])
    new = {i: m.to(torch.bfloat16) for i, m in _bf16_masters(buckets, 4).items()}
    # every other slot, merged into runs where they touch (as the step's runs are)
    picked = {(b.index, s.offset) for b in buckets for k, s in enumerate(b.slots) if (k + b.index) % 2 == 0}
    home.begin_update()
    handles, sources = [], []
    for b in buckets:
        runs = [(s.offset, s.offset + s.numel, 1) for s in b.slots if (b.index, s.offset) in picked]
        sources.append(new[b.index].clone())
        handles += home.write(b, sources[-1], runs, src_tier)
    wait_all(handles)
    for src in sources:
        src.fill_(float("nan"))  # the handles are done: the source may be reused
    home.end_update()
    for b in buckets:
        for s in b.slots:
            source = new[b.index] if (b.index, s.offset) in picked else masters[b.index].to(torch.bfloat16)
            want = source[s.offset : s.offset + s.numel].view(s.shape)
            assert _same(_working(module, s), want), s.name
    hooks.remove()


@pytest.mark.parametrize("case", WEIGHT_CASES, ids=lambda c: c.id)
def test_weights_in_place_only_for_adam_on_the_device(engine, case):
    module, buckets, home, hooks = _weight_home(case, engine)
    masters = _bf16_masters(buckets, 5)
    for b in buckets:
        home.initialize(b, masters[b.index])
    cpu_device = case.tier == Tier.DEVICE and engine.stores[Tier.DEVICE].device.type == "cpu"
    for b in buckets:
        host = home.in_place(b, Tier.HOST)  # NOTE [A CPU device]: the host's Adam writes a CPU device's weights
        assert (host is not None) == cpu_device
        direct = home.in_place(b, Tier.DEVICE)
        assert (direct is not None) == case.in_place_on_device
        if direct is None:
            continue
        assert host is None or host.data_ptr() == direct.data_ptr()
        assert direct.dtype == torch.bfloat16 and direct.shape == (b.numel,)
        direct.copy_(torch.arange(b.numel))  # Adam writes here: no write() is needed afterwards
        for s in b.slots:
            want = torch.arange(s.offset, s.offset + s.numel).to(torch.bfloat16).view(s.shape)
            assert _same(_working(module, s), want), s.name
    hooks.remove()


def test_device_weights_parameters_are_views_of_one_flat_buffer(engine):
    module, buckets, home, hooks = _weight_home(WEIGHT_CASES[0], engine)
    for b in buckets:
        home.initialize(b, _bf16_masters(buckets, 6)[b.index])
        flat = home.in_place(b, Tier.DEVICE)
        for s in b.slots:
            assert s.param.dtype == torch.bfloat16 and s.param.shape == s.shape
            assert s.param.data.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            assert s.param.data.data_ptr() == flat[s.offset :].data_ptr()


# -- store keys ---------------------------------------------------------------------------------------
def test_store_keys_keep_the_text_the_stores_and_files_hold():
    """A key is a value (owner, part), and its text is what stores, ledgers, reports and NVMe file
    names have always read."""
    b = Bucket(3, Tier.HOST, Tier.HOST, 0)
    assert [str(bucket_key(b, part)) for part in Part] == [
        "bucket3:grad",
        "bucket3:grad_alt",
        "bucket3:grad_in",
        "bucket3:grad landing",
        "bucket3:grad landing copy",
        "bucket3:param",
        "bucket3:param_out",
        "bucket3:param shard",
        "bucket3:gathered",
        "bucket3:state",
        "bucket3:frozen",
    ]
    assert [str(state_key(b, part)) for part in b.state.parts] == [
        "bucket3:master",
        "bucket3:exp_avg",
        "bucket3:exp_avg_sq",
    ]
    assert NvmeGrads.key(b) == StoreKey("bucket3", Part.GRAD) and str(NvmeState.key(b)) == "bucket3:state"
    assert shard_key(b) == "bucket3:param shard" and copy_key("layers.0.weight") == "layers.0.weight:frozen"


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "lion"])
def test_a_chunk_rounded_from_its_master_reads_the_buckets_own_master(kind):
    """NOTE [A chunk rounded from its master]: the chunk is read from the master part of the
    bucket's own state format (here bf16, beside another optimizer's parts), found by its key."""
    fmt = state_format(kind, master_dtype=torch.bfloat16)
    b = Bucket(0, Tier.HOST, Tier.HOST, 0, Tier.HOST, numel=7, state=fmt)
    host = HostStore(pin=False)
    state = MemoryState(host, [b])
    state.initial_master(b).copy_(torch.arange(7, dtype=torch.bfloat16) / 3)
    assert master_key(b).part.dtype == torch.bfloat16 and str(master_key(b)) in host
    chunk, release = MasterShards(host, host, [b], {b.index: 7}, torch.float16).read(b)
    assert torch.equal(chunk, (torch.arange(7, dtype=torch.bfloat16) / 3).to(torch.float16))
    release()
