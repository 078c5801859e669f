"""NOTE [Fetch-ahead in O(window)] changes how much the scheduler looks at, never what it does: on
randomized traces with a small device budget (nested acquires, modified weights, iterations that
leave the trace or change it, new values written home mid-iteration, other users of the device
taking room), the sequence of fetches and evictions equals the one of the algorithm it replaced,
kept here as a slow reference that walks every key on every acquire."""

from __future__ import annotations

import random

import pytest
import torch

from tiermem import TensorClass, TensorInfo, Tier
from tiermem.memory.resident import DeviceStore, HostStore
from tiermem.transfer.decisions import AbsentAhead, AccessTrace, choose_victim, lookahead_window
from tiermem.transfer.engine import TransferEngine
from tiermem.transfer.fetch_evict import FetchEvict
from tiermem.transfer.residency import KeyedResidency
from tiermem.transfer.schedule import ResidencyScheduler

KiB = 1024


class _ReferenceMoves(FetchEvict):
    """The fetch-ahead as it was before: the managed set filtered, the window and the candidates
    outside it computed, and the held bytes summed, on every acquire; victims chosen by scanning
    the candidates."""

    def __init__(self, tier, **options):
        super().__init__(tier, **options)
        self._belady = options["belady"]
        self._ref_managed: set[str] = set()

    def _manage(self, key: str) -> None:
        super()._manage(key)
        self._ref_managed.add(key)

    def _evict(self, key: str) -> None:
        super()._evict(key)
        self._ref_managed.discard(key)

    def _evictable(self) -> list[str]:
        registry, store = self.residency.registry, self.store
        self._ref_managed = {k for k in self._ref_managed if k in registry and k in store}
        return [k for k in self._ref_managed if k not in self._pins]

    def _make_room(self, key, nbytes, *, excluded=None, candidates=None, required):
        ledger, asked_others = self.store.ledger, False
        listed = self._evictable() if candidates is None else candidates()
        while ledger.allowed - ledger.used < nbytes:
            follow = self._owner._follow  # the scheduler's, as the reference read it
            trace = follow.following() if self._belady else None
            victim = choose_victim(listed, self._last_used, trace=trace, pos=follow.pos)
            if (
                victim is None
                and required
                and not asked_others
                and any(r is not self._owner for r in ledger.reclaimers)
            ):
                asked_others = True
                self._ask_others(nbytes - (ledger.allowed - ledger.used))
                continue
            if victim is None:
                if required:
                    raise self._too_small(key, nbytes)
                return False
            listed.remove(victim)
            self._evict(victim)
        return True

    def _limit(self) -> int:
        ledger = self.store.ledger
        room = ledger.allowed - (ledger.used - ledger.held_total(self._ref_managed)) - ledger.held_total(self._pins)
        return room if self.lookahead_bytes is None else min(room, self.lookahead_bytes)

    def fetch_ahead(self, trace, pos) -> None:
        if not self.prefetch or trace is None:
            return
        outside_all = self._evictable()
        self._ref_bring(lookahead_window(trace, pos, self._sizes, self._limit(), skip=self._pins), outside_all, pos)

    def fetch_guessed(self, guess, recording, pos) -> None:  # NOTE [Fetch ahead before a trace], the same way
        if not self.prefetch or not guess.guessing:
            return
        outside_all = self._evictable()
        self._ref_bring(guess.ahead(recording, self._sizes, self._limit(), skip=self._pins), outside_all, pos)

    def _ref_bring(self, window, outside_all, pos) -> None:
        registry = self.residency.registry
        outside = [k for k in outside_all if k not in set(window)]
        for key in window:
            if key not in registry:
                continue
            r = registry.get(key)
            if self.tier in r.valid or (r.in_flight is not None and r.in_flight[1] == self.tier):
                continue
            if not self._make_room(key, self._new_bytes(key), candidates=lambda: outside, required=False):
                return
            self.residency.prefetch(key, self.tier)
            self._manage(key)
            self.touch(key, pos)
            self.stats.prefetches += 1
            self.stats.bytes_prefetched += self._sizes[key]


class _Reference(ResidencyScheduler):
    """The scheduler with the moves of before."""

    _moves_type = _ReferenceMoves


def _ops(seed: int, n: int) -> list[tuple]:
    """A training-like run: per iteration a forward and a backward pass over ``n`` weights, with
    random nesting, modifications, detours, home writes and foreign reservations."""
    rng = random.Random(seed)
    order = [f"w{i}" for i in range(n)]
    ops: list[tuple] = []
    for it in range(7):
        if it == 4 and rng.random() < 0.5:
            rng.shuffle(order)  # the order changes for good: re-recorded
        passes = order + order[::-1]
        if rng.random() < 0.3:
            i, j = rng.randrange(len(passes)), rng.randrange(len(passes))
            passes[i], passes[j] = passes[j], passes[i]  # one iteration off the trace
        held: list[str] = []
        for key in passes:
            ops.append(("acquire", key))
            if rng.random() < 0.2:
                ops.append(("dirty", key))
            held.append(key)
            while len(held) > rng.choice((1, 1, 2)):
                ops.append(("release", held.pop(0)))
            if rng.random() < 0.05:
                ops.append(("home", rng.choice(order)))  # a new value written home (step in backward)
            if rng.random() < 0.05:
                ops.append(("foreign", rng.choice((2, 4)) * KiB))  # an activation takes room, and goes
        ops += [("release", k) for k in held]
        ops += [("home", k) for k in order if rng.random() < 0.5]  # the optimizer step
        ops.append(("end",))
    return ops


def _run(cls, ops, sizes: dict[str, int], budget: int, **options) -> list[tuple[str, str]]:
    sched = cls(**options)
    engine = TransferEngine({Tier.DEVICE: DeviceStore("cpu", budget, reclaimers=(sched,)), Tier.HOST: HostStore()})
    res = KeyedResidency(engine)
    log: list[tuple[str, str]] = []
    prefetch, evict = res.prefetch, res.evict

    def logged_prefetch(key, dst=Tier.DEVICE):
        r = res.registry.get(key)
        if dst not in r.valid and r.in_flight is None:  # a new move, not joining one (timing decides that)
            log.append(("fetch", key))
        return prefetch(key, dst)

    def logged_evict(key, tier=Tier.DEVICE):
        log.append(("evict", key))
        return evict(key, tier)

    res.prefetch, res.evict = logged_prefetch, logged_evict
    try:
        for key, nbytes in sizes.items():
            res.register(TensorInfo(key, TensorClass.PARAM, nbytes, (nbytes // 4,), torch.float32), Tier.HOST)
            res.put(key, torch.zeros(nbytes // 4))
        sched.connect(res)
        ledger = engine.stores[Tier.DEVICE].ledger
        for op in ops:
            if op[0] == "acquire":
                sched.acquire(op[1])
            elif op[0] == "release":
                sched.release(op[1])
            elif op[0] == "dirty":
                sched.mark_dirty(op[1])
            elif op[0] == "home" and not sched._pins.get(op[1]):
                res.put(op[1], torch.ones(sizes[op[1]] // 4))
            elif op[0] == "foreign":
                ledger.reserve("activation", op[1])  # may ask the scheduler to make room
                ledger.release("activation")
            elif op[0] == "end":
                sched.end_iteration()
                res.synchronize()
            log.append(("stats", str((sched.current.evictions, sched.current.prefetches))))
        assert ledger.peak <= ledger.allowed
    finally:
        engine.close()
    return log


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("options", [{}, {"lookahead_bytes": 10 * KiB}, {"eviction": "lru"}])
def test_fetches_and_evictions_equal_the_reference(seed, options):
    rng = random.Random(1000 + seed)
    n = rng.choice((6, 12, 24))
    sizes = {f"w{i}": rng.choice((1, 2, 4)) * KiB for i in range(n)}
    budget = 4 * 4 * KiB + rng.choice((0, 4, 12, 40)) * KiB  # three acquired and an activation fit
    ops = _ops(seed, n)
    got = _run(ResidencyScheduler, ops, sizes, budget, **options)
    want = _run(_Reference, ops, sizes, budget, **options)
    assert [e for e in got if e[0] != "stats"], "the run moved nothing: the comparison would be empty"
    assert got == want


def test_absent_ahead_answers_for_the_furthest_last_use():
    trace = AccessTrace(["a", "b", "c", "b", "d"])
    absent = AbsentAhead(trace, ["a", "c", "zz"])  # zz: never used, left out
    assert "zz" not in absent and absent.any_from(2) and not absent.any_from(3)
    absent.add("b")  # last used at 3
    assert absent.any_from(3) and not absent.any_from(4)
    absent.discard("b")
    absent.discard("c")
    assert absent.any_from(0) and not absent.any_from(1)
    absent.add("d")
    assert absent.any_from(4) and "d" in absent
