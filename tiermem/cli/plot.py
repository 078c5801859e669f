"""``tiermem bench --plot``: the tier bandwidths as a picture (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

import math
from typing import Any

from tiermem.cli._common import fmt_binary
from tiermem.errors import ConfigError

_COLOURS = {"device": "#4c72b0", "host": "#55a868", "nvme": "#c44e52"}


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def require_matplotlib() -> None:
    """Fail before a long run, not after it, when the chart cannot be drawn."""
    if not matplotlib_available():
        raise ConfigError("tiermem: --plot needs matplotlib, which is not installed; pip install 'tiermem[plot]'")


def _bars(data: dict[str, Any]) -> list[tuple[str, str, float]]:
    """(tier, label, GB/s) for the left panel, fastest tier first."""
    dev, host, nv = data["device"], data["host"], data["nvme"]
    kind = "pinned" if dev.get("accelerator") else "stand-in: host copy"
    bars = [
        ("device", f"host -> device ({kind})", dev["h2d_GBps"]),
        ("device", f"device -> host ({kind})", dev["d2h_GBps"]),
        ("device", "device <-> host, both at once", dev["bidir_GBps"]),
    ]
    if "h2d_pageable_GBps" in dev:
        bars += [
            ("device", "host -> device (pageable)", dev["h2d_pageable_GBps"]),
            ("device", "device -> host (pageable)", dev["d2h_pageable_GBps"]),
        ]
    bars.append(("host", "host copy", host["copy_GBps"]))
    io = "direct" if nv.get("direct") else "buffered"
    bars += [
        ("nvme", f"nvme write ({io})", nv["write_GBps"]),
        ("nvme", f"nvme read ({io})", nv["read_GBps"]),
        ("nvme", "nvme write (buffered)", nv["buffered_write_GBps"]),
        ("nvme", "nvme read (buffered, cold)", nv["buffered_read_GBps"]),
    ]
    return bars


def draw(data: dict[str, Any], path: str) -> None:
    """Two panels: every tier's bandwidth (log scale), and the NVMe sweep."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    bars = _bars(data)[::-1]  # barh draws bottom-up
    left.barh([b[1] for b in bars], [b[2] for b in bars], color=[_COLOURS[b[0]] for b in bars])
    for y, (_, _, v) in enumerate(bars):
        left.text(v, y, f" {v:.2f}", va="center", fontsize=8)
    left.set_xscale("log")
    values = [b[2] for b in bars]
    # bars start at the power of ten below the slowest, and there is room for the value labels
    left.set_xlim(10 ** math.floor(math.log10(min(values))), max(values) * 2)
    left.set_xlabel("GB/s (10^9 bytes/s, log scale)")
    left.set_title("tiermem bench: bandwidth per tier" + (" (--quick)" if data["quick"] else ""))
    for tier, colour in _COLOURS.items():
        left.bar(0, 0, color=colour, label=tier)
    left.legend(loc="lower right")

    sweep = [e for e in data["nvme"]["sweep"] if e["asked_direct"]]
    for block in sorted({e["block_size_bytes"] for e in sweep}):
        pts = sorted((e["in_flight"], e["write_GBps"], e["read_GBps"]) for e in sweep if e["block_size_bytes"] == block)
        (line,) = right.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"write, {fmt_binary(block)}")
        right.plot(
            [p[0] for p in pts],
            [p[2] for p in pts],
            marker="s",
            linestyle="--",
            color=line.get_color(),
            label=f"read, {fmt_binary(block)}",
        )
    right.set_xscale("log", base=2)
    depths = sorted({e["in_flight"] for e in sweep})
    right.set_xticks(depths, [str(q) for q in depths])
    top = max(max(e["write_GBps"], e["read_GBps"]) for e in sweep)
    right.set_ylim(0, top * 1.25)  # bandwidths from zero: no exaggerated slopes; room for the legend
    right.set_xlabel("requests in flight (NvmeStore io_threads)")
    right.set_ylabel("GB/s")
    right.set_title("NVMe through NvmeStore, by block size")
    right.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise ConfigError(
            f"tiermem: cannot write --plot {path!r}: {e.strerror}; give a path in a writable directory"
        ) from None
    finally:
        plt.close(fig)
