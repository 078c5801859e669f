from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from tiermem import Budgets, ConfigError, OutOfTierMemory, Tier, TierMemError
from tiermem.config.budgets import parse_bytes
from tiermem.memory.ledger import Ledger


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0", 0),
        ("1024", 1024),
        (" 8GiB ", 8 * 2**30),
        ("500MB", 500_000_000),
        ("1.5 KiB", 1536),
        ("2gb", 2 * 10**9),
        ("3T", 3 * 10**12),
        ("1e3", 1000),
        (4096, 4096),
        ("7.5e9", 7_500_000_000),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "bad, match",
    [
        ("8 gigs", "does not parse as a size"),
        ("", "does not parse"),
        ("GiB", "does not parse"),
        (-1, "negative"),
        (True, "is not a size"),
        ([1], "is not a size"),
        ("1.5.2GB", "does not parse"),
    ],
)
def test_parse_bytes_rejects(bad, match):
    with pytest.raises(ConfigError, match=match) as e:
        parse_bytes(bad)
    assert str(e.value).startswith("tiermem:")


def test_budgets_parse_fields_and_name_them():
    b = Budgets(device="1GiB", host=2048)
    assert (b.device, b.host, b.nvme) == (2**30, 2048, None)
    assert b.for_tier(Tier.DEVICE) == 2**30
    with pytest.raises(ConfigError, match=r"Budgets\.host='lots'"):
        Budgets(host="lots")


def test_ledger_refuses_past_budget_with_figures():
    led = Ledger(Tier.HOST, 1000)
    led.reserve("a", 600)
    with pytest.raises(OutOfTierMemory) as e:
        led.reserve("b", 500)
    msg = str(e.value)
    assert isinstance(e.value, TierMemError)
    assert "'b'" in msg and "asked 500 B" in msg and "600 B in use" in msg and "1000 B allowed" in msg
    assert "Budgets(host=...)" in msg
    assert led.used == 600 and led.held("b") == 0  # a refused reservation changes nothing
    led.reserve("a", 900)  # re-reserving a key replaces what it held
    assert led.used == 900 and led.peak == 900
    assert led.release("a") == 900 and led.used == 0


@given(st.lists(st.tuples(st.sampled_from("abcde"), st.integers(0, 400), st.booleans()), max_size=60))
def test_ledger_never_exceeds_budget(ops):
    led = Ledger(Tier.DEVICE, 1000)
    model: dict[str, int] = {}
    for key, n, release in ops:
        if release:
            assert led.release(key) == model.pop(key, 0)
        else:
            try:
                led.reserve(key, n)
                model[key] = n
            except OutOfTierMemory:
                assert sum(model.values()) - model.get(key, 0) + n > 1000
        assert led.used == sum(model.values()) <= 1000
        assert led.peak <= 1000
        some = {key, "abcde"[n % 5], "never-reserved"}
        assert led.held_total(some) == sum(model.get(k, 0) for k in some) == sum(led.held(k) for k in some)


def test_requests_in_flight_give_their_room_back_when_the_ledger_is_short():
    """InFlight is given to the ledger at construction, as a reclaimer: a reservation that does
    not fit waits for the requests in flight, whose room their release gives back, then fits."""
    import threading
    from concurrent.futures import Future

    from tiermem.handles import Handle
    from tiermem.memory.ledger import InFlight

    in_flight = InFlight()
    led = Ledger(Tier.DEVICE, 1000, reclaimers=(in_flight,))
    led.reserve("<copy in flight>", 800)
    future: Future = Future()
    in_flight.add(Handle(future), lambda: led.release("<copy in flight>"))
    threading.Timer(0.05, future.set_result, (None,)).start()  # the copy lands a moment later
    led.reserve("activation", 500)  # waits for it instead of refusing
    assert led.used == 500 and led.held("<copy in flight>") == 0
    assert [h.done() for h, _ in in_flight.take()] == [True]  # its owner still sees it, to report a failure


def test_a_reclaimer_on_tiermems_own_threads_does_not_wait():
    """On a lane the request may be queued behind the caller: waiting would deadlock, so it refuses."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from tiermem.handles import Handle
    from tiermem.memory.ledger import InFlight

    in_flight = InFlight()
    led = Ledger(Tier.DEVICE, 1000, reclaimers=(in_flight,))
    led.reserve("<copy in flight>", 800)
    in_flight.add(Handle(Future()), lambda: led.release("<copy in flight>"))  # never lands
    with ThreadPoolExecutor(1, thread_name_prefix="tiermem-d2h") as lane:
        with pytest.raises(OutOfTierMemory):
            lane.submit(led.reserve, "activation", 500).result(timeout=10)


def test_the_reclaimers_given_at_construction_are_asked_in_order_until_the_reservation_fits():
    """NOTE [Reclaimers at construction]: each reclaimer is asked for what is missing, in the order
    given; one that asks the others itself is skipped (``besides``); with none, a refusal."""
    asked: list[tuple[str, int]] = []
    led: Ledger

    class Frees:
        def __init__(self, name: str, key: str):
            self.name, self.key = name, key

        def make_room(self, missing: int) -> None:
            asked.append((self.name, missing))
            led.release(self.key)

    first, second = Frees("first", "a"), Frees("second", "b")
    led = Ledger(Tier.DEVICE, 1000, reclaimers=(first, second))
    led.reserve("a", 300)
    led.reserve("b", 600)
    led.reserve("c", 500)  # 400 missing: both are asked (the ledger retries once, after all of them)
    assert asked == [("first", 400), ("second", 400)] and led.used == 500
    asked.clear()
    led.reserve("a", 300)
    led.reclaim(100, besides=first)
    assert asked == [("second", 100)] and led.held("a") == 300
    with pytest.raises(OutOfTierMemory):
        Ledger(Tier.DEVICE, 10).reserve("x", 11)
