"""ResidencyScheduler: the pure decisions against brute-force oracles, then the scheduler on a real
engine (device budget smaller than the tensors, homes on host and NVMe): bytes come back
bit-exact, the budget holds, prefetch removes misses and stall after the first iteration, and
Belady evicts no more than LRU."""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tiermem import ConfigError, OutOfTierMemory, TensorClass, TensorInfo, Tier, TierMemError
from tiermem.errors import fmt_bytes
from tiermem.memory.nvme import NvmeStore
from tiermem.memory.resident import DeviceStore, HostStore
from tiermem.transfer.decisions import RepeatGuess
from tiermem.transfer.engine import TransferEngine
from tiermem.transfer.residency import KeyedResidency
from tiermem.transfer.schedule import AccessTrace, ResidencyScheduler, ScheduleStats, choose_victim, lookahead_window


# -- pure decisions -------------------------------------------------------------------------------
def _next_use_oracle(keys, key, pos):
    for i in range(pos, len(keys)):
        if keys[i] == key:
            return i
    return keys.index(key) + len(keys) if key in keys else math.inf


@pytest.mark.parametrize(
    "pos,key,expected",
    [
        (0, "a", 0),
        (1, "a", 3),
        (4, "a", 5),
        (0, "c", 2),
        (3, "c", 7),
        (5, "b", 6),
        (2, "zz", math.inf),
    ],
)
def test_next_use_wraps_into_the_next_iteration(pos, key, expected):
    trace = AccessTrace(["a", "b", "c", "a", "b"])
    assert trace.next_use(key, pos) == expected


def test_belady_picks_the_furthest_next_use():
    trace = AccessTrace(["a", "b", "c", "d", "c", "b", "a"])
    recency = {"a": 1, "b": 2, "c": 3, "d": 4}
    # at position 4 the next uses are c:4, b:5, a:6, d:3+7=10 (next iteration)
    assert choose_victim(["a", "b", "c", "d"], recency, trace=trace, pos=4) == "d"
    assert choose_victim(["a", "b", "c"], recency, trace=trace, pos=4) == "a"
    assert choose_victim(["b", "c"], recency, trace=trace, pos=4) == "b"
    # a key the trace never uses goes first; among equals, the least recently used
    assert choose_victim(["a", "x", "y"], {"x": 9, "y": 8}, trace=trace, pos=0) == "y"
    assert choose_victim([], recency, trace=trace, pos=0) is None


def test_lru_without_a_trace():
    recency = {"a": 5, "b": 2, "c": 7}
    assert choose_victim(["a", "b", "c"], recency) == "b"
    assert choose_victim(["a", "c"], recency) == "a"
    assert choose_victim(["a", "new"], recency) == "new"  # never touched counts as oldest


@pytest.mark.parametrize(
    "pos,limit,skip,expected",
    [
        (0, 0, (), []),
        (0, 10, (), ["a"]),
        (0, 29, (), ["a"]),  # b (20) would make 30
        (0, 30, (), ["a", "b"]),
        (0, 40, (), ["a", "b", "c"]),
        (0, 1000, (), ["a", "b", "c", "d"]),  # distinct keys, counted once
        (0, 24, ("b",), ["a", "c"]),  # an acquired key is passed over, not counted
        (3, 25, (), ["b", "d"]),
        (1, 15, (), []),  # b alone does not fit: nothing later is fetched before it
        (6, 100, (), []),
    ],
)
def test_window_respects_lookahead_bytes(pos, limit, skip, expected):
    trace = AccessTrace(["a", "b", "c", "b", "d", "a"])
    sizes = {"a": 10, "b": 20, "c": 10, "d": 5}
    assert lookahead_window(trace, pos, sizes, limit, skip=skip) == expected


@settings(max_examples=200, deadline=None)
@given(keys=st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=30), data=st.data())
def test_decisions_match_brute_force(keys, data):
    trace = AccessTrace(keys)
    sizes = {k: 1 + (ord(k) * 7) % 13 for k in "abcdefg"}
    pos = data.draw(st.integers(0, len(keys)))
    for k in "abcdefg":
        assert trace.next_use(k, pos) == _next_use_oracle(keys, k, pos)
    cands = data.draw(st.lists(st.sampled_from("abcdefg"), unique=True))
    recency = {k: i for i, k in enumerate(data.draw(st.permutations("abcdefg")))}
    victim = choose_victim(cands, recency, trace=trace, pos=pos)
    if cands:
        furthest = max(_next_use_oracle(keys, k, pos) for k in cands)
        tied = [k for k in cands if _next_use_oracle(keys, k, pos) == furthest]
        assert victim == min(tied, key=recency.get)
    limit = data.draw(st.integers(0, 60))
    window = lookahead_window(trace, pos, sizes, limit)
    upcoming = list(dict.fromkeys(keys[pos:]))
    assert window == upcoming[: len(window)] and sum(sizes[k] for k in window) <= limit
    if len(window) < len(upcoming):  # it stopped because the next key would not fit
        assert sum(sizes[k] for k in window) + sizes[upcoming[len(window)]] > limit


def test_stats_add_up():
    a, b = ScheduleStats(hits=2, evictions=1, stall_seconds=0.5), ScheduleStats(hits=1, misses=3)
    assert a + b == ScheduleStats(hits=3, misses=3, evictions=1, stall_seconds=0.5)


# -- on a real res -------------------------------------------------------------------------------
def _residency(nvme_dir, device_budget: int) -> KeyedResidency:
    return KeyedResidency(
        TransferEngine(
            {
                Tier.DEVICE: DeviceStore("cpu", device_budget),
                Tier.HOST: HostStore(64 << 20),
                Tier.NVME: NvmeStore(nvme_dir),
            }
        )
    )


def _close(res: KeyedResidency) -> None:
    res.engine.close()
    res.engine.stores[Tier.NVME].close()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class Model:
    """Tensors homed alternately on HOST and NVME, with the values they must hold (the oracle)."""

    SHAPES = [(97, 129), (1000,), (63, 65, 3), (4099,), (31, 517), (2049,), (129, 130), (777,)]
    DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32]

    def __init__(self, res: KeyedResidency, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.res, self.values, self.g = res, {}, g
        for i, shape in enumerate(self.SHAPES):
            key = f"blocks.{i}.weight"
            x = (torch.randn(shape, generator=g) * 100).to(self.DTYPES[i % len(self.DTYPES)])
            res.register(
                TensorInfo(key, TensorClass.PARAM, x.nbytes, tuple(x.shape), x.dtype),
                Tier.HOST if i % 2 == 0 else Tier.NVME,
            )
            res.put(key, x)
            self.values[key] = x

    @property
    def keys(self) -> list[str]:
        return list(self.values)

    def nbytes(self, key: str) -> int:
        return self.values[key].nbytes

    @classmethod
    def sizes(cls) -> dict[str, int]:
        return {
            f"blocks.{i}.weight": math.prod(shape) * cls.DTYPES[i % len(cls.DTYPES)].itemsize
            for i, shape in enumerate(cls.SHAPES)
        }

    def check_home(self) -> None:
        for key, x in self.values.items():
            out = torch.empty_like(x)
            self.res.fetch(key, out).wait()
            assert torch.equal(_bits(out), _bits(x)), key


def _run(
    sched: ResidencyScheduler, model: Model, pattern, *, iterations: int, dirty_every: int = 0, compute_s: float = 0.0
) -> None:
    """Acquire each key of ``pattern`` in turn, check its bits, optionally update it in place."""
    n = 0
    for _ in range(iterations):
        for key in pattern:
            t = sched.acquire(key)
            assert torch.equal(_bits(t), _bits(model.values[key])), key
            n += 1
            if dirty_every and n % dirty_every == 0:
                t.copy_((torch.randn(t.shape, generator=model.g) * 10).to(t.dtype))
                sched.mark_dirty(key)
                model.values[key] = t.clone()
            if compute_s:
                time.sleep(compute_s)
            sched.release(key)
            ledger = sched.residency.engine.stores[Tier.DEVICE].ledger
            assert ledger.used <= ledger.allowed
        sched.end_iteration()


@pytest.fixture
def nvme_dir(tmp_path):
    return str(tmp_path)


def _budget(fraction: float) -> int:
    """``fraction`` of the model's bytes, but at least its largest tensor."""
    sizes = Model.sizes()
    return max(int(sum(sizes.values()) * fraction), max(sizes.values()))


def test_forward_backward_is_bit_exact_within_budget_and_prefetch_removes_misses(nvme_dir):
    budget = _budget(0.5)
    res = _residency(nvme_dir, budget)
    try:
        model = Model(res)
        sched = ResidencyScheduler().connect(res)
        pattern = model.keys + model.keys[::-1]
        _run(sched, model, pattern, iterations=4, dirty_every=3, compute_s=0.002)
        first, later = sched.history[0], sched.history[1:]
        # the first iteration: forward fetches on demand; backward repeats it reversed, fetched ahead
        # (NOTE [Fetch ahead before a trace]): the forward's misses only
        assert first.misses == len(model.keys) and first.prefetches > 0
        assert all(s.misses == 0 and s.prefetches > 0 for s in later)
        # (stall seconds are timing: bench/prefetch.py measures them; counts are what a test can hold)
        assert all(s.writebacks > 0 for s in sched.history)
        assert all(s.acquires == s.hits + s.late + s.misses == len(pattern) for s in sched.history)
        ledger = res.engine.stores[Tier.DEVICE].ledger
        assert ledger.peak <= budget and ledger.peak > budget // 2
        sched.evict_all()
        assert ledger.used == 0
        model.check_home()  # every dirty update reached its home tier
    finally:
        _close(res)


def test_without_prefetch_the_first_backward_misses_what_it_fetches_ahead_with_it(nvme_dir):
    """The oracle of the count above: the same first iteration fetching on demand only."""
    res = _residency(nvme_dir, _budget(0.5))
    try:
        model = Model(res)
        sched = ResidencyScheduler(prefetch=False).connect(res)
        _run(sched, model, model.keys + model.keys[::-1], iterations=1)
        assert sched.history[0].misses > len(model.keys)
    finally:
        _close(res)


# -- NOTE [Fetch ahead before a trace] ---------------------------------------------------------------
def _guessed(accesses: list[str], sizes: dict[str, int], limit: int = 1000) -> list[list[str]]:
    """What :class:`RepeatGuess` would fetch after each access."""
    guess, out = RepeatGuess(), []
    for pos in range(len(accesses)):
        guess.record(accesses, pos)
        out.append(guess.ahead(accesses, sizes, limit))
    return out


def test_a_first_backward_is_guessed_as_the_forward_reversed():
    forward = ["emb", "q", "k", "v", "head"]
    sizes = dict.fromkeys(forward, 10)
    ahead = _guessed([*forward, "head", "v", "k", "q"], sizes)
    assert ahead[:6] == [[]] * 6  # nothing repeats yet; one access is not a run
    assert ahead[6:] == [["k", "q", "emb"], ["q", "emb"], ["emb"]]
    assert _guessed([*forward, "head", "v", "k"], sizes, limit=15)[-1] == ["q"]  # the window's bytes
    assert _guessed([*forward, "head", "v", "emb"], sizes)[-1] == []  # an access off the run ends it


def test_before_any_repeat_the_registered_order_is_the_guess():
    order = ["q", "k", "norm", "q2"]
    sizes = dict.fromkeys(order, 10)
    guess = RepeatGuess(order)
    assert guess.ahead([], sizes, 100) == []  # nothing used yet
    assert _guessed_with(order, ["norm", "q"], sizes) == [["q2"], ["k", "norm", "q2"]]
    assert _guessed_with(order, ["q", "k", "k"], sizes)[-1] == []  # a key used twice: no more
    assert _guessed_with(order, ["x"], sizes) == [[]]  # a key the order does not know


def _guessed_with(order: list[str], accesses: list[str], sizes: dict[str, int]) -> list[list[str]]:
    guess, out = RepeatGuess(order), []
    for pos in range(len(accesses)):
        guess.record(accesses, pos)
        out.append(guess.ahead(accesses, sizes, 1000))
    return out


def test_the_expected_order_fetches_the_first_forward_ahead(nvme_dir):
    res = _residency(nvme_dir, _budget(0.5))
    try:
        model = Model(res)
        sched = ResidencyScheduler().connect(res)
        sched.expect(model.keys)
        _run(sched, model, model.keys + model.keys[::-1], iterations=1)
        assert sched.history[0].misses == 1  # the first key; without the order, every forward key (above)
    finally:
        _close(res)


def test_a_second_pass_is_guessed_as_the_first():
    forward = ["emb", "q", "k", "head"]
    backward = ["head", "k", "q"]
    ahead = _guessed([*forward, *backward, "head", "k"], dict.fromkeys(forward, 10))
    assert ahead[-1] == ["q"]  # the first backward's order, not the forward's reversed
    ahead = _guessed(["a", "b", "c", "d", "a", "b"], dict.fromkeys("abcd", 10))
    assert ahead[-1] == ["c", "d"]  # a second micro-batch's forward repeats the first's


def test_updates_written_home_between_iterations_are_read_again(nvme_dir):
    res = _residency(nvme_dir, _budget(0.5))
    try:
        model = Model(res)
        sched = ResidencyScheduler().connect(res)
        for _ in range(3):
            _run(sched, model, model.keys + model.keys[::-1], iterations=1)
            for key in model.keys[::3]:  # an optimizer step writes new values to the home tier
                new = model.values[key] + 1 if model.values[key].is_floating_point() else model.values[key] - 7
                res.put(key, new)
                model.values[key] = new
        assert sched.history[-1].misses > 0  # what the step rewrote had to come again
    finally:
        _close(res)


@pytest.mark.parametrize(
    "name,pattern",
    [
        ("forward+backward", lambda k: k + k[::-1]),
        ("two forwards", lambda k: k + k),
        ("tied embedding", lambda k: ["blocks.0.weight"] + k[1:] + ["blocks.0.weight"] * 2 + k[1:][::-1]),
    ],
)
@pytest.mark.parametrize("prefetch", [True, False])
def test_belady_evicts_no_more_than_lru(tmp_path, name, pattern, prefetch):
    evicted = {}
    for eviction in ("belady", "lru"):
        (tmp_path / eviction).mkdir()
        res = _residency(str(tmp_path / eviction), _budget(0.6))
        try:
            model = Model(res)
            sched = ResidencyScheduler(prefetch=prefetch, eviction=eviction).connect(res)
            _run(sched, model, pattern(model.keys), iterations=4)
            steady = sched.history[1:]  # the first iteration has no trace: LRU in both
            evicted[eviction] = (sum(s.evictions for s in steady), sum(s.bytes_evicted for s in steady))
        finally:
            _close(res)
    assert evicted["belady"][0] <= evicted["lru"][0] and evicted["belady"][1] <= evicted["lru"][1]
    if name == "two forwards":  # a repeated scan is LRU's worst case: it evicts on every access
        assert evicted["belady"][0] < evicted["lru"][0] == 2 * len(Model.SHAPES) * 3


def test_prefetch_off_fetches_on_demand(nvme_dir):
    res = _residency(nvme_dir, _budget(0.5))
    try:
        model = Model(res)
        sched = ResidencyScheduler(prefetch=False).connect(res)
        _run(sched, model, model.keys + model.keys[::-1], iterations=3)
        assert sched.stats.prefetches == 0 and all(s.misses > 0 for s in sched.history)
    finally:
        _close(res)


def test_a_changed_access_order_is_re_recorded(nvme_dir, caplog):
    res = _residency(nvme_dir, _budget(0.5))
    try:
        model = Model(res)
        sched = ResidencyScheduler().connect(res)
        _run(sched, model, model.keys, iterations=2)
        assert sched.trace.keys == tuple(model.keys) and sched.history[1].misses == 0
        with caplog.at_level(logging.DEBUG, logger="tiermem.transfer.schedule"):
            _run(sched, model, model.keys[::-1], iterations=1)
        assert "re-recorded the trace" in caplog.text and "the trace expected" in caplog.text
        assert sched.trace.keys == tuple(model.keys[::-1])
        _run(sched, model, model.keys[::-1], iterations=1)
        assert sched.history[-1].misses == 0
    finally:
        _close(res)


def test_working_set_larger_than_the_budget_is_a_clear_error(nvme_dir):
    sizes = Model.sizes()
    big, a, b, c = "blocks.0.weight", "blocks.1.weight", "blocks.3.weight", "blocks.2.weight"
    budget = sizes[a] + sizes[b] + sizes[c] - 1  # a, b and c cannot be held at once
    assert sizes[big] > budget
    res = _residency(nvme_dir, budget)
    try:
        model = Model(res)
        sched = ResidencyScheduler().connect(res)
        with pytest.raises(
            OutOfTierMemory,
            match=(
                rf"working set \(1 tensor: 'blocks.0.weight'\) needs {fmt_bytes(sizes[big])} on device, "
                rf"budget {fmt_bytes(budget)}; raise Budgets\(device=...\) to at least "
                rf"{fmt_bytes(sizes[big])}$"
            ),
        ):
            sched.acquire(big)
        sched.acquire(a)
        sched.acquire(b)
        sched.acquire(a)  # nested: still one copy
        need = fmt_bytes(budget + 1)
        with pytest.raises(
            OutOfTierMemory,
            match=(
                rf"\(3 tensors acquired at once: '{c}', '{a}', '{b}'\) needs {need} on device, "
                rf"budget {fmt_bytes(budget)}; raise Budgets\(device=...\) to at least {need}$"
            ),
        ):
            sched.acquire(c)
        for key in (a, a, b):
            sched.release(key)
        t = sched.acquire(c)  # fits once the others are released
        assert torch.equal(t, model.values[c])
        assert res.engine.stores[Tier.DEVICE].ledger.peak <= budget
    finally:
        _close(res)


def test_a_tensor_brought_to_the_device_by_others_is_evictable_once_acquired(nvme_dir):
    sizes = Model.sizes()
    a, b = "blocks.2.weight", "blocks.6.weight"
    res = _residency(nvme_dir, max(sizes[a], sizes[b]) + 100)  # one at a time
    try:
        model = Model(res)
        res.prefetch(a, Tier.DEVICE).wait()  # e.g. the caller's own prefetch
        sched = ResidencyScheduler().connect(res)
        assert torch.equal(sched.acquire(a), model.values[a]) and sched.stats.hits == 1
        sched.release(a)
        assert torch.equal(sched.acquire(b), model.values[b])  # room made by evicting a
        assert sched.stats.evictions == 1 and a not in res.engine.stores[Tier.DEVICE]
    finally:
        _close(res)


def test_bad_calls_are_clear_errors(nvme_dir):
    res = _residency(nvme_dir, 1 << 20)
    try:
        Model(res)
        x = torch.ones(4)
        res.register(TensorInfo("on_device", TensorClass.PARAM, 16, (4,), x.dtype), Tier.DEVICE)
        res.put("on_device", x)
        sched = ResidencyScheduler().connect(res)
        no_host = KeyedResidency(TransferEngine({Tier.DEVICE: DeviceStore("cpu", 1 << 20)}))
        ResidencyScheduler().make_room(1 << 20)  # not connected: it holds nothing, so it frees nothing
        cases = [
            (lambda: sched.release("blocks.1.weight"), TierMemError, r"release\('blocks.1.weight'\) without"),
            (lambda: sched.mark_dirty("blocks.1.weight"), TierMemError, "not acquired; acquire it"),
            (lambda: sched.acquire("on_device"), TierMemError, "homed on the device tier"),
            (lambda: sched.acquire("ghost"), TierMemError, "'ghost' is not registered"),
            (lambda: ResidencyScheduler(Tier.NVME).connect(res), ConfigError, "must be a memory tier"),
            (lambda: ResidencyScheduler(eviction="fifo").connect(res), ConfigError, "'fifo' is not one of"),
            (
                lambda: ResidencyScheduler(lookahead_bytes="lots").connect(res),
                ConfigError,
                "lookahead_bytes='lots' does not parse",
            ),
            (lambda: sched.connect(res), TierMemError, r"connect\(\) was called twice"),
            (lambda: ResidencyScheduler().acquire("blocks.1.weight"), TierMemError, "not connected to a residency"),
            (
                lambda: ResidencyScheduler(Tier.HOST).connect(no_host),
                ConfigError,
                "must be a memory tier the engine has a store for",
            ),
        ]
        for call, error, match in cases:
            with pytest.raises(error, match=match) as info:
                call()
            assert str(info.value).startswith("tiermem:")
        no_host.engine.close()
        t = sched.acquire("blocks.1.weight")  # the failed calls left nothing half-done
        sched.release("blocks.1.weight")
        assert sched.stats.acquires == 1 and t.shape == (1000,)
    finally:
        _close(res)


# -- invariants over random access sequences -----------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    budget_fraction=st.floats(0.05, 1.0),
    prefetch=st.booleans(),
    eviction=st.sampled_from(["belady", "lru"]),
    iterations=st.integers(1, 3),
)
def test_random_sequences_keep_budget_and_bits(data, budget_fraction, prefetch, eviction, iterations):
    tmp = tempfile.mkdtemp(prefix="tiermem-sched-")
    res = None
    try:
        sizes = Model.sizes()
        budget = max(int(sum(sizes.values()) * budget_fraction), 1)
        res = _residency(tmp, budget)
        model = Model(res, seed=data.draw(st.integers(0, 9)))
        sched = ResidencyScheduler(
            prefetch=prefetch, eviction=eviction, lookahead_bytes=data.draw(st.none() | st.integers(0, budget))
        ).connect(res)
        groups = data.draw(
            st.lists(
                st.lists(st.sampled_from(model.keys), min_size=1, max_size=3, unique=True), min_size=1, max_size=12
            )
        )
        dirty = data.draw(st.lists(st.booleans(), min_size=len(groups), max_size=len(groups)))
        ledger = res.engine.stores[Tier.DEVICE].ledger
        for it in range(iterations):
            for group, modify in zip(groups, dirty):
                held = []
                for key in group:
                    need = sum(sizes[k] for k in held) + sizes[key]
                    if need > budget:  # the oracle: only a working set over budget may fail
                        with pytest.raises(OutOfTierMemory, match="raise Budgets"):
                            sched.acquire(key)
                        break
                    t = sched.acquire(key)
                    held.append(key)
                    assert torch.equal(_bits(t), _bits(model.values[key])), key
                    if modify and (it + len(held)) % 2:
                        t.view(torch.uint8).reshape(-1)[::7].add_(1)
                        sched.mark_dirty(key)
                        model.values[key] = t.clone()
                    assert ledger.used <= budget
                for key in held:
                    sched.release(key)
            sched.end_iteration()
        res.synchronize()
        assert ledger.peak <= budget
        sched.evict_all()
        model.check_home()
    finally:
        if res is not None:
            _close(res)
        shutil.rmtree(tmp, ignore_errors=True)
