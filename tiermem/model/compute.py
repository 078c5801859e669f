"""How fast this machine multiplies matrices in each working precision: measured once into the
machine profile (its ``matmul`` section, :mod:`tiermem.plan.profile`), read back for free after.

# NOTE [A precision the CPU is slow at]
Without AVX512-BF16 or AMX, torch computes a bf16 or fp16 matmul on the CPU through slow paths: on
an AVX2 EPYC a bf16 ``F.linear`` took 11x its fp32 time, so the main job ran at 6 s a step instead
of 0.4 s. ``precision="auto"`` avoids that by the CPU's features alone (NOTE [Choosing the
precision] in tiermem/config/precision.py); a model given "bf16" or "fp16" on a CPU gets, once per process
and precision, a warning with the two matmul times and the fix, when that precision's matmul takes
more than ``SLOW_RATIO`` times fp32's. The times are the profile's: measured the first time they
are needed (under a second, announced by a log line), saved with the conditions they were
measured under (the CPU's features, torch's version, the accelerator), and measured again only
when those change (``ATEN_CPU_CAPABILITY=avx2``, another torch, a profile copied from another
machine). The CPU's figures are one thread's CPU time, the steadiest on a shared machine (the time
other programs hold the core is not counted); the cost model scales them by the threads torch uses
(NOTE [Cost model]).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import time
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from tiermem.config.specs import PRECISIONS, CpuFeatures, auto_precision
from tiermem.errors import ConfigError
from tiermem.plan.profile import SCHEMA, load_profile, matmul_key, save_profile

log = logging.getLogger(__name__)

#: ``F.linear(x [m, k], w [n, k])`` on the CPU: about one layer of a small model, 0.27 GFLOP
CPU_SHAPE = (1024, 256, 512)
#: on an accelerator: large enough that the launch does not decide the time
DEVICE_SHAPE = (4096, 4096, 4096)
#: a precision whose matmul takes more than this many times fp32's is "much slower" (native bf16
#: takes less than fp32's time; the slow paths 6-30x)
SLOW_RATIO = 2.0
_BUDGET_S = 0.25  # timed calls per figure: at least 3, then more while they take less than this

_sections: dict[str, dict[str, Any]] = {}  # conditions -> the section: this process reads the profile once
_warned: set[str] = set()  # precisions warned about in this process


def conditions(device: torch.device) -> dict[str, Any]:
    """What the figures depend on besides the silicon's speed: measured under other conditions, they are stale."""
    return {
        "cpu": dataclasses.asdict(CpuFeatures.detect()),
        "torch": torch.__version__,
        "accelerator": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }


def linear(device: torch.device, precision: str, shape: tuple[int, int, int]) -> Callable[[], torch.Tensor]:
    """One ``F.linear`` of ``shape`` (m, k, n) in ``precision`` on ``device`` per call, not synchronised."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=PRECISIONS[precision])
    w = torch.randn(n, k, generator=gen).to(device=device, dtype=PRECISIONS[precision])
    return lambda: F.linear(x, w)


def _best_seconds(fn: Callable[[], object], sync: Callable[[], None], clock: Callable[[], float]) -> float:
    """The fastest of at least 3 timed calls (more while they fit in ``_BUDGET_S``), after an untimed one:
    on a loaded machine the fastest call is the one least disturbed."""
    fn()
    sync()
    best, spent, calls = math.inf, 0.0, 0
    while calls < 3 or (spent < _BUDGET_S and calls < 20):
        t0 = clock()
        fn()
        sync()
        took = clock() - t0
        best, spent, calls = min(best, took), spent + took, calls + 1
    return best


def measure_matmul(device: torch.device) -> dict[str, Any]:
    """The profile's ``matmul`` section, measured now: GFLOP/s of each precision on one CPU thread and,
    on an accelerator, there too (NOTE [A precision the CPU is slow at])."""
    section: dict[str, Any] = {
        "conditions": conditions(device),
        "cpu_shape": list(CPU_SHAPE),
        "cpu_threads": 1,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    flop = 2 * math.prod(CPU_SHAPE)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the matmul runs on this thread: its CPU time leaves out other programs' turns
    try:
        for p in PRECISIONS:
            seconds = _best_seconds(linear(torch.device("cpu"), p, CPU_SHAPE), lambda: None, time.thread_time)
            section[matmul_key("cpu", p)] = round(flop / seconds / 1e9, 3)
    finally:
        torch.set_num_threads(threads)
    if device.type == "cuda":
        section["device_shape"] = list(DEVICE_SHAPE)
        for p in PRECISIONS:
            seconds = _best_seconds(
                linear(device, p, DEVICE_SHAPE), lambda: torch.cuda.synchronize(device), time.perf_counter
            )
            section[matmul_key("device", p)] = round(2 * math.prod(DEVICE_SHAPE) / seconds / 1e9, 3)
    return section


def matmul_figures(device: torch.device) -> dict[str, Any]:
    """This machine's ``matmul`` section: the saved profile's when measured under today's conditions,
    else measured now and saved into the profile (a profile that does not exist yet holds only
    this section until the cost model first needs the rest: tiermem.model.machine)."""
    now = conditions(device)
    key = json.dumps(now, sort_keys=True)
    if key in _sections:
        return _sections[key]
    prof = load_profile()
    data = dict(prof.data) if prof is not None else {"schema": SCHEMA, "source": "matmul figures measured on first use"}
    section = data.get("matmul")
    if not (
        isinstance(section, dict)
        and section.get("conditions") == now
        and all(isinstance(section.get(matmul_key("cpu", p)), (int, float)) for p in PRECISIONS)
    ):
        log.info(
            "tiermem: measuring this machine's matmul speed in %s, once (under a second; saved in the machine profile)",
            ", ".join(PRECISIONS),
        )
        section = data["matmul"] = measure_matmul(device)
        try:
            save_profile(data)
        except ConfigError as e:  # a read-only cache directory: measured again by the next process
            log.warning("%s", e)
    _sections[key] = section
    return section


def slowdown(section: dict[str, Any], precision: str) -> Optional[float]:
    """How many times fp32's time a CPU matmul takes in ``precision``, from a ``matmul`` section."""
    fp32, mine = section.get(matmul_key("cpu", "fp32")), section.get(matmul_key("cpu", precision))
    if not (isinstance(fp32, (int, float)) and isinstance(mine, (int, float)) and mine > 0):
        return None
    return fp32 / mine


def warn_if_slow(precision: str, device: torch.device) -> None:
    """One warning per process and precision when ``precision`` on this CPU computes much slower than
    fp32 (NOTE [A precision the CPU is slow at]); nothing on an accelerator or in fp32."""
    if device.type != "cpu" or precision == "fp32" or precision in _warned:
        return
    section = matmul_figures(device)
    ratio = slowdown(section, precision)
    if ratio is None or ratio <= SLOW_RATIO:
        return
    _warned.add(precision)
    flop = 2 * math.prod(section.get("cpu_shape", CPU_SHAPE))
    ms = {p: flop / (section[matmul_key("cpu", p)] * 1e9) * 1e3 for p in (precision, "fp32")}
    cpu = CpuFeatures(**section["conditions"]["cpu"])
    auto = auto_precision(device, cpu=cpu)[0]
    fix = "precision='fp32'" if auto == precision else f"precision='auto' ({auto} on this CPU) or 'fp32'"
    log.warning(
        "tiermem: precision=%r on this CPU (%s): a matmul in %s takes %.2f ms against %.2f ms in fp32 "
        "(%.1fx), so forward and backward run about that much slower; pass %s to train faster (the "
        "optimizer state is fp32 either way)",
        precision,
        cpu,
        precision,
        ms[precision],
        ms["fp32"],
        ratio,
        fix,
    )
