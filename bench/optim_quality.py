"""Optimizer state formats over 500 steps: final loss against fp32 AdamW and torchao's AdamW8bit.

    python bench/optim_quality.py                          # both models, 500 steps, seeds 0 1 2
    python bench/optim_quality.py --model llama --plot q.png --json q.json
    python bench/optim_quality.py --model gpt --seeds 1 --rounds 0 --json gpt-1.json   # one process a seed,
    python bench/optim_quality.py --merge gpt-*.json --plot gpt.png                   # then reported together

Models: the example GPT (examples/gpt.py, the "small" preset at 2 layers, 64 wide, 32-token
contexts: 0.11M parameters, so that the 36 runs of 500 steps fit a loaded 2-core machine) and the
tests' tiny Llama (tests/test_transformers.py's config, widened to 64 so that most of its matrices
pass the 4,096-element threshold below which both tiermem and torchao keep fp32 state), trained on the shipped corpus (character tokens) with
train_gpt's schedule (linear warm-up, cosine decay to 10%), grad clip 1.0, betas (0.9, 0.95),
weight decay 0.1.

Options, each from the same seeds (the model's initial weights and the batches):
- through TieredModel (ZeroOffload, bf16): AdamW with fp32 state (the anchor), AdamW8bit, AdamW
  with bf16 master weights (stochastic rounding), AdamW8bit + bf16 master;
- eager torch (fp32 weights, bf16 autocast, ``clip_grad_norm_``): ``torch.optim.AdamW`` and
  torchao's ``AdamW8bit`` (``pip install -e '.[bench]'``; its column is skipped, with the reason
  printed, where torchao is not installed).
The final loss is the mean training loss of the last 20 steps; the held-out loss is 8 batches of
the last 10% of the corpus. Every option's figures are the mean and sample spread over the seeds.

Speed: the optimizer step of tiermem's AdamW8bit (``tm.step()``: grad norm, clip, the fused 8-bit
step, weights written back) against torchao's (``clip_grad_norm_`` + ``opt.step()``) on the same
model, interleaved rounds, median; the ratio is printed last. One torch thread by default: under
load from other processes, torch's two-thread ops (each a parallel region whose threads wait for
each other) ran forward+backward 10x slower here than one thread did.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tiermem
from bench._common import llama_config
from examples.gpt import GPT, GPTConfig, lm_loss, load_tokens
from examples.train_gpt import get_batch, lr_factor
from tiermem import TieredModel
from tiermem.policies import ZeroOffload

SEQ = 32  # tokens per sequence, both models
HYPER = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
ANCHOR = "tiermem AdamW (fp32 state)"
TIERMEM = {
    ANCHOR: lambda ps, lr: tiermem.AdamW(ps, lr=lr, **HYPER),
    "tiermem AdamW8bit": lambda ps, lr: tiermem.AdamW8bit(ps, lr=lr, **HYPER),
    "tiermem AdamW bf16 master (SR)": lambda ps, lr: tiermem.AdamW(ps, lr=lr, bf16_stochastic_round=True, **HYPER),
    "tiermem AdamW8bit + bf16 master": lambda ps, lr: tiermem.AdamW8bit(ps, lr=lr, bf16_stochastic_round=True, **HYPER),
}
TORCHAO = "torchao AdamW8bit"
EAGER: dict[str, Callable] = {"torch AdamW": lambda ps, lr: torch.optim.AdamW(ps, lr=lr, **HYPER)}
try:
    from torchao.optim import AdamW8bit as _AoAdamW8bit

    EAGER[TORCHAO] = lambda ps, lr: _AoAdamW8bit(ps, lr=lr, **HYPER)
    NO_TORCHAO = ""
except ImportError as e:  # the bench extra is not installed
    NO_TORCHAO = f"torchao is not importable ({e}); pip install -e '.[bench]' for its column"
OPTIONS = [*TIERMEM, *EAGER]


def gpt_model(vocab: int) -> tuple[torch.nn.Module, int]:
    """The example GPT, small preset at 2 layers, 64 wide, 32-token contexts (0.11M parameters)."""
    cfg = GPTConfig.preset("small", vocab_size=vocab, n_layer=2, n_embd=64, block_size=SEQ)
    return GPT(cfg), cfg.block_size


def llama_model(vocab: int) -> tuple[torch.nn.Module, int]:
    """tests/test_transformers.py's Llama (2 layers, 4 heads, 2 KV heads, untied), 64 wide."""
    import transformers

    seq = SEQ
    cfg = llama_config(
        hidden=64,
        layers=2,
        intermediate=128,
        heads=4,
        kv_heads=2,
        vocab=vocab,
        max_position_embeddings=seq,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg), seq


MODELS = {"gpt": gpt_model, "llama": llama_model}


def logits_of(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def train(model_name: str, option: str, seed: int, args, data) -> dict:
    """One run: per-step training losses, the held-out loss, the median optimizer step time."""
    train_data, val_data, vocab = data
    torch.manual_seed(seed)
    model, seq = MODELS[model_name](vocab)
    sched_fn = lr_factor(min(50, args.steps // 10), args.steps, 0.1)
    gen = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    step_s: list[float] = []
    if option in TIERMEM:
        tm = TieredModel(
            model,
            ZeroOffload(),
            optimizer=TIERMEM[option](model.parameters(), args.lr),
            precision="bf16",
            grad_clip=1.0,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(tm.optimizer, sched_fn)
        for _ in range(args.steps):
            x, y = get_batch(train_data, args.batch_size, seq, gen)
            loss = lm_loss(logits_of(tm(x)), y)
            tm.backward(loss)
            t0 = time.perf_counter()
            tm.step()
            step_s.append(time.perf_counter() - t0)
            sched.step()
            losses.append(loss.item())
        forward: Callable = tm
        tm.eval()
    else:
        opt = EAGER[option](model.parameters(), args.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, sched_fn)
        for _ in range(args.steps):
            x, y = get_batch(train_data, args.batch_size, seq, gen)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = lm_loss(logits_of(model(x)), y)
            loss.backward()
            t0 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step_s.append(time.perf_counter() - t0)
            sched.step()
            losses.append(loss.item())
        model.eval()

        def forward(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(x)

    vgen = torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        held = statistics.mean(
            lm_loss(logits_of(forward(x)), y).item()
            for x, y in (get_batch(val_data, args.batch_size, seq, vgen) for _ in range(8))
        )
    if option in TIERMEM:
        tm.detach()
    return {
        "seed": seed,
        "losses": losses,
        "final": statistics.mean(losses[-20:]),
        "held": held,
        "step_ms": 1e3 * statistics.median(step_s[5:]),  # the first steps build and warm the kernels
    }


def speed(model_name: str, args, data) -> dict[str, float]:
    """Median optimizer step (ms) of tiermem's and torchao's 8-bit AdamW on the same model, interleaved."""
    train_data, _, vocab = data
    torch.manual_seed(0)
    m_tm, seq = MODELS[model_name](vocab)
    tm = TieredModel(
        m_tm,
        ZeroOffload(),
        optimizer=tiermem.AdamW8bit(m_tm.parameters(), lr=1e-4, **HYPER),
        precision="bf16",
        grad_clip=1.0,
    )
    torch.manual_seed(0)
    m_ao, _ = MODELS[model_name](vocab)
    ao = EAGER[TORCHAO](m_ao.parameters(), 1e-4)
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"tiermem AdamW8bit": [], TORCHAO: []}
    for r in range(args.rounds + 2):  # two warm-up rounds
        x, y = get_batch(train_data, args.batch_size, seq, gen)
        tm.backward(lm_loss(logits_of(tm(x)), y))
        t0 = time.perf_counter()
        tm.step()
        t1 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lm_loss(logits_of(m_ao(x)), y).backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(m_ao.parameters(), 1.0)
        ao.step()
        ao.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if r >= 2:
            times["tiermem AdamW8bit"].append(t1 - t0)
            times[TORCHAO].append(t3 - t2)
    tm.detach()
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def spread(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def summarize(model_name: str, runs: dict[str, list[dict]], sp: dict[str, float]) -> list[str]:
    """The table and ratios of one model, as lines (the speed part alone where ``runs`` is empty)."""
    lines = [f"== {model_name}: final loss (mean of the last 20 steps) and held-out loss, mean +- stdev over seeds"]
    if not runs:
        lines = []
    mean = {o: statistics.mean(r["final"] for r in rs) for o, rs in runs.items()}
    for o, rs in runs.items():
        finals = [r["final"] for r in rs]
        helds = [r["held"] for r in rs]
        lines.append(
            f"  {o:34s} final {mean[o]:.4f} +- {spread(finals):.4f} (seeds {', '.join(f'{f:.4f}' for f in finals)}); "
            f"held-out {statistics.mean(helds):.4f} +- {spread(helds):.4f}; "
            f"step {statistics.median(r['step_ms'] for r in rs):.1f} ms"
        )
    if runs:
        lines.append(f"== {model_name}: ratios against {ANCHOR!r}, seed by seed (mean, min..max)")
    for o, rs in runs.items():
        ratios = [r["final"] / a["final"] for r, a in zip(rs, runs[ANCHOR])]
        hr = [r["held"] / a["held"] for r, a in zip(rs, runs[ANCHOR])]
        lines.append(
            f"  {o:34s} final {statistics.mean(ratios):.4f}x ({min(ratios):.4f}..{max(ratios):.4f}); "
            f"held-out {statistics.mean(hr):.4f}x ({min(hr):.4f}..{max(hr):.4f})"
        )
    if TORCHAO in runs:
        ao = [r["final"] for r in runs[TORCHAO]]
        for o in ("tiermem AdamW8bit", "tiermem AdamW8bit + bf16 master"):
            harness = (
                f"; torch AdamW - tiermem AdamW, the two harnesses' own difference: "
                f"{mean['torch AdamW'] - mean[ANCHOR]:+.4f}"
                if "torch AdamW" in mean
                else ""
            )
            if o in mean:
                d = mean[o] - mean[TORCHAO]
                ok = "within" if abs(d) <= spread(ao) else "outside"
                lines.append(
                    f"  {o} - torchao AdamW8bit: {d:+.4f} ({ok} torchao's seed spread +-{spread(ao):.4f}{harness})"
                )
    if sp:
        lines.append(
            f"== {model_name}: optimizer step, interleaved, median: tiermem AdamW8bit {sp['tiermem AdamW8bit']:.1f} ms, "
            f"torchao AdamW8bit {sp[TORCHAO]:.1f} ms"
        )
        lines.append(
            f"tiermem AdamW8bit step faster than torchao AdamW8bit: {sp[TORCHAO] / sp['tiermem AdamW8bit']:.1f}x"
        )
    return lines


def plot(path: str, results: dict[str, dict[str, list[dict]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    for ax, (model_name, runs) in zip(axes[0], results.items()):
        for o, rs in runs.items():
            curve = [statistics.mean(v) for v in zip(*(r["losses"] for r in rs))]
            k = 10  # a moving mean over 10 steps: the batches are small and the raw curve is noise
            smooth = [statistics.mean(curve[max(0, i - k + 1) : i + 1]) for i in range(len(curve))]
            ax.plot(smooth, label=o, linestyle="--" if o in EAGER else "-")
        ax.set(title=f"{model_name}: training loss (mean over seeds, 10-step mean)", xlabel="step", ylabel="loss")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"curves written to {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["gpt", "llama", "both"], default="both")
    p.add_argument("--steps", type=int, default=500, help="training steps per run (0: the speed part only)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rounds", type=int, default=15, help="interleaved optimizer steps timed per option (0: none)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads; 1 by default: on a shared 2-core machine two threads per op ran 10x slower",
    )
    p.add_argument("--only", default=",".join(OPTIONS), help="a comma-separated subset of the options")
    p.add_argument("--plot", default=None, help="write the loss curves to this image (matplotlib)")
    p.add_argument("--json", default=None, help="write every run's losses and figures to this file")
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="train nothing: report the runs of these --json files (e.g. one process per seed) together",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results: dict[str, dict[str, list[dict]]] = {}
    speeds: dict[str, dict[str, float]] = {}
    if args.merge:
        for path in args.merge:
            got = json.loads(Path(path).read_text())
            for model_name, runs in got["results"].items():
                for o, rs in runs.items():
                    results.setdefault(model_name, {}).setdefault(o, []).extend(rs)
            speeds.update(got["speed"])
        for runs in results.values():  # seed order, so that ratios pair each run with its anchor
            for rs in runs.values():
                rs.sort(key=lambda r: r["seed"])
    else:
        if NO_TORCHAO:
            print(f"skipping {TORCHAO}: {NO_TORCHAO}")
        chosen = [o for o in OPTIONS if o in args.only.split(",")]
        if ANCHOR not in chosen:
            chosen.insert(0, ANCHOR)
        tok, tokens = load_tokens()
        split = int(0.9 * len(tokens))
        data = (tokens[:split], tokens[split:], tok.vocab_size)
        for model_name in ["gpt", "llama"] if args.model == "both" else [args.model]:
            runs = {o: [] for o in chosen}
            for seed in args.seeds if args.steps else []:  # --steps 0: the speed part only
                for o in chosen:  # options interleaved seed by seed: load on the machine falls on all alike
                    t0 = time.perf_counter()
                    r = train(model_name, o, seed, args, data)
                    runs[o].append(r)
                    print(
                        f"{model_name} seed {seed} {o:34s} loss {r['losses'][0]:.4f} -> final {r['final']:.4f}, "
                        f"held-out {r['held']:.4f}; step {r['step_ms']:.1f} ms; run {time.perf_counter() - t0:.0f} s",
                        flush=True,
                    )
            if args.steps:
                results[model_name] = runs
            if args.rounds and TORCHAO in chosen and "tiermem AdamW8bit" in chosen:
                speeds[model_name] = speed(model_name, args, data)
        if args.json:
            Path(args.json).write_text(json.dumps({"results": results, "speed": speeds}))
    if args.plot:
        plot(args.plot, results)
    ok = True
    for model_name, sp in speeds.items():
        if model_name not in results:
            print("\n".join(summarize(model_name, {}, sp)))
    for model_name, runs in results.items():
        print("\n".join(summarize(model_name, runs, speeds.get(model_name, {}))))
        ok &= all(math.isfinite(r["final"]) for rs in runs.values() for r in rs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
