"""tiermem.transfer.gather_schedule: which sharded buckets are gathered, kept or freed, decided from
the accesses alone (NOTE [A gather schedule every rank takes alike]); and the announced gathers of
tiermem.train.weights.weight_shards, with a stand-in group."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from tiermem import TierMemError
from tiermem.plan.buckets import Bucket
from tiermem.train.weights.weight_shards import END, GATHER, Gatherer
from tiermem.transfer.collectives import Group, Pending
from tiermem.transfer.gather_schedule import GatherSchedule

SIZES = {"a": 10, "b": 10, "c": 10, "d": 10, "e": 5}


def _run(s: GatherSchedule, keys) -> list[tuple[list[str], list[str]]]:
    """Each key acquired then released (as one op reads one bucket); what each acquire decided."""
    out = []
    for k in keys:
        out.append(s.acquire(k))
        s.release(k)
    return out


def test_without_a_trace_buckets_are_gathered_on_demand_and_cached_within_ahead():
    s = GatherSchedule(SIZES, ahead=20)
    assert s.acquire("a") == (["a"], [])
    assert s.release("a") == []  # kept: 10 B of 20
    assert s.acquire("b") == (["b"], [])
    assert s.release("b") == []
    assert s.acquire("a") == ([], [])  # still gathered: no collective
    assert s.release("a") == []
    assert s.acquire("c") == (["c"], [])
    assert s.release("c") == ["b"]  # the least recently released goes past 20 B
    assert list(s.gathered) == ["a", "c"]


def test_with_a_trace_the_window_is_gathered_ahead_and_the_rest_freed():
    s = GatherSchedule(SIZES, ahead=20)
    _run(s, "abcd")
    assert s.end_iteration() == (["a", "b"], ["c", "d"])  # the next iteration's first 20 B; the rest goes
    assert s.acquire("a") == (["c"], [])  # the window is now b, c: c gathered ahead
    assert s.release("a") == ["a"]  # not used again within the window
    assert s.acquire("b") == (["d"], [])
    assert s.release("b") == ["b"]
    assert _run(s, "cd") == [([], []), ([], [])]  # all gathered ahead: no gather at use
    assert s.end_iteration() == (["a", "b"], [])


def test_a_bucket_used_again_within_the_window_is_kept():
    s = GatherSchedule(SIZES, ahead=20)
    _run(s, "abac")
    s.end_iteration()
    assert s.acquire("a") == ([], [])
    assert s.release("a") == []  # used again two accesses on
    s.acquire("b")
    assert s.release("b") == ["b"]


def test_leaving_the_trace_stops_gathering_ahead():
    s = GatherSchedule(SIZES, ahead=20)
    _run(s, "abcd")
    s.end_iteration()
    assert s.acquire("d") == (["d"], [])  # not what the trace expected: on demand, nothing ahead
    assert not s.on_trace
    assert s.release("d") == ["a"]  # a cache of 20 B again, the least recently released out first
    assert s.acquire("c") == (["c"], [])
    assert s.release("c") == ["b"]
    assert s.end_iteration() == ([], [])  # the new order is the trace, and its window is gathered


def test_ranks_that_disagree_drop_the_trace():
    s = GatherSchedule(SIZES, ahead=20)
    _run(s, "ab")
    s.end_iteration()
    _run(s, "ab")
    assert s.end_iteration(agreed=False) == ([], [])
    assert s.trace is None
    assert s.acquire("a") == (["a"], [])  # on demand, as in the first iteration
    s.release("a")
    assert s.acquire("b") == (["b"], [])


def test_free_all_keeps_held_buckets():
    s = GatherSchedule(SIZES, ahead=100)
    s.acquire("a")
    _run(s, "bc")
    assert s.free_all() == ["b", "c"]
    assert s.release("a") == []  # held through the update, then cached


def test_prefetch_off_gathers_nothing_ahead():
    s = GatherSchedule(SIZES, ahead=20, prefetch=False)
    _run(s, "abcd")
    assert s.end_iteration() == ([], [])
    assert s.acquire("a") == (["a"], ["d"])  # kept only within the window, gathered only on demand


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.sampled_from(sorted(SIZES)), min_size=1, max_size=12), min_size=1, max_size=4),
    st.integers(5, 40),
)
def test_gathered_bytes_stay_within_held_plus_ahead(iterations, ahead):
    """Whatever the accesses: everything acquired is gathered, nothing is gathered twice, and the
    buckets no one holds take at most ``ahead`` bytes (a deterministic function of the accesses)."""
    s = GatherSchedule(SIZES, ahead=ahead)
    gathered: set[str] = set()

    def apply(gather, free):
        assert not set(gather) & gathered and set(free) <= gathered
        gathered.difference_update(free)
        gathered.update(gather)

    for keys in iterations:
        for k in keys:
            apply(*s.acquire(k))
            assert k in gathered
            apply([], s.release(k))
            assert sum(SIZES[g] for g in gathered if not s.held[g]) <= max(ahead, 0)
        apply(*s.end_iteration())
        assert gathered == set(s.gathered)


class _Told(Group):
    """A stand-in group whose ranks announced ``headers``."""

    def __init__(self, rank: int, headers: list[list[int]]):
        self.rank, self.world, self.headers = rank, len(headers), headers

    def exchange_async(self, header):
        assert list(header) == self.headers[self.rank]
        return Pending(None, lambda: self.headers)


def test_an_announced_gather_that_ranks_disagree_on_names_both_buckets():
    b = Bucket(3, None, None, 0, numel=8)
    names = {3: ["blocks.0.fc.weight", "blocks.0.fc.bias"], 5: ["extra.weight"]}
    g = Gatherer(None, _Told(0, [[GATHER, 3, 8, 17], [GATHER, 5, 8, 18]]), names)  # no data may move
    with pytest.raises(
        TierMemError,
        match=r"^tiermem: rank 0 of 2: the ranks are out of step on their sharded "
        r"weights: rank 0 gathers bucket 3 \(blocks.0.fc.weight, blocks.0.fc.bias\) "
        r"for access 17; rank 1 gathers bucket 5 \(extra.weight\) for access 18",
    ):
        g.launch(g.announce(b, 17), None, None)
    g = Gatherer(None, _Told(1, [[END, 7, 4, 4], [GATHER, 5, 8, 5]]), names)
    with pytest.raises(TierMemError, match=r"rank 0 ended the iteration after 4 accesses; rank 1 gathers bucket 5"):
        g.launch(g.announce(Bucket(5, None, None, 0, numel=8), 5), None, None)


def test_ranks_that_end_alike_agree_or_not_on_their_accesses():
    same = Gatherer(None, _Echo(), {})
    assert same.end(["bucket1", "bucket2"])
    differ = Gatherer(None, _Echo(other=[END, 1, 2, 2]), {})
    assert not differ.end(["bucket1", "bucket2"])


class _Echo(Group):
    """Rank 0 of two; rank 1 announces the same header, or ``other``."""

    def __init__(self, other=None):
        self.rank, self.world, self.other = 0, 2, other

    def exchange_async(self, header):
        return Pending(None, lambda: [list(header), list(self.other or header)])
