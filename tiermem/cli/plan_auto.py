"""``tiermem plan --policy auto``: what ``policies.Auto`` would choose for a model on this machine (or
the capacities given), read from the plan TieredModel would build from (NOTE [Plan, then build]):
the predicted seconds per stage of a step, the homes, and every alternative it rejected with the
reason (NOTE [How Auto chooses] in tiermem/policies/auto.py)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from tiermem.cli import _common
from tiermem.cli.models import StandIn, load_model
from tiermem.config.specs import AdamW, working_dtype
from tiermem.errors import ConfigError
from tiermem.model.machine import machine_profile
from tiermem.plan.model_plan import plan_model
from tiermem.plan.sizing import Limits
from tiermem.policies import Auto
from tiermem.policies.auto import AutoChoice
from tiermem.types import Tier

BUCKET_NUMEL = 32 * 2**20 // 4  # TieredModel's default bucket_size (32 MiB of fp32 grads)


def choose(args: argparse.Namespace, trainable: int, frozen: int, limits: Limits, precision: str) -> dict[str, Any]:
    """Auto's choice as plain data (what ``--json`` writes under ``"auto"``)."""
    if args.model is not None:
        module, shape = load_model(args.model), "the model's own parameters"
    else:
        module, shape = StandIn(trainable, frozen), "a stand-in of 48 equal layers (the count alone is known)"
    if args.forward_backward is not None and not args.forward_backward >= 0:
        raise ConfigError(
            f"tiermem: --forward-backward {args.forward_backward} must be >= 0 (seconds of one "
            f"forward and backward, measured)"
        )
    if args.tokens is not None and args.tokens < 0:
        raise ConfigError(
            f"tiermem: --tokens {args.tokens} must be >= 0 (tokens of one step: batch x sequence x micro-batches)"
        )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    caps = {Tier.DEVICE: limits.device, Tier.HOST: limits.host, Tier.NVME: limits.nvme}
    planned = plan_model(  # the plan TieredModel would build from (NOTE [Plan, then build])
        module,
        Auto(forward_backward=args.forward_backward or 0.0, tokens_per_step=args.tokens or 0),
        spec=AdamW(),
        dtype=working_dtype(precision),
        bucket_numel=BUCKET_NUMEL,
        limits=caps,
        machine=lambda: machine_profile(device, args.nvme_path),
        world=args.ranks,
        shard_weights=args.shard_weights,
        device_type=device.type,
    )
    auto = planned.placement
    assert isinstance(auto, AutoChoice)
    return {
        "precision": precision,
        "parameters_as": shape,
        "ranks": args.ranks,
        "forward_backward_s": args.forward_backward or 0.0,
        "tokens_per_step": args.tokens or 0,
        "plan": planned.summary(),
        "choices": [
            {
                "placement": c.label,
                "verdict": c.verdict,
                "fits": c.evaluation.fits,
                "predicted_s": c.evaluation.stages and dict(c.evaluation.stages),
                "step_s": c.evaluation.seconds if c.evaluation.stages else None,
                "bytes": {t.value: n for t, n in c.evaluation.need.items()},
            }
            for c in auto.choices
        ],
    }


def render(out: dict[str, Any]) -> None:
    con = _common.stdout_console()
    best, rest = out["choices"][0], out["choices"][1:]
    ranks = f"; per rank of {out['ranks']} ranks" if out.get("ranks", 1) > 1 else ""
    con.print(f"\n[bold]Auto[/] ({out['precision']}; parameters as {out['parameters_as']}{ranks}) chose:")
    con.print(f"  [green]{best['placement']}[/]")
    con.print("  bytes: " + ", ".join(f"{t} {_common.fmt_size(n)}" for t, n in best["bytes"].items() if n))
    planned, homes = out["plan"], out["plan"]["homes"]
    con.print(
        f"  as TieredModel builds it: {planned['buckets']} buckets; grads "
        + " / ".join(f"{n} {t}" for t, n in homes["grads"].items())
        + "; optimizer state "
        + " / ".join(f"{n} {t}" for t, n in homes["optim_state"].items())
        + (f"; {homes['params_off_device']} weights off the device" if homes["params_off_device"] else "")
    )
    fb = (
        ""
        if out["forward_backward_s"]
        else f" (forward+backward predicted for {out['tokens_per_step']:,} tokens at "
        f"the {out['precision']} matmul rate)"
        if out["tokens_per_step"]
        else " (forward+backward not counted: pass --forward-backward S, or --tokens N to predict it)"
    )
    con.print(
        f"  predicted step {best['step_s'] * 1e3:.1f} ms{fb}: "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in best["predicted_s"].items())
    )
    con.print(f"  rejected ({len(rest)}):")
    for c in rest:
        con.print(f"  - {c['placement']}: {c['verdict']}")
