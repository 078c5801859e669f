"""Host memory of building a model bigger than the machine: a Llama-shaped stack built on the meta
device, its weights streamed from a safetensors checkpoint into ZeroInfinity's homes on NVMe
(weights, grads and optimizer state all there), at two sizes 4x apart, each in a fresh process.

    python bench/meta_rss.py [--width 1024] [--layers 4] [--dir DIR]

Per size: the checkpoint's bytes, the peak resident memory the construction added (``ru_maxrss``
after, less the resident memory before it) and the time against the bytes it read and wrote. The
anchor is the same model built in memory and saved (the way a user without tiermem's meta support
would have to): its peak is the whole model. The slope, printed last, is the added peak per added
parameter between the two sizes (the bigger-than-the-machine issue's target: at most 0.25 B/param).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, resource, sys, time
import psutil, torch
from torch import nn
import tiermem
from tiermem import PerClass, TensorClass, Tier

width, layers, ckpt, nvme, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]

class AllOnNvme(PerClass):
    homes = {TensorClass.PARAM: Tier.NVME, TensorClass.GRAD: Tier.NVME, TensorClass.OPTIM_STATE: Tier.NVME,
             TensorClass.ACTIVATION: Tier.DEVICE}

def make():
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))

before = psutil.Process().memory_info().rss
t0 = time.perf_counter()
if mode == "write":
    from safetensors.torch import save_file
    torch.manual_seed(0)
    save_file({k: v.contiguous() for k, v in make().state_dict().items()}, ckpt)
else:
    with torch.device("meta"):
        model = make()
    tm = tiermem.TieredModel(model, AllOnNvme(), precision="bf16", nvme_dir=nvme, weights=ckpt,
                             bucket_size="8MiB", optimizer=tiermem.AdamW(lr=1e-4))
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"added_peak": peak - before, "seconds": seconds, "params": width * width * layers}))
"""


def run(width: int, layers: int, ckpt: str, nvme: str, mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(width), str(layers), ckpt, nvme, mode],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4, help="layers of the smaller model; the larger has 4x")
    ap.add_argument("--dir", default=None, help="where the checkpoints and the NVMe homes go (default: a temp dir)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        rows = []
        for layers in (args.layers, 4 * args.layers):
            ckpt = os.path.join(root, f"w{layers}.safetensors")
            nvme = os.path.join(root, f"nvme{layers}")
            os.makedirs(nvme)
            made = run(args.width, layers, ckpt, nvme, "write")
            built = run(args.width, layers, ckpt, nvme, "build")
            rows.append((layers, made, built))
            shutil.rmtree(nvme)
            os.remove(ckpt)
        print(
            f"{'params':>12} {'ckpt MiB':>9} {'in memory: added peak MiB':>26} {'meta + weights=: added peak MiB':>32} {'build s':>8}"
        )
        for _, made, built in rows:
            n = built["params"]
            print(
                f"{n:>12,} {n * 4 / 2**20:>9.0f} {made['added_peak'] / 2**20:>26.1f} "
                f"{built['added_peak'] / 2**20:>32.1f} {built['seconds']:>8.2f}"
            )
        (_, m0, b0), (_, m1, b1) = rows
        dn = b1["params"] - b0["params"]
        print(f"in memory: {(m1['added_peak'] - m0['added_peak']) / dn:.2f} B of peak per added param (anchor)")
        print(f"slope: {(b1['added_peak'] - b0['added_peak']) / dn:.3f} B of peak per added param (target <= 0.25)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
