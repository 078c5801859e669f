"""The machine profile that ``tiermem bench`` saves, and a reader that policies can use.

The profile is the bench's JSON, saved at ``$XDG_CACHE_HOME/tiermem/profile.json`` (default
``~/.cache/tiermem/profile.json``). Bandwidths are in GB/s (10^9 bytes per second), keyed by tier
name (``device``, ``host``, ``nvme``) with the unit in the key, e.g. ``{"nvme": {"write_GBps": 2.1}}``.
A missing or unreadable profile reads as None: nothing in tiermem needs one to work.

The ``matmul`` section holds how fast a small matmul (``F.linear``) runs in each working precision,
in GFLOP/s: ``cpu_<precision>_GFLOPs`` on one CPU thread and, with an accelerator,
``device_<precision>_GFLOPs``, with the ``conditions`` they were measured under (the CPU's
features, torch's version, the accelerator): figures measured under other conditions are stale
(:func:`tiermem.model.machine.matmul_figures` measures them again).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional

from tiermem.errors import ConfigError
from tiermem.types import Tier

logger = logging.getLogger(__name__)

SCHEMA = 1

#: (source tier, destination tier) -> (section, key) of the profile figure that measures that move.
_LINKS = {
    (Tier.HOST, Tier.DEVICE): ("device", "h2d_GBps"),
    (Tier.DEVICE, Tier.HOST): ("device", "d2h_GBps"),
    (Tier.HOST, Tier.HOST): ("host", "copy_GBps"),
    (Tier.HOST, Tier.NVME): ("nvme", "write_GBps"),
    (Tier.NVME, Tier.HOST): ("nvme", "read_GBps"),
}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tiermem"


def profile_path() -> Path:
    return cache_dir() / "profile.json"


class Profile:
    """Read access to a saved bench profile."""

    def __init__(self, data: Mapping[str, Any]):
        self.data = dict(data)

    @property
    def created(self) -> Optional[str]:
        return self.data.get("created")

    def bandwidth(self, src: Tier, dst: Tier) -> Optional[float]:
        """Bytes per second measured for moving bytes from ``src`` to ``dst``, or None if not measured."""
        section, key = _LINKS.get((src, dst), (None, None))
        if section is None:
            return None
        value = self.data.get(section, {}).get(key)
        return float(value) * 1e9 if isinstance(value, (int, float)) and value > 0 else None

    def adam_params_per_second(self) -> Optional[float]:
        value = self.data.get("adam", {}).get("tiermem_Gparams_per_s")
        return float(value) * 1e9 if isinstance(value, (int, float)) and value > 0 else None

    def device_adam_params_per_second(self) -> Optional[float]:
        """The device's Adam (fp32 state on the accelerator), or None when not measured (no accelerator:
        the device's Adam is the CPU's)."""
        value = self.data.get("adam", {}).get("device_Gparams_per_s")
        return float(value) * 1e9 if isinstance(value, (int, float)) and value > 0 else None

    def matmul_flops(self, precision: str, *, accelerator: bool) -> Optional[float]:
        """FLOP/s of the profile's matmul in ``precision`` (``"bf16"``...): on the accelerator, or on
        one CPU thread; None when not measured."""
        value = self.data.get("matmul", {}).get(matmul_key("device" if accelerator else "cpu", precision))
        return float(value) * 1e9 if isinstance(value, (int, float)) and value > 0 else None

    def noisy(self) -> list[str]:
        """Keys of the figures that varied by more than 10% over their repeats."""
        return list(self.data.get("noisy", []))


def matmul_key(where: str, precision: str) -> str:
    """The key of a matmul figure in the profile's ``matmul`` section: ``where`` is "cpu" or "device"."""
    return f"{where}_{precision}_GFLOPs"


def load_profile(path: Optional[os.PathLike[str] | str] = None) -> Optional[Profile]:
    """The saved profile, or None when there is none (or it cannot be read: logged, not raised)."""
    p = Path(path) if path is not None else profile_path()
    try:
        with open(p, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("tiermem: ignoring the bench profile %s (%s); run `tiermem bench` to write a new one", p, e)
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        logger.warning("tiermem: ignoring the bench profile %s (not schema %d); run `tiermem bench` again", p, SCHEMA)
        return None
    return Profile(data)


def save_profile(data: Mapping[str, Any], path: Optional[os.PathLike[str] | str] = None) -> Path:
    """Write ``data`` atomically (a reader never sees half a file); returns where it went."""
    p = Path(path) if path is not None else profile_path()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".tmp", dir=p.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(dict(data), f, indent=2)
                f.write("\n")
            os.replace(tmp, p)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        raise ConfigError(
            f"tiermem: cannot save the bench profile to {p}: {e.strerror}; set XDG_CACHE_HOME "
            f"to a writable directory, or pass --no-save"
        ) from None
    return p
