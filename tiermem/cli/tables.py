"""The tables ``tiermem bench`` prints, drawn from its results (the profile's layout)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

from tiermem.cli._common import fmt_binary
from tiermem.config.specs import PRECISIONS


def _cv(data: dict[str, Any], section: dict[str, Any], key: str, path: str) -> str:
    cv = section.get(key.rsplit("_", 1)[0] + "_cv")
    if cv is None:
        return ""
    text = f"{cv * 100:.0f}%"
    return f"[red]{text} noisy[/]" if path in data["noisy"] else text


def _tiers_table(data: dict[str, Any]) -> Table:
    t = Table(
        title=f"tiermem bench{' --quick' if data['quick'] else ''}: bandwidth per tier "
        f"(GB/s = 10^9 bytes/s, median of repeats; cv = spread)",
        title_justify="left",
    )
    for col, just in (("tier", "left"), ("move", "left"), ("GB/s", "right"), ("cv", "right"), ("", "left")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]  # rich wants a Literal: these are
    _device_rows(t, data)
    host = data["host"]
    t.add_row(
        "host",
        f"copy_ {fmt_binary(host['copy_bytes'])}",
        f"{host['copy_GBps']:.2f}",
        _cv(data, host, "copy_GBps", "host.copy_GBps"),
        "bytes copied per second",
    )
    _nvme_rows(t, data)
    return t


def _device_rows(t: Table, data: dict[str, Any]) -> None:
    """The device's copies each way, pinned and pageable; without an accelerator, the host copies
    that stand in for them."""
    dev = data["device"]
    if not dev.get("accelerator"):
        t.add_row(
            "device",
            "host -> device, device -> host",
            f"{dev['h2d_GBps']:.2f}",
            _cv(data, dev, "h2d_GBps", "host.copy_GBps"),
            "[yellow]no accelerator[/]: host copy stands in",
        )
        t.add_row(
            "device",
            "both at once",
            f"{dev['bidir_GBps']:.2f}",
            _cv(data, dev, "bidir_GBps", "device.bidir_GBps"),
            "two host copies on two threads",
        )
        return
    for suffix, kind in (("", "pinned"), ("_pageable", "pageable")):
        for name, arrow in (("h2d", "host -> device"), ("d2h", "device -> host"), ("bidir", "both at once")):
            key = f"{name}{suffix}_GBps"
            if key in dev:
                t.add_row(
                    "device",
                    f"{arrow}, {kind}",
                    f"{dev[key]:.2f}",
                    _cv(data, dev, key, f"device.{key}"),
                    dev["accelerator"] if (name, suffix) == ("h2d", "") else "",
                )


def _nvme_rows(t: Table, data: dict[str, Any]) -> None:
    """NvmeStore's writes and reads at its defaults, then buffered ones."""
    nvme = data["nvme"]
    block, depth = fmt_binary(nvme["default_block_size_bytes"]), nvme["default_in_flight"]
    io = "direct" if nvme.get("direct") else f"[yellow]buffered: O_DIRECT {nvme['o_direct_why_not']}[/]"
    for op in ("write", "read"):
        key = f"{op}_GBps"
        t.add_row(
            "nvme",
            f"{op}, {block} blocks x {depth}",
            f"{nvme[key]:.2f}",
            _cv(data, nvme, key, _sweep_path(data, True, op)),
            f"NvmeStore defaults, {io}",
        )
    for op in ("write", "read"):
        key = f"buffered_{op}_GBps"
        note = "page cache, not the disk" if op == "write" else "from a cold page cache"
        t.add_row(
            "nvme",
            f"{op}, buffered",
            f"{nvme[key]:.2f}",
            _cv(data, nvme, key, _sweep_path(data, False, op)),
            f"[dim]{note}[/]",
        )


def _sweep_path(data: dict[str, Any], asked_direct: bool, op: str) -> str:
    nv = data["nvme"]
    for i, e in enumerate(nv["sweep"]):
        if (
            e["asked_direct"] == asked_direct
            and e["block_size_bytes"] == nv["default_block_size_bytes"]
            and e["in_flight"] == nv["default_in_flight"]
        ):
            return f"nvme.sweep[{i}].{op}_GBps"
    return ""


def _sweep_table(data: dict[str, Any]) -> Table:
    nv = data["nvme"]
    t = Table(
        title=f"NVMe through NvmeStore in {nv['path']}: {fmt_binary(nv['bytes'])} per request", title_justify="left"
    )
    for col, just in (
        ("block size", "right"),
        ("in flight", "right"),
        ("I/O", "left"),
        ("write GB/s", "right"),
        ("cv", "right"),
        ("read GB/s", "right"),
        ("cv", "right"),
    ):
        t.add_column(col, justify=just)  # type: ignore[arg-type]  # rich wants a Literal: these are
    best = {op: max(e[f"{op}_GBps"] for e in nv["sweep"] if e["asked_direct"]) for op in ("write", "read")}
    for i, e in enumerate(nv["sweep"]):
        cells = []
        for op in ("write", "read"):
            v = f"{e[f'{op}_GBps']:.2f}"
            cells += [
                f"[bold green]{v}[/]" if e["asked_direct"] and e[f"{op}_GBps"] == best[op] else v,
                _cv(data, e, f"{op}_GBps", f"nvme.sweep[{i}].{op}_GBps"),
            ]
        io = "direct" if e["direct"] else ("buffered" if not e["asked_direct"] else "buffered (refused)")
        t.add_row(fmt_binary(e["block_size_bytes"]), str(e["in_flight"]), io, *cells)
    return t


def _adam_table(data: dict[str, Any]) -> Table:
    a = data["adam"]
    t = Table(title=f"CPU Adam, {a['params'] / 1e6:.1f}M parameters (Gparam/s)", title_justify="left")
    for col, just in (("kernel", "left"), ("Gparam/s", "right"), ("cv", "right"), ("", "left")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]  # rich wants a Literal: these are
    first = f"{a['implementation']} kernel; compiled (or loaded from cache) in {a['compile_s']:.1f} s"
    t.add_row(
        f"tiermem {a['tiermem_kernel']}",
        f"{a['tiermem_Gparams_per_s']:.3f}",
        _cv(data, a, "tiermem_Gparams_per_s", "adam.tiermem_Gparams_per_s"),
        first,
    )
    t.add_row(
        a["torch_kernel"],
        f"{a['torch_fused_Gparams_per_s']:.3f}",
        _cv(data, a, "torch_fused_Gparams_per_s", "adam.torch_fused_Gparams_per_s"),
        f"tiermem / torch = {a['tiermem_vs_torch']:.2f}x",
    )
    if "device_Gparams_per_s" in a:  # measured on an accelerator: the split step's device half
        t.add_row(
            "device: adam_step on the accelerator, fp32 state",
            f"{a['device_Gparams_per_s']:.3f}",
            _cv(data, a, "device_Gparams_per_s", "adam.device_Gparams_per_s"),
            "ZeroOffload(device_fraction=...), Auto",
        )
    return t


def _matmul_table(data: dict[str, Any]) -> Table:
    mm = data["matmul"]
    m, k, n = mm["cpu_shape"]
    t = Table(
        title=f"matmul per precision: F.linear {m}x{k} by {n}x{k} on one CPU thread"
        + (", and on the accelerator" if "device_shape" in mm else ""),
        title_justify="left",
    )
    t.add_column("where", justify="left")
    t.add_column("precision", justify="left")
    t.add_column("GFLOP/s", justify="right")
    t.add_column("", justify="left")
    for where in ("cpu", "device"):
        fp32 = mm.get(f"{where}_fp32_GFLOPs")
        for p in PRECISIONS:
            v = mm.get(f"{where}_{p}_GFLOPs")
            if v is not None:
                t.add_row(where, p, f"{v:.1f}", f"{fp32 / v:.1f}x fp32's time" if p != "fp32" else "")
    return t


def render(
    data: dict[str, Any], con: Console, *, saved: Optional[Path] = None, plot_path: Optional[str] = None
) -> None:
    con.print(_tiers_table(data))
    con.print(_sweep_table(data))
    con.print(_adam_table(data))
    if "matmul" in data:
        con.print(_matmul_table(data))
    if data["noisy"]:
        con.print(
            f"[red]noisy[/]: {len(data['noisy'])} figure(s) varied by more than "
            f"{data['noisy_cv'] * 100:.0f}% over their repeats (another program busy?); run again "
            f"on a quiet machine before trusting them."
        )
    if saved is not None:
        con.print(f"[dim]profile saved to {saved}[/]")
    if plot_path:
        con.print(f"[dim]chart written to {plot_path}[/]")
