"""What the subcommands share: output consoles, size formatting, JSON output, paths and the machine's sizes."""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any, Optional

import psutil
import torch
from rich.console import Console

from tiermem.errors import ConfigError
from tiermem.memory.nvme_dir import describe_direct

_DECIMAL_UNITS = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3))


def fmt_size(n: float) -> str:
    """Decimal units, as disks and the worked example count: ``15 GB``, ``1.25 TB``, ``512 B``."""
    for unit, scale in _DECIMAL_UNITS:
        if abs(n) >= scale:
            return f"{_trim(n / scale)} {unit}"
    return f"{int(n)} B"


def fmt_binary(n: int) -> str:
    """Binary units for block sizes: ``8 MiB``, ``64 KiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _trim(v: float) -> str:
    return f"{v:.2f}".rstrip("0").rstrip(".")


def stdout_console() -> Console:
    # Wide enough that tables do not wrap when stdout is a pipe or a file (rich assumes 80 there).
    return Console(width=None if sys.stdout.isatty() else 120, highlight=False)


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def write_json(target: str, data: dict[str, Any]) -> None:
    """Write ``data`` to the file ``target``, or to stdout when ``target`` is ``-``."""
    text = json.dumps(data, indent=2, sort_keys=False) + "\n"
    if target == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise ConfigError(
            f"tiermem: cannot write --json {target!r}: {e.strerror}; give a path in a writable directory"
        ) from None


def check_output_path(option: str, target: Optional[str]) -> None:
    """Fail before a long run, not after it, when an output file cannot be written."""
    if target is None or target == "-":
        return
    directory = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(directory):
        raise ConfigError(
            f"tiermem: {option} {target!r}: directory {directory!r} does not exist; create it or give another path"
        )
    if not os.access(directory, os.W_OK) or (os.path.exists(target) and not os.access(target, os.W_OK)):
        raise ConfigError(f"tiermem: {option} {target!r} is not writable; give a path in a writable directory")


def existing_dir(option: str, path: str) -> str:
    """``path`` as an absolute directory that exists and that we may write into."""
    full = os.path.abspath(path)
    if not os.path.isdir(full):
        raise ConfigError(f"tiermem: {option} {path!r} is not an existing directory; create it or give another one")
    if not os.access(full, os.W_OK | os.X_OK):
        raise ConfigError(f"tiermem: {option} {path!r} is not writable by this user; give a directory you can write to")
    return full


def accelerator() -> Optional[str]:
    """The accelerator's name, or None on a machine without one."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return None


def device_memory() -> Optional[int]:
    """Total memory of the first accelerator, or None without one."""
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return None


def host_memory() -> int:
    return int(psutil.virtual_memory().total)


def disk_free(path: str) -> int:
    return int(shutil.disk_usage(path).free)


def probe_o_direct(directory: str) -> tuple[bool, str]:
    """(works, why not): the NVMe store's own O_DIRECT probe, :func:`tiermem.memory.nvme_dir.describe_direct`
    (kept under this name for bench's call)."""
    return describe_direct(directory)
