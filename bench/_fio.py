"""fio, the independent anchor of the NVMe benches: one invocation, in one place."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence


def fio_job(
    path: str, rw: str, *, size: int | str, block: int | str, name: str, iodepth: int = 8, extra: Sequence[str] = ()
) -> dict:
    """One fio pass over ``path`` (libaio, O_DIRECT, one job, ``iodepth`` requests in flight), ``rw``
    of ``size`` bytes in ``block``-byte requests, with ``extra`` options after those; returns the job's
    JSON: ``job["read"]["bw_bytes"]`` and ``job["write"]["bw_bytes"]`` are its B/s each way (0 for a
    direction it did not move)."""
    if shutil.which("fio") is None:
        raise SystemExit("tiermem bench: fio is not installed; install it (Debian/Ubuntu: apt-get install fio)")
    cmd = ["fio", f"--name={name}", f"--filename={path}", f"--rw={rw}", f"--bs={block}", f"--size={size}"]
    cmd += ["--direct=1", "--ioengine=libaio", f"--iodepth={iodepth}", "--numjobs=1", "--output-format=json", *extra]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(res.stdout)["jobs"][0]


def sequential_bandwidth(directory: str, size: int | str, passes: dict[str, str], *, name: str) -> dict[str, float]:
    """fio's sequential bandwidth (B/s) on ``directory``, 8 MiB blocks, iodepth 8, one pass per
    ``passes`` item (figure name -> fio ``rw``) over one file there, removed at the end. A figure is
    the pass's reads plus its writes (an ``rw`` pass does both at once, half each)."""
    path, bw = os.path.join(directory, "fio.dat"), {}
    try:
        for figure, rw in passes.items():
            job = fio_job(path, rw, size=size, block="8M", name=name)
            bw[figure] = float(job["read"]["bw_bytes"] + job["write"]["bw_bytes"])
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return bw


def read_write(directory: str, size: int | str, *, name: str) -> dict[str, float]:
    """fio's sequential read and write bandwidth (B/s) on ``directory``, printed."""
    bw = sequential_bandwidth(directory, size, {"write": "write", "read": "read"}, name=name)
    print(f"fio on {directory}: read {bw['read'] / 1e9:.2f} GB/s, write {bw['write'] / 1e9:.2f} GB/s", flush=True)
    return bw


def faster_after(directory: str, size: int | str, before: dict[str, float], *, name: str) -> dict[str, float]:
    """fio again (the disk's speed drifts on a shared machine), and each direction at the faster of
    ``before`` and now: the stricter floor."""
    after = read_write(directory, size, name=name)
    return {k: max(before[k], after[k]) for k in before}
