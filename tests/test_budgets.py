from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from tiermem import Budgets, ConfigError, OutOfTierMemory, TierMemError, Tier
from tiermem.budgets import parse_bytes
from tiermem.memory.ledger import Ledger


@pytest.mark.parametrize("text, expected", [
    ("0", 0), ("1024", 1024), (" 8GiB ", 8 * 2**30), ("500MB", 500_000_000), ("1.5 KiB", 1536),
    ("2gb", 2 * 10**9), ("3T", 3 * 10**12), ("1e3", 1000), (4096, 4096), ("7.5e9", 7_500_000_000),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad, match", [
    ("8 gigs", "does not parse as a size"), ("", "does not parse"), ("GiB", "does not parse"),
    (-1, "negative"), (True, "is not a size"), ([1], "is not a size"), ("1.5.2GB", "does not parse"),
])
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
