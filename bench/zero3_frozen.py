"""A LoRA model's frozen base sharded over 2 ranks (NOTE [Frozen weights sharded over the ranks])
against the same base replicated on each rank (the previous behaviour), and against one process.

    python bench/zero3_frozen.py [--setups weights-on-host zero-infinity] [--steps 6] [--repeats 3]
                                 [--hidden 256 --layers 4 --vocab 2048] [--batch-size 4 --seq-len 64]
                                 [--bucket-size 2MiB]

A tiny Llama built from a config (never downloaded) wrapped by ``peft`` LoRA on the attention and
MLP projections (r=8), fp32, each rank its own micro-batch. Per setup: the weights' home tier's
ledger peak for PARAM (frozen + trainable working weights at home; on NVMe also ``du`` of the rank's
directory) per rank at 2 ranks, sharded and replicated, against one process; and the step time at 2
ranks, sharded against replicated, the two run alternately in fresh pairs of gloo ranks
(``--repeats`` each; per run the median of its steps after the first; the median of the runs).
"Replicated" is this version with the frozen buckets switched off (``frozen_buckets`` patched to
return none, in the ranks only): the code path before the change, reachable in the same run.

    python bench/zero3_frozen.py --save [--setups zero-infinity] [--repeats 3] [--hidden 512 --vocab 8192]

With ``--save``: the memory a DCP save (``tm.save(dir)``) adds to each rank's resident set (its
peak RSS during the save, VmHWM reset just before it, minus its RSS before), 2 ranks sharding the
frozen base, each writing its own pieces of it (NOTE [Frozen weights sharded over the ranks]),
against the same with the save of the previous version ("gathered": every rank gathers each frozen
parameter, rank 0 keeps them all and writes them; reached in this version by patching the ranks'
save to do that), and against one process's save (the base whole at its home), after one step.
The same fresh pairs of gloo ranks run alternately, ``--repeats`` each; the median per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for bench.zero3

from bench._common import llama_config
from bench.zero3 import WeightsOnHost, spawn
from tiermem import AdamW, TensorClass, Tier, TieredModel
from tiermem.policies import ZeroInfinity

MiB = 2**20


SETUPS = {"weights-on-host": (WeightsOnHost, Tier.HOST), "zero-infinity": (ZeroInfinity, Tier.NVME)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--bucket-size", default="2MiB", help="a few buckets of the frozen base, not one")
    p.add_argument("--save", action="store_true", help="measure a DCP save's added RSS per rank instead")
    return p.parse_args(argv)


def lora_model(args: argparse.Namespace) -> torch.nn.Module:
    import peft
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = llama_config(
        hidden=args.hidden,
        layers=args.layers,
        intermediate=args.hidden * 8 // 3,
        heads=4,
        vocab=args.vocab,
        max_position_embeddings=args.seq_len,
        use_cache=False,
    )
    lora = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    return peft.get_peft_model(transformers.LlamaForCausalLM(cfg), lora)


def batch(args: argparse.Namespace, step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=g)
    return {"input_ids": ids, "labels": ids}


def du(path: str) -> int:
    return int(subprocess.run(["du", "-sb", path], check=True, capture_output=True, text=True).stdout.split()[0])


def measure(tm: TieredModel, args: argparse.Namespace, rank: int, home: Tier) -> dict:
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        tm.backward(tm(**batch(args, i, rank)).loss)
        tm.step()
        times.append(time.perf_counter() - t0)
    rep = tm.report()
    return {
        "step_s": statistics.median(times[1:]) if len(times) > 1 else times[0],
        "home_param_peak": rep.class_peak_bytes.get((TensorClass.PARAM, home), 0),
        "du": du(tm.stores[Tier.NVME].directory) if home == Tier.NVME else 0,
    }


def du_text(r: dict) -> str:
    return f" (du {r['du'] / MiB:.1f} MiB)" if r["du"] else ""


def make(setup: str, args: argparse.Namespace, nvme: str) -> TieredModel:
    policy, _ = SETUPS[setup]
    return TieredModel(
        lora_model(args),
        policy(),
        optimizer=AdamW(lr=1e-4),
        precision="fp32",
        nvme_dir=nvme,
        bucket_size=args.bucket_size,
    )


def rank_main(rank: int, world: int, setup: str, variant: str, args: argparse.Namespace, tmp: str, out: str) -> None:
    warnings.filterwarnings("ignore")
    if variant == "replicated":  # the path before frozen weights were sharded: no frozen buckets
        import tiermem.model.build as build_module
        import tiermem.plan.footprint as footprint_module

        build_module.frozen_buckets = footprint_module.frozen_buckets = lambda *a, **k: []  # type: ignore[assignment]
    tm = make(setup, args, tmp)
    result = measure(tm, args, rank, SETUPS[setup][1])
    if rank == 0:
        Path(out).write_text(json.dumps(result))


# -- --save: the memory a DCP save adds per rank -----------------------------------------------------
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def save_rss(tm: TieredModel, args: argparse.Namespace, rank: int, path: str) -> int:
    """Bytes a ``tm.save(path)`` after one step adds to this process's peak resident set."""
    import ctypes
    import gc

    tm.backward(tm(**batch(args, 0, rank)).loss)
    tm.step()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the system: the save's bytes show in RSS
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)
    before = _status_kib("VmRSS")
    tm.save(path)
    return (_status_kib("VmHWM") - before) * 1024


def _gather_at_save() -> None:
    """The previous version's DCP save, in this one: no frozen pieces; every rank reads each
    frozen parameter gathered over the ranks and rank 0 keeps them all and writes them."""
    from tiermem.checkpoint import dcp_save
    from tiermem.checkpoint.view import StateReader

    rest = StateReader.rest

    def whole_rest(self, *, pieces: bool = False):
        return rest(self)  # the sharded frozen parameters gathered, whole

    def no_pieces(state, source):
        frozen = state.layout.frozen
        if not state.writes_files:  # the collective reads rank 0's whole_rest makes, each value dropped
            for name in frozen:
                if frozen.collective(name):
                    frozen.value(name)
        return {}

    StateReader.rest = whole_rest  # type: ignore[method-assign]
    dcp_save.frozen_pieces = no_pieces  # type: ignore[assignment]


def save_rank_main(rank: int, world: int, setup: str, variant: str, args: argparse.Namespace, tmp: str) -> None:
    warnings.filterwarnings("ignore")
    if variant == "gathered":
        _gather_at_save()
    tm = make(setup, args, tmp)
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(save_rss(tm, args, rank, os.path.join(tmp, "ckpt"))))


def main_save(args: argparse.Namespace) -> None:
    for setup in args.setups:
        runs: dict[str, list[list[int]]] = {"gathered": [], "pieces": []}
        solos = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as d:  # one process (in a fresh one, as the ranks)
                spawn(save_rank_main, 1, setup, "pieces", args, d)
                solos.append(json.loads(Path(d, "rank0.json").read_text()))
            for variant in ("gathered", "pieces"):  # alternately: the load moves both alike
                with tempfile.TemporaryDirectory() as d:
                    spawn(save_rank_main, 2, setup, variant, args, d)
                    runs[variant].append([json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(2)])
        solo = statistics.median(solos)
        med = {v: [statistics.median(run[r] for run in rs) for r in range(2)] for v, rs in runs.items()}
        print(f"\n| {setup}: RSS a DCP save adds | rank 0 | rank 1 | (each run, MiB) |")
        print("|---|---|---|---|")
        print(f"| one process | {solo / MiB:.1f} MiB | - | {[round(x / MiB, 1) for x in solos]} |")
        for v in ("gathered", "pieces"):
            each = [[round(x / MiB, 1) for x in run] for run in runs[v]]
            print(f"| 2 ranks, {v} | {med[v][0] / MiB:.1f} MiB | {med[v][1] / MiB:.1f} MiB | {each} |")
        print("\n== ratios ==")
        for v in ("gathered", "pieces"):
            print(
                f"{setup}: save's added RSS per rank / one process's, {v}: "
                f"rank 0 {med[v][0] / solo:.2f}x, rank 1 {med[v][1] / solo:.2f}x"
            )
        print(f"{setup}: rank 0's save, pieces / gathered: {med['pieces'][0] / med['gathered'][0]:.2f}x")


def main(argv=None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TIERMEM_NO_COMPILE", "1")  # the ranks run torch's fused AdamW; so does one process
    torch.set_num_threads(1)
    frozen = sum(p.numel() for p in lora_model(args).parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in lora_model(args).parameters() if p.requires_grad)
    print(
        f"LoRA Llama {args.layers} x {args.hidden}: {frozen / 1e6:.2f}M frozen, {trainable / 1e6:.3f}M trainable, fp32"
    )
    if args.save:
        main_save(args)
        return
    rows = {}
    for setup in args.setups:
        home = SETUPS[setup][1]
        with tempfile.TemporaryDirectory() as d:
            solo = measure(make(setup, args, d), args, 0, home)
        runs: dict[str, list[dict]] = {"replicated": [], "sharded": []}
        for _ in range(args.repeats):
            for variant in ("replicated", "sharded"):  # alternately: the load moves both alike
                with tempfile.TemporaryDirectory() as d:
                    out = os.path.join(d, "result.json")
                    spawn(rank_main, 2, setup, variant, args, d, out)
                    runs[variant].append(json.loads(Path(out).read_text()))
        rows[setup] = (solo, runs)
    print(
        "\n| setup | PARAM at home: 1 process | 2 ranks replicated (per rank) | 2 ranks sharded (per rank) | step: replicated | sharded (each run, ms) |"
    )
    print("|---|---|---|---|---|---|")
    for setup, (solo, runs) in rows.items():
        rep, sh = runs["replicated"][0], runs["sharded"][0]
        ms = {v: [round(r["step_s"] * 1e3) for r in rs] for v, rs in runs.items()}
        print(
            f"| {setup} | {solo['home_param_peak'] / MiB:.1f} MiB{du_text(solo)} "
            f"| {rep['home_param_peak'] / MiB:.1f} MiB{du_text(rep)} | {sh['home_param_peak'] / MiB:.1f} MiB{du_text(sh)} "
            f"| {statistics.median(ms['replicated'])} ms {ms['replicated']} | {statistics.median(ms['sharded'])} ms {ms['sharded']} |"
        )
    print("\n== ratios ==")
    for setup, (solo, runs) in rows.items():
        rep, sh = runs["replicated"][0], runs["sharded"][0]
        step = statistics.median(r["step_s"] for r in runs["sharded"]) / statistics.median(
            r["step_s"] for r in runs["replicated"]
        )
        line = (
            f"{setup}: weights at home per rank / one process: sharded {sh['home_param_peak'] / solo['home_param_peak']:.2f}x, "
            f"replicated {rep['home_param_peak'] / solo['home_param_peak']:.2f}x"
        )
        if solo["du"]:
            line += f" (du: sharded {sh['du'] / solo['du']:.2f}x, replicated {rep['du'] / solo['du']:.2f}x)"
        print(f"{line}; step sharded / replicated {step:.2f}x")


if __name__ == "__main__":
    main()
