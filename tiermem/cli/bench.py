"""``tiermem bench``: how fast each tier moves bytes on this machine, how fast the CPU Adam runs, and
how fast a matmul runs in each precision (NOTE [A precision the CPU is slow at]).

Prints a table, optionally writes JSON (``--json``) and a chart (``--plot``), and saves the results
as the machine profile (:mod:`tiermem.plan.profile`) that policies can read later.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tiermem import __version__
from tiermem.cli import _common, measure, plot, tables as report
from tiermem.cli.measure import Rate
from tiermem.errors import ConfigError
from tiermem.model import compute
from tiermem.plan import profile

MiB = 2**20


@dataclass(frozen=True)
class Settings:
    """Sizes and repeats of one bench run (see NOTE [Stable figures] in measure.py)."""

    copy_bytes: int  # per host and device copy: well past the CPU caches
    nvme_bytes: int  # per NVMe write and read
    block_sizes: tuple[int, ...]  # NvmeStore block_size values swept
    in_flight: tuple[int, ...]  # NvmeStore io_threads values swept (requests in flight)
    adam_params: int
    repeats: int
    min_seconds: float  # shortest timed sample


# The store's defaults (8 MiB blocks, 8 threads) are in both sweeps: they are the profile's figures.
DEFAULT_BLOCK, DEFAULT_IN_FLIGHT = 8 * MiB, 8
QUICK = Settings(
    copy_bytes=128 * MiB,
    nvme_bytes=128 * MiB,
    block_sizes=(MiB, 8 * MiB),
    in_flight=(1, 8),
    adam_params=2**23,
    repeats=3,
    min_seconds=0.05,
)
FULL = Settings(
    copy_bytes=512 * MiB,
    nvme_bytes=512 * MiB,
    block_sizes=(MiB, 8 * MiB, 32 * MiB),
    in_flight=(1, 4, 8, 16),
    adam_params=2**26,
    repeats=5,
    min_seconds=0.2,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="measure each tier's bandwidth and the CPU Adam; save a profile",
        description="Measure DEVICE<->HOST copies (pinned and pageable, each direction and "
        "both at once), HOST copy bandwidth, NVMe write/read through tiermem's "
        "NvmeStore over block sizes and requests in flight (direct and buffered "
        "I/O), and CPU Adam throughput next to torch's fused AdamW. Results are "
        "saved as this machine's profile in "
        f"{profile.profile_path().parent}/ for policies to read.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smaller sizes and fewer repeats: under 30 s, plus a one-time compile of the "
        "Adam kernel on a fresh machine (reported apart)",
    )
    p.add_argument(
        "--nvme-path",
        metavar="DIR",
        help="directory on the disk to measure (default: a temporary directory under the "
        "current one); a scratch directory is made inside it and removed afterwards",
    )
    p.add_argument("--repeats", type=int, metavar="N", help="timed samples per figure (default: 3 quick, 5)")
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="write results as JSON to FILE (stdout when FILE is omitted or '-')",
    )
    p.add_argument("--plot", metavar="FILE.png", help="draw the tier bandwidths (needs matplotlib)")
    p.add_argument("--no-save", action="store_true", help="do not save the results as the machine profile")
    p.set_defaults(run=run)


@contextlib.contextmanager
def scratch_dir(nvme_path: str | None) -> Iterator[str]:
    """A fresh directory for the NVMe files, inside ``nvme_path`` (or the current directory),
    removed with everything in it afterwards. The user's directory itself is never removed."""
    parent = _common.existing_dir("--nvme-path" if nvme_path else "the current directory", nvme_path or os.getcwd())
    try:
        path = tempfile.mkdtemp(prefix=".tiermem-bench-", dir=parent)
    except OSError as e:
        raise ConfigError(
            f"tiermem: cannot create a scratch directory in {parent}: {e.strerror}; pass "
            f"--nvme-path DIR on a writable disk"
        ) from None
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class _Results:
    """The bench results as plain data, in the profile's layout (GB/s with the unit in the key)."""

    def __init__(self, quick: bool):
        self.data: dict[str, Any] = {
            "schema": profile.SCHEMA,
            "tiermem": __version__,
            "torch": torch.__version__,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "quick": quick,
            "noisy_cv": measure.NOISY_CV,
            "device": {},
            "host": {},
            "nvme": {"sweep": []},
            "adam": {},
            "noisy": [],
        }

    def rate(self, where: dict[str, Any], key: str, rate: Rate, path: str, scale: float = 1e9) -> None:
        """Store ``rate``'s median under ``key`` (unit in the key) and its cv beside it."""
        where[key] = round(rate.median / scale, 4)
        where[key.rsplit("_", 1)[0] + "_cv"] = round(rate.cv, 4)
        if rate.noisy:
            self.data["noisy"].append(path)


_Steps = list[tuple[str, Callable[[], None]]]  # (label for the progress bar, the measurement)


def _plan(s: Settings, res: _Results, nvme_dir: str) -> _Steps:
    """The measurements of one run, in order, as (label, action) pairs for the progress bar."""
    bufs: list[torch.Tensor] = []  # two host buffers that every measurement shares
    steps = _host_steps(s, res, bufs)
    steps += _device_steps(s, res, bufs) if torch.cuda.is_available() else _stand_in_steps(s, res, bufs)
    steps += _nvme_steps(s, res, bufs, nvme_dir)
    steps += _adam_steps(s, res, bufs)
    steps.append(("matmul per precision", lambda: res.data.update(matmul=compute.measure_matmul(_device()))))
    return steps


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _timing(s: Settings) -> dict[str, Any]:
    """The keywords that every measure.* call takes from the settings."""
    return dict(repeats=s.repeats, min_seconds=s.min_seconds)


def _host_steps(s: Settings, res: _Results, bufs: list[torch.Tensor]) -> _Steps:
    d = res.data

    def host() -> None:  # first, so it allocates the shared buffers
        size = max(s.copy_bytes, s.nvme_bytes)
        bufs.extend(measure.filled(size) for _ in range(2))
        d["host"]["copy_bytes"] = s.copy_bytes
        a, b = (x[: s.copy_bytes] for x in bufs)
        res.rate(d["host"], "copy_GBps", measure.host_copy(a, b, **_timing(s)), "host.copy_GBps")

    return [("host copy", host)]


def _device_steps(s: Settings, res: _Results, bufs: list[torch.Tensor]) -> _Steps:
    d = res.data
    d["device"].update(accelerator=_common.accelerator(), stand_in=None, copy_bytes=s.copy_bytes)
    steps: _Steps = []
    for pinned in (True, False):

        def dev(pinned: bool = pinned) -> None:
            if pinned:  # the engine's staging buffers are pinned: those figures are the profile's
                pair = [measure.filled(s.copy_bytes, pin=True) for _ in range(2)]
            else:
                pair = [x[: s.copy_bytes] for x in bufs]
            rates = measure.device_copies(*pair, **_timing(s))
            del pair
            suffix = "" if pinned else "_pageable"  # the engine copies from pinned buffers
            for name, r in rates.items():
                res.rate(d["device"], f"{name}{suffix}_GBps", r, f"device.{name}{suffix}_GBps")

        steps.append((f"device <-> host, {'pinned' if pinned else 'pageable'}", dev))
    return steps


def _stand_in_steps(s: Settings, res: _Results, bufs: list[torch.Tensor]) -> _Steps:
    d = res.data

    def stand_in() -> None:
        d["device"].update(
            accelerator=None,
            copy_bytes=s.copy_bytes,
            stand_in="no accelerator: host-to-host copies stand in for device<->host",
        )
        for key in ("h2d_GBps", "d2h_GBps", "h2d_cv", "d2h_cv"):  # one copy_, the same either way
            d["device"][key] = d["host"][key.replace("h2d", "copy").replace("d2h", "copy")]
        a, b = (x[: s.copy_bytes] for x in bufs)
        res.rate(d["device"], "bidir_GBps", measure.host_copy_pair(a, b, **_timing(s)), "device.bidir_GBps")

    return [("device <-> host stand-in (no accelerator)", stand_in)]


def _nvme_steps(s: Settings, res: _Results, bufs: list[torch.Tensor], nvme_dir: str) -> _Steps:
    d = res.data
    # Probed once here, so a filesystem that refuses O_DIRECT (tmpfs) gives one note, not a store
    # warning per point; those points then run buffered and say so.
    direct_ok, why_not = _common.probe_o_direct(nvme_dir)
    d["nvme"].update(
        bytes=s.nvme_bytes,
        default_block_size_bytes=DEFAULT_BLOCK,
        default_in_flight=DEFAULT_IN_FLIGHT,
        o_direct=direct_ok,
        o_direct_why_not=why_not,
        write_is="overwrite of a key written before (measure.nvme_point)",
    )
    points = [(b, q, True) for b in s.block_sizes for q in s.in_flight]
    points.append((DEFAULT_BLOCK, DEFAULT_IN_FLIGHT, False))
    steps: _Steps = []
    for block, depth, direct in points:

        def nvme(block: int = block, depth: int = depth, direct: bool = direct) -> None:
            src, out = (x[: s.nvme_bytes] for x in bufs)
            pt = measure.nvme_point(
                nvme_dir, src, out, block_size=block, in_flight=depth, direct=direct and direct_ok, **_timing(s)
            )
            i = len(d["nvme"]["sweep"])
            entry: dict[str, Any] = {
                "block_size_bytes": block,
                "in_flight": depth,
                "direct": pt.direct,
                "asked_direct": direct,
            }
            res.rate(entry, "write_GBps", pt.write, f"nvme.sweep[{i}].write_GBps")
            res.rate(entry, "read_GBps", pt.read, f"nvme.sweep[{i}].read_GBps")
            d["nvme"]["sweep"].append(entry)
            if (block, depth) == (DEFAULT_BLOCK, DEFAULT_IN_FLIGHT):
                prefix = "" if direct else "buffered_"
                for k in ("write_GBps", "read_GBps", "write_cv", "read_cv"):
                    d["nvme"][prefix + k] = entry[k]
                if direct:
                    d["nvme"]["direct"] = pt.direct

        io = "direct" if direct else "buffered"
        steps.append((f"nvme {io} {_common.fmt_binary(block)} x {depth} in flight", nvme))
    return steps


def _adam_steps(s: Settings, res: _Results, bufs: list[torch.Tensor]) -> _Steps:
    d = res.data

    def adam() -> None:
        bufs.clear()  # give the memory back before Adam allocates its own
        a = measure.adam(s.adam_params, **_timing(s))
        d["adam"].update(
            params=s.adam_params,
            implementation=a.implementation,
            compile_s=round(a.compile_seconds, 3),
            tiermem_kernel="adam_step: bf16 grad in, fp32 master/m/v, bf16 weights out",
            torch_kernel="torch.optim.AdamW(fused=True), fp32",
        )
        res.rate(d["adam"], "tiermem_Gparams_per_s", a.tiermem, "adam.tiermem_Gparams_per_s")
        res.rate(d["adam"], "torch_fused_Gparams_per_s", a.torch_fused, "adam.torch_fused_Gparams_per_s")
        d["adam"]["tiermem_vs_torch"] = round(a.tiermem.median / a.torch_fused.median, 3)

    steps: _Steps = [("CPU Adam: tiermem and torch fused AdamW", adam)]
    if torch.cuda.is_available():

        def device_adam() -> None:  # the split step's device half (ZeroOffload(device_fraction=...))
            res.rate(
                d["adam"],
                "device_Gparams_per_s",
                measure.device_adam(s.adam_params, **_timing(s)),
                "adam.device_Gparams_per_s",
            )

        steps.append(("device Adam", device_adam))
    return steps


def _check_space(nvme_dir: str, s: Settings) -> None:
    need = 2 * s.nvme_bytes + 64 * MiB  # the key's two slot files, both kept: overwrites alternate between them
    free = _common.disk_free(nvme_dir)
    if free < need:
        raise ConfigError(
            f"tiermem: bench needs {_common.fmt_size(need)} free under {nvme_dir}, "
            f"{_common.fmt_size(free)} is; pass --nvme-path on a disk with more room, "
            f"or use --quick"
        )


def collect(
    s: Settings,
    nvme_path: str | None,
    *,
    quick: bool,
    on_step: Callable[[str, int, int], None] = lambda label, done, total: None,
) -> dict[str, Any]:
    """Run every measurement; ``on_step(label, done, total)`` is called before each one starts."""
    res = _Results(quick)
    with scratch_dir(nvme_path) as nvme_dir:
        _check_space(nvme_dir, s)
        res.data["nvme"]["path"] = os.path.dirname(nvme_dir)
        steps = _plan(s, res, nvme_dir)
        for i, (label, action) in enumerate(steps):
            on_step(label, i, len(steps))
            action()
    return res.data


def run(args: argparse.Namespace) -> int:
    s = QUICK if args.quick else FULL
    if args.repeats is not None:
        if args.repeats < 1:
            raise ConfigError(f"tiermem: --repeats {args.repeats} must be 1 or more; pass e.g. --repeats 5")
        s = Settings(**{**s.__dict__, "repeats": args.repeats})
    _common.check_output_path("--json", args.json)
    _common.check_output_path("--plot", args.plot)
    if args.nvme_path is not None:
        _common.existing_dir("--nvme-path", args.nvme_path)
    if args.plot:
        plot.require_matplotlib()
    err = _common.stderr_console()
    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("tiermem bench", total=None)
        data = collect(
            s,
            args.nvme_path,
            quick=args.quick,
            on_step=lambda label, done, total: bar.update(task, completed=done, total=total, description=label),
        )
    saved = None if args.no_save else profile.save_profile(data)
    if args.json is not None:
        _common.write_json(args.json, data)
    if args.plot:
        plot.draw(data, args.plot)
    if args.json != "-":
        report.render(data, _common.stdout_console(), saved=saved, plot_path=args.plot)
    return 0
