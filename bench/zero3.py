"""Weights sharded over the ranks (ZeRO-3): numbers, weight bytes per rank, and step time and memory
against FSDP2, on gloo ranks of this machine.

    python bench/zero3.py [--ranks 2 4] [--steps 8] [--warmup 2] [--n-layer 6 --n-embd 384]
                          [--batch-size 16] [--seq-len 128] [--bucket-size 4MiB] [--skip-numbers]

Three parts, each in fresh processes (the script spawns its gloo ranks, one intra-op thread each):

1. **Numbers** (for each ``--ranks`` N): the setups ``zero-infinity`` (ZeroInfinity: weights and
   optimizer state on NVMe), ``weights-on-host`` (PARAM, GRAD and OPTIM_STATE on the host) and
   ``shard-weights`` (ZeroOffload with ``shard_weights=True``) train a small GPT in fp32 for
   ``--numbers-steps`` steps, each rank on its own micro-batch, against one process accumulating the
   N micro-batches, and against ZeRO-2 (ZeroOffload, weights whole on every rank) on the same
   ranks; bf16 runs check the ranks stay identical. Per rank: the peak bytes of working
   weights on their home tier (``tm.report()``'s ledger; for NVMe also ``du`` of the weights' files),
   against one process's.
2. **Speed** (2 ranks, the ``--n-layer``/``--n-embd`` GPT in bf16, ``--batch-size`` global):
   FSDP2 (``fully_shard`` per block and at the root, ``MixedPrecisionPolicy(param_dtype=bf16)``;
   with ``CPUOffloadPolicy(pin_memory=False)``, the anchor of the host-offload setups, and without,
   the anchor of ``shard-weights``), torch AdamW, ``clip_grad_norm_``; and tiermem's three setups,
   grad_clip=1.0. Stepped round-robin from a barrier; a step's time is the slowest rank's; medians
   over ``--steps`` after ``--warmup``. ``zero-infinity`` reads and writes its weights and state
   on NVMe every step, which FSDP2+CPUOffload keeps in RAM, so it also meets an anchor that moves
   the same bytes: FSDP2+CPUOffload's step plus the bytes zero-infinity's store read and wrote in
   the step (both ranks, counted by the store) at fio's sequential bandwidth on the same directory
   (8 MiB blocks, O_DIRECT, libaio, iodepth 8; fio run after the speed part): ``serial`` adds
   reads then writes to the step (bench/nvme_step.py's floor), ``overlapped`` is the larger of the
   step and that I/O (compute hidden under the disk or the disk under compute, the lowest anchor). Without fio on PATH that anchor is
   skipped.
3. **Memory** (2 ranks): each of those setups alone in a fresh pair of processes, built from the
   same fp32 model and stepped ``--warmup + 2`` times; each rank's peak resident memory
   (``ru_maxrss``) beyond what it held once the plain model was built; ``--memory-repeats`` fresh
   pairs each, the median shown (glibc's heap makes identical runs differ by +-15 MiB); tiermem's
   managed peaks per tier apart (on a CPU run the device tier is host memory too).

Ratios come last. DeepSpeed is not installed here (it is no dependency of tiermem), so it is not run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for examples.gpt

from bench._common import CLIP, DATA_PARALLEL_GPT, at_most, free_port, peak_rss, tiered, token_batches, torch_adamw
from bench._fio import sequential_bandwidth
from examples.gpt import GPT, GPTConfig, add_model_args, config_from_args, lm_loss
from tiermem import PerClass, TensorClass, Tier, TieredModel
from tiermem.policies import ZeroInfinity, ZeroOffload
from tiermem.train.weights.weight_shards import shard_key


class WeightsOnHost(PerClass):
    homes = {
        TensorClass.PARAM: Tier.HOST,
        TensorClass.ACTIVATION: Tier.DEVICE,
        TensorClass.GRAD: Tier.HOST,
        TensorClass.OPTIM_STATE: Tier.HOST,
    }


#: setup -> (policy, shard_weights, the weights' home tier)
SETUPS = {
    "zero-infinity": (ZeroInfinity, False, Tier.NVME),
    "weights-on-host": (WeightsOnHost, False, Tier.HOST),
    "shard-weights": (ZeroOffload, True, Tier.DEVICE),
}
ANCHOR = {"zero-infinity": "FSDP2+CPUOffload", "weights-on-host": "FSDP2+CPUOffload", "shard-weights": "FSDP2"}
NUMBERS_CFG = GPTConfig(block_size=32, n_layer=4, n_head=2, n_embd=128, vocab_size=96)
NUMBERS_BUCKET = "64KiB"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, **DATA_PARALLEL_GPT, batch_help="global batch, split over the ranks")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes of the numbers part")
    p.add_argument("--steps", type=int, default=8, help="measured steps per setup (speed)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per setup first")
    p.add_argument("--numbers-steps", type=int, default=3, help="steps of the numbers part")
    p.add_argument("--bucket-size", default="4MiB", help="TieredModel bucket_size of the speed and memory parts")
    p.add_argument("--skip-numbers", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument(
        "--memory-repeats",
        type=int,
        default=3,
        help="fresh pairs of processes per setup in the memory part (the median is shown: a peak "
        "resident set varies by +-15 MiB between identical runs, with glibc's heap)",
    )
    return p.parse_args(argv)


def spawn(fn, world: int, *args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(world, free_port(), fn, args), nprocs=world, join=True)


def _worker(rank: int, world: int, port: int, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )  # a rank that stops makes the others fail, not hang
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def tiermem_model(setup: str, cfg: GPTConfig, *, precision: str, bucket_size, nvme_dir: str) -> TieredModel:
    policy, shard, _ = SETUPS[setup]
    torch.manual_seed(0)
    return tiered(
        GPT(cfg),
        policy(),
        precision=precision,
        bucket_size=bucket_size,
        shard_weights=shard,
        nvme_dir=nvme_dir if setup == "zero-infinity" else None,
    )


# -- 1. numbers ---------------------------------------------------------------------------------------
def numbers_batch(step: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + r)
    b = torch.randint(NUMBERS_CFG.vocab_size, (2, NUMBERS_CFG.block_size + 1), generator=g)
    return b[:, :-1], b[:, 1:]


def numbers_train(tm: TieredModel, micro: list[int], steps: int) -> None:
    for i in range(steps):
        for r in micro:
            x, y = numbers_batch(i, r)
            tm.backward(lm_loss(tm(x), y) / len(micro))
        tm.step()


def du(paths: list[str]) -> int:
    """Bytes the files take on disk (``du``'s allocated blocks)."""
    if not paths:
        return 0
    out = subprocess.run(["du", "-cB1", *paths], capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[-1].split()[0])


def weight_files(directory: str) -> list[str]:
    """The NVMe store's files of working weights (a parameter's, or a rank's chunk of a bucket's)
    under ``directory``: not optimizer state, grads or spare files."""
    return [
        os.path.join(root, f)
        for root, _, files in os.walk(directory)
        for f in files
        if f.endswith(".tmn") and not f.startswith("spare-") and "_state." not in f and "_grad." not in f
    ]


def numbers_rank(rank: int, world: int, steps: int, tmp: str) -> None:
    torch.manual_seed(0)
    zero2 = tiered(GPT(NUMBERS_CFG), ZeroOffload(), precision="fp32", bucket_size=NUMBERS_BUCKET)
    numbers_train(zero2, [rank], steps)
    zero2_state = zero2.state_dict()  # collective: every rank reads it
    out = {"zero2": zero2_state if rank == 0 else None}
    del zero2
    for setup in SETUPS:
        nvme = os.path.join(tmp, f"{setup}-{world}")
        os.makedirs(nvme, exist_ok=True)
        tm = tiermem_model(setup, NUMBERS_CFG, precision="fp32", bucket_size=NUMBERS_BUCKET, nvme_dir=nvme)
        numbers_train(tm, [rank], steps)
        files = du(weight_files(os.path.join(nvme, f"rank{rank}")))
        peak = tm.report().class_peak_bytes
        home = peak.get((TensorClass.PARAM, SETUPS[setup][2]), 0)
        gathered = peak.get((TensorClass.PARAM, Tier.DEVICE), 0)
        if SETUPS[setup][2] == Tier.DEVICE:  # the chunks and the gathered buckets share the device's ledger
            ledger = tm.stores[Tier.DEVICE].ledger
            home = sum(ledger.held(shard_key(b)) for b in tm.gathered.full.values())
            gathered -= home
        sd = tm.state_dict()  # collective
        os.makedirs(nvme + "-bf16", exist_ok=True)
        bf16 = tiermem_model(setup, NUMBERS_CFG, precision="bf16", bucket_size=NUMBERS_BUCKET, nvme_dir=nvme + "-bf16")
        numbers_train(bf16, [rank], steps)
        out[setup] = {
            "home": home,
            "du": files,
            "bf16": {k: v.float() for k, v in bf16.state_dict().items()},
            "gathered": gathered,
        }
        if rank == 0:
            out[setup]["state"] = sd
        del tm, bf16
    torch.save(out, os.path.join(tmp, f"numbers-{world}-{rank}.pt"))


def torch_spread(steps: int, world: int) -> float:
    """How far torch's AdamW variants (for-loop, foreach, fused) land apart on this run."""
    runs = []
    for kw in ({"foreach": False}, {"foreach": True}, {"fused": True}):
        torch.manual_seed(0)
        m = GPT(NUMBERS_CFG)
        opt = torch_adamw(m.parameters(), **kw)
        for i in range(steps):
            for r in range(world):
                x, y = numbers_batch(i, r)
                (lm_loss(m(x), y) / world).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
        runs.append(m.state_dict())
    return max((a[k] - b[k]).abs().max().item() for a in runs for b in runs for k in a)


def numbers(args: argparse.Namespace) -> dict:
    results = {}
    with tempfile.TemporaryDirectory(prefix="tiermem-zero3-", dir=".") as tmp:
        for world in args.ranks:
            t0 = time.perf_counter()
            spawn(numbers_rank, world, args.numbers_steps, tmp)
            ranks = [torch.load(os.path.join(tmp, f"numbers-{world}-{r}.pt")) for r in range(world)]
            spread = torch_spread(args.numbers_steps, world)
            for setup in SETUPS:
                nvme = os.path.join(tmp, f"solo-{setup}-{world}")
                os.makedirs(nvme, exist_ok=True)
                torch.manual_seed(0)
                reference = tiered(
                    GPT(NUMBERS_CFG), ZeroOffload(), precision="fp32", bucket_size=NUMBERS_BUCKET, process_group=False
                )
                numbers_train(reference, list(range(world)), args.numbers_steps)
                solo = tiermem_model(setup, NUMBERS_CFG, precision="fp32", bucket_size=NUMBERS_BUCKET, nvme_dir=nvme)
                numbers_train(solo, [0], 1)  # one process holds every weight at home
                whole = solo.report().class_peak_bytes.get((TensorClass.PARAM, SETUPS[setup][2]), 0)
                whole_du = du(weight_files(nvme))
                ref = reference.state_dict()
                diff = max((ranks[0][setup]["state"][k] - ref[k]).abs().max().item() for k in ref)
                same_as_zero2 = all(torch.equal(ranks[0][setup]["state"][k], ranks[0]["zero2"][k]) for k in ref)
                bf16 = all(
                    torch.equal(ranks[0][setup]["bf16"][k], r[setup]["bf16"][k])
                    for r in ranks[1:]
                    for k in ranks[0][setup]["bf16"]
                )
                results[(world, setup)] = {
                    "diff": diff,
                    "spread": spread,
                    "bf16_identical": bf16,
                    "same_as_zero2": same_as_zero2,
                    "home_ratio": max(r[setup]["home"] for r in ranks) / whole,
                    "gathered_ratio": max(r[setup]["gathered"] for r in ranks) / whole,
                    "du_ratio": (max(r[setup]["du"] for r in ranks) / whole_du) if whole_du else None,
                }
                del solo, reference
            print(f"numbers on {world} ranks: {time.perf_counter() - t0:.0f} s", flush=True)
    return results


# -- 2. speed ---------------------------------------------------------------------------------------
def fsdp2_parts(cfg: GPTConfig, offload: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The GPT under ``fully_shard`` (per block and at the root) and its torch AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    m = GPT(cfg)
    kw = {
        "mesh": init_device_mesh("cpu", (dist.get_world_size(),)),
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    }
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)  # pinning needs an accelerator
    for block in m.blocks:
        fully_shard(block, **kw)
    fully_shard(m, **kw)
    try:
        opt = torch_adamw(m.parameters(), fused=True)
    except (RuntimeError, TypeError, ValueError):
        opt = torch_adamw(m.parameters(), foreach=True)
    return m, opt


def fsdp2(cfg: GPTConfig, offload: bool):
    m, opt = fsdp2_parts(cfg, offload)

    def step(x, y):
        loss = lm_loss(m(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def tiermem_step(setup: str, cfg: GPTConfig, args: argparse.Namespace, nvme: str):
    tm = tiermem_model(setup, cfg, precision="bf16", bucket_size=args.bucket_size, nvme_dir=nvme)

    def step(x, y):
        loss = lm_loss(tm(x), y)
        tm.backward(loss)
        tm.step()
        return loss.detach()

    return step, tm


def make_setup(name: str, cfg: GPTConfig, args: argparse.Namespace, nvme: str):
    if name.startswith("FSDP2"):
        return fsdp2(cfg, offload=name.endswith("CPUOffload")), None
    return tiermem_step(name, cfg, args, nvme)


def batches(args: argparse.Namespace, rank: int, world: int, n: int) -> list:
    return token_batches(args.vocab_size, args.batch_size, args.seq_len, n, rank=rank, world=world)


def speed_rank(rank: int, world: int, args: argparse.Namespace, tmp: str) -> None:
    cfg = config_from_args(args)
    names = ["FSDP2+CPUOffload", "FSDP2", *SETUPS]
    setups = {}
    for name in names:
        nvme = os.path.join(tmp, f"speed-{name}")
        os.makedirs(nvme, exist_ok=True)
        setups[name] = make_setup(name, cfg, args, nvme)
    stores = {name: tm.stores.get(Tier.NVME) for name, (_, tm) in setups.items() if tm is not None}
    times: dict[str, list[float]] = {n: [] for n in names}
    io: dict[str, list[list[float]]] = {n: [] for n, s in stores.items() if s is not None}
    for i, b in enumerate(batches(args, rank, world, args.warmup + args.steps)):
        x, y = b[:, :-1], b[:, 1:]
        for name in names[i % len(names) :] + names[: i % len(names)]:  # rotating order
            store = stores.get(name)
            before = (store.bytes_read, store.bytes_written) if store is not None else (0, 0)
            dist.barrier()
            t0 = time.perf_counter()
            setups[name][0](x, y)
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i >= args.warmup:
                times[name].append(t.item())
            if store is not None and i >= args.warmup:  # what this step moved, every rank's together
                moved = torch.tensor(
                    [store.bytes_read - before[0], store.bytes_written - before[1]], dtype=torch.float64
                )
                dist.all_reduce(moved)
                io[name].append(moved.tolist())
    if rank == 0:
        with open(os.path.join(tmp, "speed.json"), "w") as f:
            json.dump(
                {
                    "median": {n: statistics.median(ts) for n, ts in times.items()},
                    "io": {
                        n: [statistics.median(r for r, _ in v), statistics.median(w for _, w in v)]
                        for n, v in io.items()
                    },
                },
                f,
            )


# -- 3. memory --------------------------------------------------------------------------------------
def memory_rank(rank: int, world: int, name: str, args: argparse.Namespace, tmp: str) -> None:
    cfg = config_from_args(args)
    torch.manual_seed(0)
    GPT(cfg)  # what both kinds of setup start from, once: the plain fp32 model
    before = peak_rss()
    nvme = os.path.join(tmp, f"memory-{name}")
    os.makedirs(nvme, exist_ok=True)
    step, tm = make_setup(name, cfg, args, nvme)
    for b in batches(args, rank, world, args.warmup + 2):
        step(b[:, :-1], b[:, 1:])
    grew = torch.tensor([peak_rss() - before], dtype=torch.float64)
    dist.all_reduce(grew, op=dist.ReduceOp.MAX)
    peaks = tm.report().peak_bytes if tm is not None else {}
    managed = {t.value: peaks.get(t, 0) for t in (Tier.DEVICE, Tier.HOST)}  # as a GPU run sees them: apart
    if rank == 0:
        with open(os.path.join(tmp, f"memory-{name}.json"), "w") as f:
            json.dump({"grew": grew.item(), "managed": managed}, f)


def fio(directory: str, size: str = "1GiB") -> dict[str, float] | None:
    """fio's sequential bandwidth (B/s) on ``directory``, ``write`` and ``read`` (8 MiB blocks,
    O_DIRECT, libaio, iodepth 8, as bench/nvme_step.py), or None without fio."""
    if shutil.which("fio") is None:
        return None
    return sequential_bandwidth(directory, size, {"write": "write", "read": "read"}, name="zero3")


def speed_and_memory(args: argparse.Namespace) -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory(prefix="tiermem-zero3-", dir=".") as tmp:
        t0 = time.perf_counter()
        spawn(speed_rank, 2, args, tmp)
        with open(os.path.join(tmp, "speed.json")) as f:
            speed = json.load(f)
        speed["fio"] = fio(tmp)
        print(f"speed: {time.perf_counter() - t0:.0f} s", flush=True)
        runs: dict[str, list[dict]] = {}
        for _ in range(args.memory_repeats):  # round-robin, so load drifts alike over every setup
            for name in ["FSDP2+CPUOffload", "FSDP2", *SETUPS]:
                spawn(memory_rank, 2, name, args, tmp)
                with open(os.path.join(tmp, f"memory-{name}.json")) as f:
                    runs.setdefault(name, []).append(json.load(f))
        memory = {
            name: {
                "grew": statistics.median(r["grew"] for r in rs),
                "managed": rs[0]["managed"],
                "all": [r["grew"] for r in rs],
            }
            for name, rs in runs.items()
        }
        return speed, memory


def same_bytes_anchor(speed: dict) -> dict[str, float] | None:
    """FSDP2+CPUOffload's step plus zero-infinity's NVMe bytes at fio's bandwidth: ``serial`` (step,
    then reads, then writes) and ``overlapped`` (the larger of the step and the reads and writes)."""
    if not speed.get("fio") or "zero-infinity" not in speed["io"]:
        return None
    (read, written), bw = speed["io"]["zero-infinity"], speed["fio"]
    step, io = speed["median"]["FSDP2+CPUOffload"], read / bw["read"] + written / bw["write"]
    return {"serial": step + io, "overlapped": max(step, io)}


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> int:
    args = parse_args()
    if args.batch_size % 2:
        raise SystemExit(f"--batch-size={args.batch_size}: must be even (one half per rank)")
    os.environ.setdefault("TIERMEM_NO_COMPILE", "1")  # torch's fused AdamW in every rank, not a compile each
    cfg = config_from_args(args)
    n_params = GPT(cfg).num_params()
    print(
        f"torch {torch.__version__}; speed/memory: GPT {cfg.n_layer} x {cfg.n_embd} ({n_params / 1e6:.1f}M "
        f"parameters), global batch {args.batch_size} x {args.seq_len}, 2 gloo ranks, bucket_size "
        f"{args.bucket_size}; numbers: GPT {NUMBERS_CFG.n_layer} x {NUMBERS_CFG.n_embd}, fp32, "
        f"{args.numbers_steps} steps, bucket_size {NUMBERS_BUCKET}",
        flush=True,
    )
    nums = {} if args.skip_numbers else numbers(args)
    speed, memory = ({}, {}) if args.skip_speed else speed_and_memory(args)
    if nums:
        print(
            "\n| ranks | setup | max diff vs one process | torch AdamW spread | bit-identical to ZeRO-2 | "
            "bf16 ranks identical | weights at home per rank / one process (ledger) | (du) | "
            "gathered on the device / one process's weights |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for (world, setup), r in nums.items():
            du_ratio = f"{r['du_ratio']:.3f}" if r["du_ratio"] is not None else "-"
            print(
                f"| {world} | {setup} | {r['diff']:.2e} | {r['spread']:.2e} | {r['same_as_zero2']} | "
                f"{r['bf16_identical']} | {r['home_ratio']:.3f} | {du_ratio} | {r['gathered_ratio']:.3f} |"
            )
    if speed:
        print(
            f"\n| setup | step (median of {args.steps}) | peak RSS growth per rank (median of "
            f"{args.memory_repeats}) | (each run, MiB) | tiermem's managed peak: device / host tier |"
        )
        print("|---|---|---|---|---|")
        for name, t in speed["median"].items():
            m = memory[name]
            each = ", ".join(f"{g / 2**20:.0f}" for g in m["all"])
            managed = (
                f"{mib(m['managed']['device'])} / {mib(m['managed']['host'])}" if any(m["managed"].values()) else "-"
            )
            print(f"| {name} | {1e3 * t:.0f} ms | {mib(m['grew'])} | {each} | {managed} |")
    print("\n== ratios ==")
    for (world, setup), r in nums.items():
        ok = "within" if r["diff"] <= max(r["spread"], 1e-7) else "OUTSIDE"
        print(
            f"{world} ranks, {setup + ':':<17} weights at home per rank / one process {r['home_ratio']:.3f} "
            f"(1/{world} = {1 / world:.3f}); numbers {ok} torch's spread, bit-identical to ZeRO-2's: "
            f"{r['same_as_zero2']}; bf16 ranks identical: {r['bf16_identical']}"
        )
    same_bytes = same_bytes_anchor(speed) if speed else None
    if same_bytes:
        (read, written), bw = speed["io"]["zero-infinity"], speed["fio"]
        print(
            f"\nzero-infinity moved {read / 2**20:.1f} MiB read + {written / 2**20:.1f} MiB written per step "
            f"(both ranks, the store's counts); fio on the same directory: read {bw['read'] / 1e9:.2f} GB/s, "
            f"write {bw['write'] / 1e9:.2f} GB/s; anchor = FSDP2+CPUOffload's step "
            f"{1e3 * speed['median']['FSDP2+CPUOffload']:.0f} ms with that I/O: serial "
            f"{1e3 * same_bytes['serial']:.0f} ms, overlapped {1e3 * same_bytes['overlapped']:.0f} ms"
        )
    for setup, anchor in ANCHOR.items():
        if speed:
            ratio = speed["median"][setup] / speed["median"][anchor]
            mem = memory[setup]["grew"] / memory[anchor]["grew"]
            print(
                f"{setup + ':':<17} step / {anchor} {ratio:.2f}x ("
                f"{at_most(ratio, 1.10)}); peak RSS growth / {anchor} {mem:.2f}x"
            )
    if same_bytes:
        for kind, anchor_s in same_bytes.items():
            ratio = speed["median"]["zero-infinity"] / anchor_s
            print(
                f"{'zero-infinity:':<17} step / (FSDP2+CPUOffload + the same NVMe bytes, {kind}) {ratio:.2f}x "
                f"({at_most(ratio, 1.10)})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
