"""The main job (examples/train_gpt.py) per step in each precision, natively and on an emulated
AVX2-only CPU, in one run (issue 23 part 6).

    python bench/precision.py [--steps 20] [--rounds 2] [--configs native:fp32,avx2:auto,...]

``avx2`` runs the job with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``: torch's kernels and
oneDNN's matmuls as on a CPU without AVX-512, AVX512-BF16 or AMX (the issue's 2-core EPYC), whatever
this CPU has. Each config is a fresh process of ``examples/train_gpt.py --steps N``; the configs
take turns for ``--rounds`` rounds, so load from other programs hits all of them alike. A config's
figure is the median over its rounds of the ms/step of its last log window (the steps after the
first ``--log-every``, past the first step's set-up). Also printed: a ``F.linear`` of the issue's
shape (4096x128 by 512x128, one thread) in fp32 and bf16 under each emulation, and what
``precision="auto"`` resolves to. Ratios against native fp32 come last.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EMULATIONS = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
LINEAR = """
import time, torch, torch.nn.functional as F
from tiermem.config.specs import resolve_precision
torch.set_num_threads(1)
out = [resolve_precision("auto", torch.device("cpu"))]
for dt in (torch.float32, torch.bfloat16):
    x, w = torch.randn(4096, 128, dtype=dt), torch.randn(512, 128, dtype=dt)
    F.linear(x, w)
    best = float("inf")
    for _ in range(7):
        t0 = time.thread_time()
        F.linear(x, w)
        best = min(best, time.thread_time() - t0)
    out.append(f"{best * 1e3:.2f}")
print(*out)
"""


def env_of(emulation: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
    }
    return {**env, **EMULATIONS[emulation]}


def step_ms(emulation: str, precision: str, steps: int, log_every: int) -> float:
    """ms/step of the last log window of a fresh ``train_gpt.py --steps steps`` run."""
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "train_gpt.py"),
        "--steps",
        str(steps),
        "--log-every",
        str(log_every),
        "--precision",
        precision,
        "--sample-tokens",
        "0",
        "--eval-batches",
        "1",
    ]
    out = subprocess.run(cmd, env=env_of(emulation), capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    windows = re.findall(r"([\d.]+) ms/step", out.stdout)
    return float(windows[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="steps of each run (the last --log-every are timed)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--configs",
        default="native:fp32,native:auto,avx2:auto,avx2:bf16",
        help="EMULATION:PRECISION,... (the first is the anchor)",
    )
    a = p.parse_args()
    configs = [tuple(c.split(":")) for c in a.configs.split(",")]
    for emulation in dict.fromkeys(e for e, _ in configs):
        got = subprocess.run(
            [sys.executable, "-c", LINEAR], env=env_of(emulation), capture_output=True, text=True, check=True, cwd=ROOT
        ).stdout.split()
        print(
            f"{emulation:>6}: precision='auto' is {got[0]}; F.linear 4096x128 by 512x128, one thread: "
            f"fp32 {got[1]} ms, bf16 {got[2]} ms ({float(got[2]) / float(got[1]):.1f}x)",
            flush=True,
        )
    ms: dict[tuple, list[float]] = {c: [] for c in configs}
    t0 = time.perf_counter()
    for r in range(a.rounds):
        for c in configs:
            ms[c].append(step_ms(*c, a.steps, a.log_every))
            print(f"round {r + 1}: {c[0]:>6} {c[1]:>4}: {ms[c][-1]:8.1f} ms/step", flush=True)
    print(f"({time.perf_counter() - t0:.0f} s; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    anchor = statistics.median(ms[configs[0]])
    print(f"\nms/step (median of {a.rounds} rounds) and against {configs[0][0]} {configs[0][1]}:")
    for c in configs:
        med = statistics.median(ms[c])
        print(
            f"  {c[0]:>6} {c[1]:>4}  {med:8.1f} ms/step  500 steps ~ {med * 500 / 6e4:5.1f} min  {med / anchor:5.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
