"""The errors a user can cause. Every message starts with ``tiermem:`` and ends with what to change."""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
from typing import Optional, TypeVar


class TierMemError(Exception):
    """Base class of every error tiermem raises for something a user can cause or fix.

    Args:
        message: the text; ``"tiermem: "`` is put in front when it does not start with it.
    """

    def __init__(self, message: str):
        if not message.startswith("tiermem:"):
            message = "tiermem: " + message
        super().__init__(message)


class ConfigError(TierMemError, ValueError):
    """A configuration value is invalid: names the class, the field, the value and the rule."""


class ArgumentError(ConfigError, TypeError):
    """A call got arguments its signature does not take (an unknown or missing keyword, too many
    positional ones): names them and lists the ones it takes. A TypeError too, as Python's is."""


C = TypeVar("C", bound=type)


def checked_arguments(cls: C) -> C:
    """Class decorator (outermost, above ``@dataclass``): ``cls(...)`` with arguments its
    ``__init__`` does not take raises :class:`ArgumentError` instead of Python's bare TypeError."""
    init = cls.__init__  # type: ignore[misc]  # a class decorator: it reads the class's own __init__ to wrap it
    sig = inspect.signature(init if init is not object.__init__ else lambda self: None)

    @functools.wraps(init)
    def __init__(self: object, *args: object, **kwargs: object) -> None:
        try:
            sig.bind(self, *args, **kwargs)
        except TypeError as e:
            raise ArgumentError(_wrong_arguments(type(self).__name__, sig, kwargs, e)) from None
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]  # ...and replaces it with the checked one
    return cls


def _wrong_arguments(name: str, sig: inspect.Signature, kwargs: dict[str, object], error: TypeError) -> str:
    params = list(sig.parameters.values())[1:]  # without self
    shown, star = [], False
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not star:
            shown.append("*")
            star = True
        shown.append(p.name if p.default is p.empty else f"{p.name}=...")
    names = [p.name for p in params]
    guesses = [
        f"{close[0]}= instead of {k}="
        for k in kwargs
        if k not in names
        for close in [difflib.get_close_matches(k, names, n=1)]
        if close
    ]
    hint = f" (did you mean {', '.join(guesses)}?)" if guesses else ""
    return f"tiermem: {name}(): {error}{hint}; it takes {name}({', '.join(shown)})"


class StoreError(TierMemError, OSError):
    """A store could not read or write (I/O error, disk full, corrupt or missing data)."""


class OutOfTierMemory(TierMemError, MemoryError):
    """An allocation would take a tier past its budget. The message names the tier, the tensor,
    the bytes asked, used and allowed, and what to change.

    Args:
        tier: the tier that is full.
        key: the tensor (or working set) being placed.
        asked: the bytes asked for.
        used: the bytes already in use on the tier.
        allowed: the tier's budget.
        hint: what to change, when the default advice (raise the budget, place less there) is not it.
    """

    def __init__(self, *, tier: object, key: str, asked: int, used: int, allowed: int, hint: Optional[str] = None):
        self.tier, self.key, self.asked, self.used, self.allowed = tier, key, asked, used, allowed
        fix = hint or (
            f"raise Budgets({tier}=...) to at least {fmt_bytes(used + asked)}, "
            f"or choose a policy that places less on the {tier} tier"
        )
        super().__init__(
            f"tiermem: out of {tier} memory placing {key!r}: asked {fmt_bytes(asked)}, "
            f"{fmt_bytes(used)} in use of {fmt_bytes(allowed)} allowed; {fix}"
        )


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


def add_note(error: BaseException, text: str) -> None:
    """Tell the user what tiermem did about ``error`` (or what to do next) without changing its type:
    a note on the exception (Python 3.11+), and a warning in the log, which Python 3.10 has alone."""
    if hasattr(error, "add_note"):
        error.add_note(text)
    logging.getLogger("tiermem").warning("%s (%s: %s)", text, type(error).__name__, error)
