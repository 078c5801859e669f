"""Where tm.step() spends its time with state on NVMe: per-bucket timeline from the trace file.

    python bench/nvme_trace.py [--depth 12] [--steps 5]

Builds the two NVMe setups of bench/nvme_step.py (state-on-nvme: ZeRO-Offload with OPTIM_STATE on
NVMe; zero-infinity) with ``trace_path`` set, steps them in turn, and prints for each: the step
times, Adam's time per step (the ``adam bucket*`` spans), and the last step's timeline on the
training thread (each span's start and length in ms from the step's start: waits on the read-ahead,
the write-behind and the staging buffers, Adam per bucket) with the host->device copies beside it.
A diagnostic, not a benchmark: no anchor, no ratio.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.nvme_step import BETAS, LR, WD, LinearStack
from examples.nvme_offload import OptimStateOnNvme
from tiermem import AdamW, TieredModel
from tiermem.policies import ZeroInfinity


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="tiermem-nvme-trace-", dir=os.getcwd())
    tms: dict[str, TieredModel] = {}
    try:
        for name, policy in (("state-on-nvme", OptimStateOnNvme()), ("zero-infinity", ZeroInfinity())):
            torch.manual_seed(0)
            d = os.path.join(root, name)
            os.makedirs(d)
            tms[name] = TieredModel(
                LinearStack(2048, args.depth),
                policy,
                precision="bf16",
                nvme_dir=d,
                optimizer=AdamW(lr=LR, betas=BETAS, weight_decay=WD),
                bucket_size="32MiB",
                trace_path=os.path.join(root, f"{name}.json"),
            )
        x = torch.randn(128, 2048)
        times: dict[str, list[float]] = collections.defaultdict(list)
        for i in range(args.steps):
            for name in list(tms) if i % 2 == 0 else list(reversed(tms)):
                tm = tms[name]
                tm.backward(tm(x).float().square().mean())
                t0 = time.perf_counter()
                tm.step()
                times[name].append(time.perf_counter() - t0)
        for name, tm in tms.items():
            tm.tracer.write()  # the trace file, as a user would open it
            with open(os.path.join(root, f"{name}.json")) as f:
                events = json.load(f)["traceEvents"]
            steps = [e for e in events if e["name"] == "step"]
            adam = [
                sum(
                    e["dur"]
                    for e in events
                    if e["name"].startswith("adam bucket") and s["ts"] <= e["ts"] <= s["ts"] + s["dur"]
                )
                / 1e3
                for s in steps
            ]
            print(
                f"\n{name}: tm.step() ms {[round(1e3 * t) for t in times[name]]}; Adam per step ms "
                f"{[round(a) for a in adam]}"
            )
            last = steps[-1]
            for e in sorted(events, key=lambda e: e["ts"]):
                inside = last["ts"] <= e["ts"] <= last["ts"] + last["dur"] and e is not last
                if inside and (e["name"].startswith(("adam", "wait")) or "h2d" in str(e.get("tid"))):
                    start = (e["ts"] - last["ts"]) / 1e3
                    print(f"  {start:7.1f} +{e['dur'] / 1e3:6.1f}  {e['name']:<22} {e.get('tid')}")
    finally:
        for tm in tms.values():
            tm.detach()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
