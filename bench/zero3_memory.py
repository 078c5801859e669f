"""Where a rank's resident memory goes under ZeRO-3, against FSDP2: an accounting by phase.

    python bench/zero3_memory.py [--setups weights-on-host shard-weights FSDP2+CPUOffload FSDP2]
                                 [--steps 4] [--n-layer 6 --n-embd 384] [--batch-size 16] [--seq-len 128]

Each setup alone in a fresh pair of gloo ranks (the model and batches of ``bench/zero3.py``'s memory
part). A sampler thread reads the process's resident set (``/proc/self/statm``) every millisecond
and keeps its maximum per phase (construction; each step's forward, backward and update). At each
phase's end: the resident set, glibc's heap (``mallinfo2``: bytes in use, mmapped, free but kept),
the bytes of the torch tensors Python can reach (by storage, once each), and tiermem's ledger by
tier and class. The tables are rank 0's; the ranks differ by a chunk's padding.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for examples.gpt and bench.zero3

from bench._common import CLIP, DATA_PARALLEL_GPT, peak_rss
from bench.zero3 import SETUPS, batches, fsdp2_parts, spawn, tiermem_model
from examples.gpt import GPT, add_model_args, config_from_args, lm_loss
from tiermem import Tier

PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 2**20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def malloc_stats() -> dict[str, int]:
    """glibc's view of the heap: bytes handed out (``used``: from arenas and mmapped), and bytes
    free in the arenas but kept by the process (``kept``)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {"used": m.uordblks + m.hblkhd, "mmapped": m.hblkhd, "kept": m.fordblks}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def tensor_bytes() -> int:
    """Bytes of the CPU storages of the torch tensors Python reaches, each storage once."""
    seen, total = set(), 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on deprecated module attributes
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for o in tensors:
        try:
            if o.device.type != "cpu":
                continue
            st = o.untyped_storage()
            ptr = st.data_ptr()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass, a freed storage
            continue
        if ptr and ptr not in seen:
            seen.add(ptr)
            total += st.nbytes()
    return total


class Sampler:
    """The resident set's maximum per phase, read every ``period`` seconds on a thread."""

    def __init__(self, period: float = 0.001):
        self.phase, self.peaks, self.period = "start", {}, period
        self.at_peak: dict[str, dict[str, int]] = {}  # glibc's heap when the phase's maximum was read
        self.live: dict[str, int] = {}  # the phase's most bytes in use: glibc's, and the host pool's (its own mappings)
        self.host = None  # tiermem's host store, once a model is built
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            r, m = rss(), malloc_stats()
            # the pool's memory: what its ledger counts, less the room held for grads with no memory yet
            live = m.get("used", 0) + (self.host.used - self.host.room if self.host is not None else 0)
            if live > self.live.get(self.phase, 0):
                self.live[self.phase] = live
            if r > self.peaks.get(self.phase, 0):
                self.peaks[self.phase] = r
                self.at_peak[self.phase] = m
            time.sleep(self.period)

    def enter(self, phase: str) -> None:
        r = rss()
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), r)
        self.phase = phase
        self.peaks[phase] = r

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def ledger(tm) -> dict:
    """tiermem's managed bytes now and at their peak, by tier and class, and by kind of key now."""
    if tm is None:
        return {}
    out = {}
    for tier, store in tm.stores.items():
        lg = getattr(store, "ledger", None)
        if lg is None:
            continue
        out[tier.name] = {
            "used": lg.used,
            "room": getattr(store, "room", 0),  # of ``used``: held for grads, no memory behind it
            "peak": lg.peak,
            "by_class": {k.name: v for k, v in lg.kind_used.items() if v},
            "class_peak": {k.name: v for k, v in lg.kind_peak.items() if v},
            "keys": _by_kind_of_key(lg._held),
        }
    return out


def _by_kind_of_key(held: dict[str, int]) -> dict[str, int]:
    """Ledger keys grouped by what follows the parameter or bucket name (``:param shard``, ...)."""
    out: dict[str, int] = {}
    for key, n in held.items():
        kind = (
            key.split(":", 1)[1]
            if ":" in key
            else ("<" + key.split()[0].strip("<") if key.startswith("<") else "(plain)")
        )
        out[kind] = out.get(kind, 0) + n
    return out


class Phases:
    """A setup's step in three calls: forward (the loss), backward, update."""

    def __init__(self, name: str, cfg, args: argparse.Namespace, nvme: str):
        if name.startswith("FSDP2"):
            self.tm, self.model, self.opt = None, *fsdp2_parts(cfg, offload=name.endswith("CPUOffload"))
        else:
            self.tm = tiermem_model(name, cfg, precision="bf16", bucket_size=args.bucket_size, nvme_dir=nvme)

    def forward(self, x, y):
        return lm_loss((self.tm or self.model)(x), y)

    def backward(self, loss) -> None:
        if self.tm is not None:
            self.tm.backward(loss)
        else:
            loss.backward()

    def update(self) -> None:
        if self.tm is not None:
            self.tm.step()
            return
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def snapshot(sampler: Sampler, tm) -> dict:
    gc.collect()
    return {
        "rss": rss(),
        "maxrss": peak_rss(),
        "tensors": tensor_bytes(),
        "malloc": malloc_stats(),
        "ledger": ledger(tm),
        "phase": sampler.phase,
    }


def account_rank(rank: int, world: int, name: str, args: argparse.Namespace, tmp: str) -> None:
    cfg = config_from_args(args)
    sampler = Sampler()
    snaps = {"start": snapshot(sampler, None)}
    torch.manual_seed(0)
    GPT(cfg)  # as bench/zero3.py's memory part: the plain fp32 model, built once and dropped
    snaps["plain model built"] = snapshot(sampler, None)
    nvme = os.path.join(tmp, f"account-{name}")
    os.makedirs(nvme, exist_ok=True)
    sampler.enter("construction")
    step = Phases(name, cfg, args, nvme)
    tm = step.tm
    sampler.host = tm.stores[Tier.HOST] if tm is not None else None
    snaps["constructed"] = snapshot(sampler, tm)
    for i, b in enumerate(batches(args, rank, world, args.steps)):
        x, y = b[:, :-1], b[:, 1:]
        sampler.enter(f"forward {i + 1}")
        loss = step.forward(x, y)
        snaps[f"forward {i + 1}"] = snapshot(sampler, tm)
        sampler.enter(f"backward {i + 1}")
        step.backward(loss)
        del loss
        snaps[f"backward {i + 1}"] = snapshot(sampler, tm)
        sampler.enter(f"update {i + 1}")
        step.update()
        snaps[f"update {i + 1}"] = snapshot(sampler, tm)
    sampler.enter("end")
    sampler.stop()
    with open(os.path.join(tmp, f"account-{name}-{rank}.json"), "w") as f:
        json.dump({"snaps": snaps, "peaks": sampler.peaks, "at_peak": sampler.at_peak, "live": sampler.live}, f)


def show(name: str, data: dict) -> None:
    snaps, peaks = data["snaps"], data["peaks"]
    base = snaps["plain model built"]["maxrss"]
    print(f"\n### {name} (rank 0; MiB; growth from the peak once the plain model was built: {base / MiB:.1f})")
    live0 = snaps["plain model built"]["malloc"].get("used", 0)
    print(
        f"(bytes in use: glibc's plus tiermem's host pool, beyond the {live0 / MiB:.1f} MiB glibc held once the "
        f"plain model was built and dropped)"
    )
    print(
        "| phase | peak RSS in phase | most bytes in use in phase | malloc used, kept free at the RSS peak | "
        "RSS at end | torch tensors | malloc used | malloc kept free | ledger device | ledger host | "
        "ledger device peak | ledger host peak |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for phase, s in snaps.items():
        lg, m, p = s["ledger"], s["malloc"], data["at_peak"].get(phase, {})
        dev, host = lg.get("DEVICE", {}), lg.get("HOST", {})
        cells = [
            peaks.get(phase, s["rss"]) - base,
            data["live"].get(phase, live0) - live0,
            f"{p.get('used', 0) / MiB:.1f}, {p.get('kept', 0) / MiB:.1f}",
            s["rss"] - base,
            s["tensors"],
            m.get("used", 0),
            m.get("kept", 0),
            dev.get("used", 0),
            host.get("used", 0),
            dev.get("peak", 0),
            host.get("peak", 0),
        ]
        print(f"| {phase} | " + " | ".join(c if isinstance(c, str) else f"{c / MiB:.1f}" for c in cells) + " |")
    last = list(snaps.values())[-1]["ledger"]
    for tier, lg in last.items():
        print(
            f"{tier}: by class now {_mib(lg['by_class'])}; class peaks {_mib(lg['class_peak'])}; "
            f"keys now {_mib(lg['keys'])}"
        )


def _mib(d: dict) -> str:
    return "{" + ", ".join(f"{k}: {v / MiB:.1f}" for k, v in d.items()) + "}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, **DATA_PARALLEL_GPT)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--bucket-size", default="4MiB")
    p.add_argument(
        "--setups",
        nargs="+",
        default=["FSDP2+CPUOffload", "FSDP2", "weights-on-host", "shard-weights"],
        choices=["FSDP2+CPUOffload", "FSDP2", *SETUPS],
    )
    args = p.parse_args()
    os.environ.setdefault("TIERMEM_NO_COMPILE", "1")
    with tempfile.TemporaryDirectory(prefix="tiermem-zero3-", dir=".") as tmp:
        for name in args.setups:
            spawn(account_rank, 2, name, args, tmp)
            with open(os.path.join(tmp, f"account-{name}-0.json")) as f:
                show(name, json.load(f))
    return 0


if __name__ == "__main__":
    sys.exit(main())
