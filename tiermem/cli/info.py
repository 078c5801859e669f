"""``tiermem info``: versions, devices and memory, the CPU's capability and how much slower it computes
bf16 and fp16 than fp32 (the precision ``"auto"`` picks), the pinned-memory limit, the NVMe
directory's O_DIRECT support and free space, and whether torch.compile (the fast CPU Adam) works here."""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import platform
import resource
import shutil
import time
from typing import Any, Optional

import psutil
import torch
from rich.table import Table

from tiermem import __version__
from tiermem.cli import _common
from tiermem.config.specs import PRECISIONS, CpuFeatures, auto_precision
from tiermem.memory.nvme_dir import describe_direct
from tiermem.model import compute
from tiermem.plan import profile

logger = logging.getLogger(__name__)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "info",
        help="versions, devices, memory, pinned limit, O_DIRECT, torch.compile",
        description="Show what this machine offers tiermem: torch and CUDA versions, "
        "accelerators and their memory, the CPU's capability and matmul speed "
        "per precision (what precision='auto' picks), host RAM and the pinned-memory limit "
        "(ulimit -l), whether --nvme-path supports O_DIRECT and its free space, "
        "and whether torch.compile works (so the fast CPU Adam is used).",
    )
    p.add_argument("--nvme-path", default=".", metavar="DIR", help="directory to check for NVMe offload (default: .)")
    p.add_argument(
        "--no-matmul-check",
        action="store_true",
        help="skip the CPU's matmul speed per precision (measured once, under a second, then read "
        "from the machine profile)",
    )
    p.add_argument(
        "--no-compile-check",
        action="store_true",
        help="skip the torch.compile check (it compiles a small kernel: seconds on a cold cache)",
    )
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="write the facts as JSON to FILE (stdout when FILE is omitted or '-')",
    )
    p.set_defaults(run=run)


def _limit(value: int) -> Optional[int]:
    return None if value == resource.RLIM_INFINITY else int(value)


def _fs_type(path: str) -> str:
    best = None
    for part in psutil.disk_partitions(all=True):
        if path == part.mountpoint or path.startswith(part.mountpoint.rstrip("/") + "/"):
            if best is None or len(part.mountpoint) > len(best.mountpoint):
                best = part
    return best.fstype if best is not None else "unknown"


def compile_check() -> dict[str, Any]:
    """Whether the compiled CPU Adam will be used, asking tiermem.optim when it can tell."""
    from tiermem.optim import compile_disabled  # the one reading of the variable

    if compile_disabled():
        return {
            "works": False,
            "implementation": "fallback",
            "why": f"disabled by TIERMEM_NO_COMPILE={os.environ['TIERMEM_NO_COMPILE']}",
        }
    t0 = time.perf_counter()
    try:
        optim = importlib.import_module("tiermem.optim")
        impl = getattr(optim, "implementation", None)
        if impl is not None:
            name = str(impl())
            return {
                "works": name in ("native", "compiled"),
                "implementation": name,
                "seconds": time.perf_counter() - t0,
            }
        fn = torch.compile(lambda a, b: a * 0.5 + b.float(), dynamic=False)
        x = torch.ones(4096)
        ok = bool(torch.equal(fn(x, torch.ones(4096, dtype=torch.bfloat16)), x * 1.5))
        return {"works": ok, "implementation": "compiled" if ok else "fallback", "seconds": time.perf_counter() - t0}
    except Exception as e:
        logger.info("torch.compile check failed", exc_info=True)
        return {
            "works": False,
            "implementation": "fallback",
            "why": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200],
            "seconds": time.perf_counter() - t0,
        }


def cpu_facts(*, check_matmul: bool) -> dict[str, Any]:
    """The CPU's capability, what ``precision="auto"`` is here and why, and (``check_matmul``) the
    profile's matmul times per precision with each one's slowdown against fp32 (NOTE [A precision
    the CPU is slow at])."""
    features = CpuFeatures.detect()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    auto, why = auto_precision(device, cpu=features)
    out: dict[str, Any] = {
        "capability": features.capability,
        "avx512_bf16": features.avx512_bf16,
        "amx": features.amx,
        "onednn_max_isa": features.onednn_max_isa,
        "onednn": features.onednn,
        "auto_precision": auto,
        "auto_why": why,
        "matmul_ms": None,
        "vs_fp32": None,
    }
    if check_matmul:
        section = compute.matmul_figures(torch.device("cpu"))
        flop = 2 * math.prod(section["cpu_shape"])
        out["matmul_shape"] = section["cpu_shape"]
        out["matmul_ms"] = {p: round(flop / (section[profile.matmul_key("cpu", p)] * 1e9) * 1e3, 3) for p in PRECISIONS}
        slower = {p: compute.slowdown(section, p) for p in PRECISIONS if p != "fp32"}
        out["vs_fp32"] = {p: None if v is None else round(v, 2) for p, v in slower.items()}
    return out


def gather(nvme_path: str, *, check_compile: bool, check_matmul: bool = True) -> dict[str, Any]:
    path = _common.existing_dir("--nvme-path", nvme_path)
    vm = psutil.virtual_memory()
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            free, _ = torch.cuda.mem_get_info(i)
            devices.append(
                {"index": i, "name": props.name, "total_bytes": int(props.total_memory), "free_bytes": int(free)}
            )
    direct, why = describe_direct(path)
    saved = profile.load_profile()
    return {
        "tiermem": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device": {"accelerators": devices},
        "host": {
            "total_bytes": int(vm.total),
            "available_bytes": int(vm.available),
            "cpus": os.cpu_count(),
            "physical_cores": psutil.cpu_count(logical=False),
            "memlock_soft_bytes": _limit(soft),
            "memlock_hard_bytes": _limit(hard),
        },
        "cpu": cpu_facts(check_matmul=check_matmul),
        "nvme": {
            "path": path,
            "free_bytes": _common.disk_free(path),
            "filesystem": _fs_type(path),
            "o_direct": direct,
            "o_direct_why_not": why,
        },
        "compile": compile_check() if check_compile else {"works": None, "why": "not checked"},
        "fio": shutil.which("fio"),
        "profile": {"path": str(profile.profile_path()), "created": saved.created if saved else None},
    }


def _cpu_and_disk_rows(t: Table, facts: dict[str, Any], accelerated: bool) -> None:
    """The rows of :func:`_render` on the CPU (features, matmul rates, ``auto``'s precision), the
    pinned-memory limit and the NVMe path."""
    h = facts["host"]
    c = facts["cpu"]
    t.add_row("CPU", f"{CpuFeatures(c['capability'], c['avx512_bf16'], c['amx'], c['onednn_max_isa'], c['onednn'])}")
    if c["matmul_ms"] is not None:
        m, k, n = c["matmul_shape"]
        t.add_row(
            "CPU matmul",
            f"F.linear {m}x{k} by {n}x{k}, one thread: "
            + ", ".join(
                f"{p} {ms:.2f} ms" + (f" ({c['vs_fp32'][p]:.1f}x fp32)" if p in c["vs_fp32"] else "")
                for p, ms in c["matmul_ms"].items()
            ),
        )
    t.add_row("precision 'auto'", f"{c['auto_precision']}: {c['auto_why']}")
    soft = h["memlock_soft_bytes"]
    lim = "unlimited" if soft is None else _common.fmt_size(soft)
    note = "" if accelerated else " (nothing is pinned without an accelerator)"
    t.add_row("pinned limit", f"ulimit -l: {lim}{note}")
    n = facts["nvme"]
    direct = "yes" if n["o_direct"] else f"no: {n['o_direct_why_not']}"
    t.add_row("nvme path", f"{n['path']} ({n['filesystem']}), {_common.fmt_size(n['free_bytes'])} free")
    t.add_row("O_DIRECT", direct)


def _render(facts: dict[str, Any]) -> None:
    con = _common.stdout_console()
    t = Table(show_header=False, title="tiermem info", title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("tiermem", facts["tiermem"])
    t.add_row("python", f"{facts['python']} on {facts['platform']}")
    cuda = facts["cuda"] or "none (CPU build)"
    t.add_row("torch", f"{facts['torch']}, CUDA {cuda}")
    accs = facts["device"]["accelerators"]
    if accs:
        for a in accs:
            t.add_row(
                f"device {a['index']}",
                f"{a['name']}: {_common.fmt_size(a['total_bytes'])} ({_common.fmt_size(a['free_bytes'])} free)",
            )
    else:
        t.add_row("device", "no accelerator: the device tier is the CPU, carved out of host RAM")
    h = facts["host"]
    t.add_row(
        "host RAM",
        f"{_common.fmt_size(h['total_bytes'])} ({_common.fmt_size(h['available_bytes'])} available), {h['cpus']} CPUs",
    )
    _cpu_and_disk_rows(t, facts, bool(accs))
    c = facts["compile"]
    if c["works"] is None:
        comp = "not checked (--no-compile-check)"
    elif c["works"]:
        comp = f"yes: the compiled CPU Adam is used (check took {c['seconds']:.1f} s)"
    else:
        comp = f"no: the fallback CPU Adam is used ({c.get('why') or c.get('implementation')})"
    t.add_row("torch.compile", comp)
    t.add_row("fio", facts["fio"] or "not found (bench/cli_check.py needs it)")
    p = facts["profile"]
    t.add_row(
        "bench profile",
        f"{p['path']} from {p['created']}"
        if p["created"]
        else f"none yet (run `tiermem bench`; it saves to {p['path']})",
    )
    con.print(t)


def run(args: argparse.Namespace) -> int:
    _common.check_output_path("--json", args.json)
    facts = gather(args.nvme_path, check_compile=not args.no_compile_check, check_matmul=not args.no_matmul_check)
    if args.json is not None:
        _common.write_json(args.json, facts)
    if args.json != "-":
        _render(facts)
    return 0


__all__ = ["add_parser", "compile_check", "gather", "run"]
