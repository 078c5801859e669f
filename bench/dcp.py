"""Checkpoints of 2 data-parallel ranks: the torch.distributed.checkpoint directory every rank writes
its shards to (``tm.save``'s default under data parallelism), and a user's own ``dcp.save`` /
``dcp.load`` of ``tm.sharded_state_dict()`` ("user"), against the single file rank 0 writes
(``format="file"``, what earlier versions wrote), in one run.

    python bench/dcp.py [--preset gpt50m] [--rounds 3] [--policy zero-offload|state-on-nvme] [--dir DIR]

The script spawns 2 gloo ranks (one intra-op thread each). Both train one step of a GPT (so the
moments are real), then each round saves the model once in each format (the order alternating
from round to round, so that neither always goes first) and loads each back into it. A time is
the slowest rank's, from a barrier to the last rank's return; the figures are medians over the
rounds. Each rank's peak host memory during a save is exact: the kernel's high-water mark of the
process's resident memory (VmHWM), reset just before the save (``/proc/self/clear_refs``), less
the resident memory then; the bytes a rank writes and reads are its system calls' (``rchar``,
``wchar`` of ``/proc/self/io``: files, page cache hits included, and gloo's sockets). Loads read
what the saves just wrote, from the page cache as much as from the disk, for both formats alike.
Ratios come last.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for examples.gpt

from bench._common import free_port
from examples.gpt import GPT, add_model_args, config_from_args, lm_loss
from tiermem import AdamW, PerClass, TensorClass, Tier, TieredModel
from tiermem.errors import fmt_bytes
from tiermem.policies import ZeroOffload

WORLD = 2
# user: your own dcp.save / dcp.load of tm.sharded_state_dict() (torch's FileSystemWriter: a file per
# rank); user-files: the same with FileSystemWriter(single_file_per_rank=False), a file per tensor
FORMATS = ("file", "dcp", "user", "user-files")


class StateOnNvme(PerClass):
    homes = {
        TensorClass.PARAM: Tier.DEVICE,
        TensorClass.GRAD: Tier.HOST,
        TensorClass.OPTIM_STATE: Tier.NVME,
        TensorClass.ACTIVATION: Tier.DEVICE,
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, preset="gpt50m", batch_size=2, seq_len=64, batch_help="sequences per rank in the one step")
    p.add_argument("--rounds", type=int, default=3, help="saves and loads per format")
    p.add_argument("--policy", choices=("zero-offload", "state-on-nvme"), default="zero-offload")
    p.add_argument("--bucket-size", default="32MiB")
    p.add_argument(
        "--dir",
        default=None,
        help="where the checkpoints (and NVMe state) go; default: a temporary directory under /tmp",
    )
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)[1])


def _io() -> tuple[int, int]:
    """Bytes this process has read and written through system calls: files (page cache hits
    included) and gloo's sockets alike."""
    with open("/proc/self/io") as f:
        text = f.read()
    return tuple(int(re.search(rf"^{k}: (\d+)", text, re.MULTILINE)[1]) for k in ("rchar", "wchar"))  # type: ignore


def measured(fn) -> tuple[float, int, int, int]:
    """(seconds of ``fn()`` on the slowest rank; this rank's peak resident bytes above those before
    it, bytes read and bytes written meanwhile)."""
    dist.barrier()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what an earlier measurement freed leaves the process first
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from what is resident now
    before, io0 = _rss_kib("VmRSS"), _io()
    t0 = time.perf_counter()
    fn()
    seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    peak, io1 = _rss_kib("VmHWM"), _io()
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item(), 1024 * max(0, peak - before), io1[0] - io0[0], io1[1] - io0[1]


def du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def worker(rank: int, args: argparse.Namespace, port: int, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        run(rank, args, root)
    finally:
        dist.destroy_process_group()


def save(tm: TieredModel, path: str, fmt: str) -> None:
    if not fmt.startswith("user"):
        tm.save(path, format=fmt)
        return
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(path, single_file_per_rank=fmt == "user")
    dcp.save(tm.sharded_state_dict(), storage_writer=writer)


def load(tm: TieredModel, path: str, fmt: str) -> None:
    if not fmt.startswith("user"):
        tm.load(path)
        return
    import torch.distributed.checkpoint as dcp

    sd = tm.sharded_state_dict()
    dcp.load(sd, checkpoint_id=path)
    tm.load_sharded_state_dict(sd)


def run(rank: int, args: argparse.Namespace, root: str) -> None:
    say = print if rank == 0 else (lambda *a, **k: None)
    cfg = config_from_args(args)
    torch.manual_seed(0)
    policy = ZeroOffload() if args.policy == "zero-offload" else StateOnNvme()
    nvme = os.path.join(root, "nvme") if args.policy == "state-on-nvme" else None
    tm = TieredModel(
        GPT(cfg),
        policy,
        optimizer=AdamW(lr=3e-4, weight_decay=0.1),
        precision="bf16",
        bucket_size=args.bucket_size,
        nvme_dir=nvme,
    )
    gen = torch.Generator().manual_seed(rank)
    b = torch.randint(args.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen)
    tm.backward(lm_loss(tm(b[:, :-1]), b[:, 1:]))
    tm.step()
    n = tm.layout.n_params
    say(
        f"GPT {cfg.n_layer} layers x {cfg.n_embd} wide, {n / 1e6:.1f}M parameters, {len(tm.layout.buckets)} "
        f"buckets of {args.bucket_size}; {WORLD} gloo ranks; {tm!r}; checkpoints under {root}",
        flush=True,
    )
    save_s: dict[str, list[float]] = {f: [] for f in FORMATS}
    load_s: dict[str, list[float]] = {f: [] for f in FORMATS}
    peaks: dict[str, list[int]] = {f: [] for f in FORMATS}
    io: dict[str, tuple[int, int]] = {}
    for r in range(args.rounds):
        order = FORMATS if r % 2 == 0 else FORMATS[::-1]
        for fmt in order:
            path = os.path.join(root, f"ck.{fmt}")
            seconds, peak, _, written = measured(lambda: save(tm, path, fmt))
            save_s[fmt].append(seconds)
            peaks[fmt].append(peak)
            io[fmt] = (0, written)
        for fmt in order:
            path = os.path.join(root, f"ck.{fmt}")
            seconds, _, read, _ = measured(lambda: load(tm, path, fmt))
            load_s[fmt].append(seconds)
            io[fmt] = (read, io[fmt][1])
        say(
            f"round {r + 1}: "
            + "  ".join(f"{f} save {save_s[f][-1]:6.2f} s load {load_s[f][-1]:6.2f} s" for f in FORMATS),
            flush=True,
        )
    all_peaks: list[dict[str, int]] = [{}] * WORLD
    dist.all_gather_object(all_peaks, {f: max(p) for f, p in peaks.items()})
    all_io: list[dict[str, tuple[int, int]]] = [{}] * WORLD
    dist.all_gather_object(all_io, io)
    if rank != 0:
        return
    size = {f: du(os.path.join(root, f"ck.{f}")) for f in FORMATS}
    med = {f: (statistics.median(save_s[f]), statistics.median(load_s[f])) for f in FORMATS}
    largest = max(b.numel for b in tm.layout.buckets)
    print(
        f"\n| format | save, median of {args.rounds} | load | on disk | peak host memory during the save, "
        f"rank 0 | rank 1 |"
    )
    print("|---|---|---|---|---|---|")
    for f in FORMATS:
        print(
            f"| {f} | {med[f][0]:.2f} s | {med[f][1]:.2f} s | {fmt_bytes(size[f])} | "
            + " | ".join(f"+{fmt_bytes(p[f])}" for p in all_peaks)
            + " |"
        )
    print(
        "\n| format | bytes a save writes (files and gloo's sockets), rank 0 | rank 1 | bytes a load reads, rank 0 "
        "| rank 1 |"
    )
    print("|---|---|---|---|---|")
    for f in FORMATS:
        print(
            f"| {f} | "
            + " | ".join(fmt_bytes(i[f][1]) for i in all_io)
            + " | "
            + " | ".join(fmt_bytes(i[f][0]) for i in all_io)
            + " |"
        )
    print(
        f"\nfor scale: the model's fp32 state (12 B/param) {fmt_bytes(12 * n)}, a rank's shard "
        f"{fmt_bytes(12 * n // WORLD)}, one bucket's state (12 B x the largest bucket) {fmt_bytes(12 * largest)}"
    )
    print("\n== ratios ==")
    print(f"dcp save / file save:                    {med['dcp'][0] / med['file'][0]:5.2f}x")
    print(f"dcp load / file load:                    {med['dcp'][1] / med['file'][1]:5.2f}x")
    most = {f: max(i[f][0] for i in all_io) for f in FORMATS}
    print(f"bytes a rank reads to load, dcp / file:  {most['dcp'] / most['file']:5.2f}x")
    for f in FORMATS[1:]:
        for r in range(WORLD):
            print(
                f"rank {r} save peak host memory, {f} / file: {all_peaks[r][f] / max(1, all_peaks[r]['file']):5.2f}x "
                f"(/ one bucket's state: {all_peaks[r][f] / (12 * largest):.2f}x)"
            )


def main() -> None:
    args = parse_args()
    root = tempfile.mkdtemp(prefix="tiermem-dcp-bench-", dir=args.dir or "/tmp")
    if args.policy == "state-on-nvme":
        os.mkdir(os.path.join(root, "nvme"))
    try:
        mp.start_processes(worker, args=(args, free_port(), root), nprocs=WORLD, start_method="spawn")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
