"""The errors a user can cause. Every message starts with ``tiermem:`` and ends with what to change."""
from __future__ import annotations

from typing import Optional


class TierMemError(Exception):
    """Base class of every error tiermem raises for something a user can cause or fix."""

    def __init__(self, message: str):
        if not message.startswith("tiermem:"):
            message = "tiermem: " + message
        super().__init__(message)


class ConfigError(TierMemError, ValueError):
    """A configuration value is invalid: names the class, the field, the value and the rule."""


class StoreError(TierMemError, OSError):
    """A store could not read or write (I/O error, disk full, corrupt or missing data)."""


class OutOfTierMemory(TierMemError, MemoryError):
    """An allocation would take a tier past its budget."""

    def __init__(self, *, tier: object, key: str, asked: int, used: int, allowed: int,
                 hint: Optional[str] = None):
        self.tier, self.key, self.asked, self.used, self.allowed = tier, key, asked, used, allowed
        fix = hint or (f"raise Budgets({tier}=...) to at least {fmt_bytes(used + asked)}, "
                       f"or choose a policy that places less on the {tier} tier")
        super().__init__(
            f"tiermem: out of {tier} memory placing {key!r}: asked {fmt_bytes(asked)}, "
            f"{fmt_bytes(used)} in use of {fmt_bytes(allowed)} allowed; {fix}")


def fmt_bytes(n: float) -> str:
    """Human-readable binary size, e.g. ``1.50 GiB``; exact bytes below 1 KiB."""
    n = float(n)
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024.0
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.2f} {unit}"
    raise AssertionError("unreachable")
