"""A placement policy of your own, in a few lines, trained on the GPT of examples/gpt.py.

    python examples/custom_policy.py                    # preset 'small', 5 steps
    python examples/custom_policy.py --preset tiny --steps 3 --nvme-dir /mnt/nvme/scratch

The policy below is ZeRO-Offload with two exceptions: the optimizer state of the embeddings
(``wte``, tied to the output head, and ``wpe``) lives on NVMe, and the working weights of the
largest matrices (the MLPs') live on the host, coming to the device only while their module runs.
The run then shows that the placements were honoured, from ``tm.report()``: bytes per
(class, tier) against what the policy asked for. Last, it trains the same model on the same
batches under plain ``ZeroOffload()`` and checks that losses and weights are bit for bit the
same: placement moves bytes, never the numbers (on a machine without an accelerator, where every
policy's step runs on the same processor).

Exit status 0 when both checks pass, 1 otherwise.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections import defaultdict
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python examples/custom_policy.py` from anywhere

from examples.gpt import GPT, PRESETS, GPTConfig, lm_loss, load_tokens
from examples.train_gpt import get_batch
from tiermem import AdamW, Policy, Report, TensorClass, TensorInfo, Tier, TieredModel
from tiermem.config.specs import resolve_precision, working_dtype
from tiermem.errors import fmt_bytes
from tiermem.policies import ZeroOffload


# -- the policy: this is all a user writes --------------------------------------------------------
@dataclass(frozen=True)
class EmbeddingStateOnNvme(Policy):
    """ZeRO-Offload, except: optimizer state of the embeddings on NVMe; working weights of at
    least ``big_weight_bytes`` on the host."""

    _: KW_ONLY
    big_weight_bytes: int
    embeddings: tuple[str, ...] = ("wte", "wpe")  # module names

    def place(self, info: TensorInfo) -> Tier:
        if info.kind is TensorClass.OPTIM_STATE and info.module in self.embeddings:
            return Tier.NVME
        if info.kind is TensorClass.PARAM and info.nbytes >= self.big_weight_bytes:
            return Tier.HOST
        return ZeroOffload().place(info)


# -- the rest of the example: train, then check --------------------------------------------------
# bf16 where the device computes it natively, else fp32 (NOTE [Choosing the precision] in tiermem/config/precision.py)
PRECISION = resolve_precision("auto", torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="small", help="model size (examples/gpt.py)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per run")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument(
        "--nvme-dir",
        default=None,
        help="directory for the NVMe tier (default: a temporary one under the current directory, removed afterwards)",
    )
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be at least 1")
    return args


def train(model: GPT, policy: Policy, batches: list, nvme_dir: Optional[str]) -> tuple[TieredModel, list[float]]:
    tm = TieredModel(
        model,
        policy,
        optimizer=AdamW(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1),
        precision=PRECISION,
        grad_clip=1.0,
        nvme_dir=nvme_dir,
    )
    losses = []
    for x, y in batches:
        loss = lm_loss(tm(x), y)
        tm.backward(loss)
        tm.step()
        losses.append(loss.item())
    return tm, losses


def asked_bytes(
    model: GPT, policy: Policy, dtype: torch.dtype
) -> tuple[dict[tuple[TensorClass, Tier], int], dict[str, Tier]]:
    """Home bytes per (class, tier) that ``policy`` asks for (working weights in ``dtype``, fp32
    grads, fp32 master + exp_avg + exp_avg_sq), and each weight's home tier. Tied weights count
    once, under their first name."""
    asked: dict[tuple[TensorClass, Tier], int] = defaultdict(int)
    weight_homes: dict[str, Tier] = {}
    for name, p in model.named_parameters():  # duplicates (the tied head) removed
        mod = name.rpartition(".")[0]
        shape = tuple(p.shape)
        home = weight_homes[name] = policy.place(
            TensorInfo(name, TensorClass.PARAM, p.numel() * dtype.itemsize, shape, dtype, mod)
        )
        asked[(TensorClass.PARAM, home)] += p.numel() * dtype.itemsize
        asked[
            (
                TensorClass.GRAD,
                policy.place(TensorInfo(name, TensorClass.GRAD, p.numel() * 4, shape, torch.float32, mod)),
            )
        ] += p.numel() * 4
        state_tier = policy.place(
            TensorInfo(f"{name}:master", TensorClass.OPTIM_STATE, p.numel() * 4, shape, torch.float32, mod)
        )
        asked[(TensorClass.OPTIM_STATE, state_tier)] += p.numel() * 12
    return dict(asked), weight_homes


# What may show up besides a class's home bytes, and why (printed next to the figures).
WORKING_SET = {
    (TensorClass.PARAM, Tier.DEVICE): "+ copies of host-homed weights while in use (kept while the device has room)",
    (TensorClass.PARAM, Tier.HOST): f"+ 2 staging buffers for Adam's new {PRECISION} weights",
    (TensorClass.GRAD, Tier.DEVICE): f"{PRECISION} grads in flight to the host during backward",
    (TensorClass.OPTIM_STATE, Tier.HOST): "+ 3 pipeline buffer sets for the state streamed from NVMe",
    (TensorClass.OPTIM_STATE, Tier.NVME): "x2 at the peak: each write lands beside its key's value, then replaces it",
    (TensorClass.ACTIVATION, Tier.DEVICE): "saved for backward (the policy keeps them on the device)",
}


def check_placements(
    tm: TieredModel, asked: dict[tuple[TensorClass, Tier], int], weight_homes: dict[str, Tier], ref: Report
) -> list[str]:
    """Print asked vs reported bytes per (class, tier), next to the ZeroOffload run's; return the
    placements that were not honoured."""
    peaks = tm.report().class_peak_bytes
    order = {k: i for i, k in enumerate((c, t) for c in TensorClass for t in Tier)}
    keys = sorted(
        set(asked) | {k for k, v in peaks.items() if v} | {k for k, v in ref.class_peak_bytes.items() if v},
        key=order.__getitem__,
    )
    print(f"\n{'class':<12}{'tier':<8}{'policy asked':>14}{'report peak':>14}{'ZeroOffload':>14}   note")
    for key in keys:
        a, got, theirs = asked.get(key, 0), peaks.get(key, 0), ref.class_peak_bytes.get(key, 0)
        print(
            f"{key[0].value:<12}{key[1].value:<8}{fmt_bytes(a) if a else '-':>14}{fmt_bytes(got):>14}"
            f"{fmt_bytes(theirs):>14}   {WORKING_SET.get(key, '') if got else ''}"
        )
    problems = []
    for (kind, tier), a in asked.items():
        # on NVMe each write goes beside its key's value until it lands: the peak holds both
        want = 2 * a if (kind, tier) == (TensorClass.OPTIM_STATE, Tier.NVME) else a
        if peaks.get((kind, tier), 0) < want:
            problems.append(f"{kind} on {tier}: report shows {peaks.get((kind, tier), 0)} B, policy asked {want} B")
    for name, home in weight_homes.items():  # each off-device weight is held at its home, under its name
        p = tm.module.get_parameter(name)
        if home is not Tier.DEVICE and tm.stores[home].ledger.held(name) < p.numel() * tm.dtype.itemsize:
            problems.append(f"the weights of {name} are not held on {home}, their home")
    if peaks.get((TensorClass.OPTIM_STATE, Tier.DEVICE), 0):
        problems.append("optimizer state showed up on the device, where the policy put none")
    nvme_other = [f"{c}" for (c, t), v in peaks.items() if t is Tier.NVME and v and c is not TensorClass.OPTIM_STATE]
    if nvme_other:
        problems.append(f"the NVMe tier held {', '.join(nvme_other)}; the policy put only optimizer state there")
    return problems


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    tok, data = load_tokens()
    cfg = GPTConfig.preset(args.preset, vocab_size=tok.vocab_size, block_size=args.seq_len)
    gen = torch.Generator().manual_seed(args.seed)
    batches = [get_batch(data, args.batch_size, args.seq_len, gen) for _ in range(args.steps)]

    def fresh_model() -> GPT:
        torch.manual_seed(args.seed)  # the same initial weights for both runs
        return GPT(cfg)

    model = fresh_model()
    # "The largest layers": the MLP matrices, 4 * n_embd^2 weights each (bf16: 2 bytes a weight).
    dtype = working_dtype(PRECISION)
    policy = EmbeddingStateOnNvme(big_weight_bytes=dtype.itemsize * 4 * cfg.n_embd * cfg.n_embd)
    asked, weight_homes = asked_bytes(model, policy, dtype)
    print(f"model: preset {args.preset!r}, {model.num_params():,} parameters; policy {policy}")

    nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="tiermem-custom-policy-", dir=".")
    try:
        tm, losses = train(model, policy, batches, nvme_dir)
        for i, loss in enumerate(losses, 1):
            print(f"step {i}/{args.steps} | loss {loss:.4f}")
        print(f"\n{tm.report()}")
        ref, ref_losses = train(fresh_model(), ZeroOffload(), batches, None)
        problems = check_placements(tm, asked, weight_homes, ref.report())
        ours, theirs = tm.state_dict(), ref.state_dict()
        differ = [k for k in ours if not torch.equal(ours[k], theirs[k])]
        tm.detach()  # removes its files from the NVMe directory
        ref.detach()
    finally:
        if args.nvme_dir is None:
            shutil.rmtree(nvme_dir, ignore_errors=True)

    print()
    if problems:
        print("placements NOT honoured:\n  " + "\n  ".join(problems))
    else:
        n_off = sum(home is not Tier.DEVICE for home in weight_homes.values())
        print(
            f"placements honoured: every class holds at least its asked bytes on its home tier, each of the "
            f"{n_off} off-device weights is held at its home, no optimizer state on the device, nothing but "
            f"optimizer state on NVMe"
        )
    same_losses = losses == ref_losses
    print(
        f"against ZeroOffload() on the same batches: losses {'bit-identical' if same_losses else 'DIFFER'}, "
        f"weights {'bit-identical' if not differ else 'DIFFER in ' + ', '.join(differ[:5])} "
        f"({len(ours)} tensors after {args.steps} steps)"
    )
    return 0 if not problems and same_losses and not differ else 1


if __name__ == "__main__":
    sys.exit(main())
