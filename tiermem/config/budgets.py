"""Byte budgets per tier: parsing (``"8GiB"``, ``"500MB"``, ints) into caps (the accounting that
enforces them is :class:`tiermem.memory.ledger.Ledger`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Optional, Union

from tiermem.config.rules import is_int
from tiermem.errors import ConfigError, checked_arguments
from tiermem.types import Tier

ByteSize = Union[int, float, str]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: ByteSize, *, what: str = "size") -> int:
    """A size in bytes: ``"8GiB"`` -> 8589934592, ``"500MB"`` -> 500000000, ``1024`` -> 1024.

    Decimal units (KB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) of 1024.

    Args:
        value: an int (or integral float) of bytes, or a number with a unit as a string.
        what: the name the error message gives the value (e.g. ``"Budgets.host"``).

    Returns:
        The size in bytes, an int >= 0.

    Raises:
        ConfigError: the value does not parse, or is negative.
    """
    if is_int(value):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(
                f"tiermem: {what}={value!r} does not parse as a size; write a number with an optional "
                f"unit from B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '8GiB' or '500MB')"
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ConfigError(f"tiermem: {what}={value!r} is not a size; give bytes as an int or a string such as '8GiB'")
    if n < 0:
        raise ConfigError(f"tiermem: {what}={value!r} is negative; give a size of 0 bytes or more")
    return n


@checked_arguments
@dataclass(frozen=True)
class Budgets:
    """Caps on the bytes tiermem manages per tier; each an int of bytes or a string such as
    ``"20GiB"`` (:func:`parse_bytes`). A model whose working set does not fit is refused at
    construction with the bytes each tier needs.

    Args:
        device: cap on the device tier. Default: on a GPU, its free memory plus what torch's
            allocator holds, less max(1 GiB, 5%); without an accelerator, the available RAM.
        host: cap on host memory (pinned where an accelerator exists). Default: the available RAM.
        nvme: cap on the NVMe directory. Default: its free disk space.
    """

    device: Optional[ByteSize] = None
    host: Optional[ByteSize] = None
    nvme: Optional[ByteSize] = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None:
                object.__setattr__(self, f.name, parse_bytes(v, what=f"Budgets.{f.name}"))

    def for_tier(self, tier: Tier) -> Optional[int]:
        """The cap in bytes of ``tier``, None when it has none.

        Args:
            tier: a :class:`~tiermem.Tier`.
        """
        value = getattr(self, tier.value)  # an int once constructed (__post_init__ parsed it)
        return None if value is None else int(value)
