"""This machine as the planner sees it: the limits its stores will have, and its profile for the cost
model (the one ``tiermem bench`` saved, or, on first use when there is none, a quick measurement of
a few seconds, announced by a log line, saved in its place; ``tiermem bench`` measures more, and
more carefully: run it to replace this one).
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import tempfile
import time
from typing import Callable, Optional

import torch

from tiermem import optim
from tiermem.config.budgets import Budgets
from tiermem.memory.nvme import NvmeStore
from tiermem.memory.resident import default_device_budget, default_host_budget
from tiermem.model.compute import matmul_figures
from tiermem.plan.profile import SCHEMA, Profile, load_profile, profile_path, save_profile
from tiermem.types import Tier

log = logging.getLogger(__name__)

_BYTES = 64 * 2**20
_ADAM_PARAMS = 2**22


def store_limits(device: torch.device, budgets: Budgets, nvme_dir: Optional[str]) -> dict[Tier, int]:
    """What each store will be allowed, computed as the stores compute it, before any exists (on an
    accelerator, no more than is free there now); NVMe only with a directory."""
    given = budgets.for_tier(Tier.DEVICE)
    dev = given if given is not None else default_device_budget(device)
    if device.type == "cuda":
        dev = min(dev, torch.cuda.mem_get_info(device)[0])
    host, nvme = budgets.for_tier(Tier.HOST), budgets.for_tier(Tier.NVME)
    limits = {Tier.DEVICE: dev, Tier.HOST: host if host is not None else default_host_budget()}
    if nvme_dir is not None:
        limits[Tier.NVME] = (
            nvme if nvme is not None else (shutil.disk_usage(nvme_dir).free if os.path.isdir(nvme_dir) else 0)
        )
    return limits


def machine_profile(device: torch.device, nvme_dir: Optional[str]) -> Profile:
    """The saved profile, or a quick one measured now (NVMe in ``nvme_dir``, when given) and saved;
    its matmul figures are this machine's today (NOTE [A precision the CPU is slow at])."""
    prof = load_profile()
    if prof is not None and prof.adam_params_per_second() is not None:  # not only matmul figures
        matmul = matmul_figures(device)
        return prof if prof.data.get("matmul") == matmul else Profile({**prof.data, "matmul": matmul})
    log.warning(
        "tiermem: no machine profile at %s; measuring this machine once for the cost model (a few "
        "seconds; `tiermem bench` measures it fully) ...",
        profile_path(),
    )
    data = measure(device, nvme_dir)
    try:
        save_profile(data)
    except Exception as e:  # noqa: BLE001 - a read-only cache directory costs a measurement next time, nothing else
        log.warning("%s", e)
    log.warning(
        "tiermem: machine measured: %s",
        ", ".join(
            f"{k} {v}"
            for sec in ("host", "device", "nvme", "adam", "matmul")
            for k, v in data[sec].items()
            if k.endswith(("GBps", "per_s", "GFLOPs"))
        ),
    )
    return Profile(data)


def _rate(fn: Callable[[], object], units: float, sync: Callable[[], None] = lambda: None, repeats: int = 3) -> float:
    """Best of ``repeats`` timings, in units per second (after one untimed call)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return units / best


def measure(device: torch.device, nvme_dir: Optional[str]) -> dict:
    """A quick profile, in the layout ``tiermem bench`` saves (GB/s, Gparam/s)."""
    a, b = torch.empty(_BYTES, dtype=torch.uint8), torch.empty(_BYTES, dtype=torch.uint8)
    a.fill_(1)
    host = _rate(lambda: b.copy_(a), _BYTES) / 1e9
    data: dict = {
        "schema": SCHEMA,
        "quick": True,
        "source": "measured on first use by the cost model",
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {"copy_GBps": round(host, 4)},
        "device": {"accelerator": None},
        "nvme": {},
        "adam": {},
        "matmul": matmul_figures(device),
    }
    if device.type == "cuda":

        def sync() -> None:  # the model's device: a bare synchronize() is the current device's, 0 on cuda:N
            torch.cuda.synchronize(device)

        d = torch.empty(_BYTES, dtype=torch.uint8, device=device)
        pa, pb = a.pin_memory(), b.pin_memory()
        data["device"] = {
            "accelerator": torch.cuda.get_device_name(device),
            "h2d_GBps": round(_rate(lambda: d.copy_(pa, non_blocking=True), _BYTES, sync) / 1e9, 4),
            "d2h_GBps": round(_rate(lambda: pb.copy_(d, non_blocking=True), _BYTES, sync) / 1e9, 4),
        }
        data["adam"]["device_Gparams_per_s"] = round(_adam(device, sync) / 1e9, 4)
    else:
        data["device"].update(h2d_GBps=round(host, 4), d2h_GBps=round(host, 4))
    data["adam"]["tiermem_Gparams_per_s"] = round(_adam(torch.device("cpu"), lambda: None) / 1e9, 4)
    data["nvme"] = _nvme(nvme_dir, a, b)
    return data


def _adam(device: torch.device, sync: Callable[[], None]) -> float:
    return _rate(adam_steps(device, _ADAM_PARAMS), _ADAM_PARAMS, sync)


def adam_steps(device: torch.device, n: int) -> Callable[[], None]:
    """One ``adam_step`` over ``n`` parameters on ``device`` per call, as the step calls it there
    (fp32 state; grads in bf16 on the CPU, fp32 on an accelerator; bf16 weights out), not
    synchronised: what this profile and ``tiermem bench`` time."""
    master = torch.randn(n, device=device)
    m, v = torch.zeros_like(master), torch.zeros_like(master)
    grad = (torch.randn(n, device=device) * 1e-3).to(torch.bfloat16 if device.type == "cpu" else torch.float32)
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    step = [0]

    def one() -> None:
        step[0] += 1
        optim.adam_step(
            master,
            m,
            v,
            grad,
            step=step[0],
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            out=out,
            check_finite=False,
        )

    return one


def _nvme(nvme_dir: Optional[str], a: torch.Tensor, b: torch.Tensor) -> dict:
    """Write and read through the store, in a scratch directory inside ``nvme_dir`` (or the
    temporary directory), removed afterwards."""
    parent = nvme_dir if nvme_dir is not None and os.path.isdir(nvme_dir) else None
    with tempfile.TemporaryDirectory(prefix=".tiermem-measure-", dir=parent) as tmp:
        store = NvmeStore(tmp)
        try:
            write = _rate(lambda: store.write("x", a).wait(), _BYTES) / 1e9
            read = _rate(lambda: store.read("x", out=b).wait(), _BYTES) / 1e9
        finally:
            store.close()
    return {"write_GBps": round(write, 4), "read_GBps": round(read, 4)}
