"""``tiermem plan --config CONFIG.JSON --generate BATCH,TOKENS``: the KV cache of a generate call
(NOTE [The KV cache is placed] in tiermem/plan/kv_cache.py) in each precision, and the tier it would
take beside each built-in policy's weights for inference (``optimizer=None``) under the capacities."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from rich.table import Table

from tiermem.cli import _common
from tiermem.config.specs import working_dtype
from tiermem.errors import ConfigError
from tiermem.plan import sizing
from tiermem.plan.kv_cache import KvShape, kv_cache, tier_for
from tiermem.types import TensorClass, Tier


@dataclass(frozen=True)
class Generate:
    """What ``--generate BATCH,TOKENS`` asks: sequences at once, and tokens each (prompt and new ones)."""

    batch: int
    tokens: int

    @classmethod
    def parse(cls, text: str) -> "Generate":
        batch, sep, tokens = text.partition(",")
        if sep and batch.strip().isdigit() and tokens.strip().isdigit() and int(batch) > 0 and int(tokens) > 0:
            return cls(int(batch), int(tokens))
        raise ConfigError(
            f"tiermem: --generate {text!r} is not BATCH,TOKENS; give the sequences generated at once "
            f"(prompts x num_beams) and the tokens of each (prompt + max_new_tokens), e.g. --generate 8,4096"
        )


def add_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--generate",
        metavar="BATCH,TOKENS",
        help="with --config: the KV cache of generating BATCH sequences (prompts x num_beams) of TOKENS "
        "tokens each (prompt + max_new_tokens), and the tier it would take beside each policy's weights "
        "for inference (TieredModel(..., optimizer=None))",
    )


def entry(
    args: argparse.Namespace, total_params: int, limits: sizing.Limits, precisions: list[str], policies: list[str]
) -> dict[str, Any]:
    """The KV cache as plain data (what ``--json`` writes under ``"generate"``)."""
    asked = Generate.parse(args.generate)
    if args.config is None:
        raise ConfigError(
            "tiermem: --generate needs --config CONFIG.JSON: the KV cache's layers, heads and head width "
            "come from the model's config"
        )
    with open(args.config, encoding="utf-8") as f:  # read and checked by --config's own count first
        shape = KvShape.of(json.load(f))
    if shape is None:
        raise ConfigError(
            f"tiermem: --config {args.config!r} gives no layer count and head count (num_hidden_layers or "
            f"n_layer, num_attention_heads or n_head), no head width, or groups its KV heads without "
            f"num_key_value_heads (multi-query attention); --generate sizes the KV cache of a transformers "
            f"decoder's config.json: add num_key_value_heads to it"
        )
    out: dict[str, Any] = {
        "batch": asked.batch,
        "tokens": asked.tokens,
        "layers": shape.layers,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "precisions": {},
    }
    for prec in precisions:
        cache = kv_cache(shape, asked.batch, asked.tokens, working_dtype(prec))
        row: dict[str, Any] = {"kv_cache_bytes": cache.nbytes, "cache_tokens": cache.tokens, "policies": {}}
        for name in policies:
            placement = sizing.placement_of(name)
            weights = sizing.tier_bytes(0, prec, placement, frozen=total_params)  # inference: weights only
            room, fits = _room(weights, limits), sizing.check_fit(weights, limits).fits
            tier = tier_for(cache.nbytes, placement[TensorClass.ACTIVATION], room) if fits else None
            row["policies"][name] = {
                "tier": None if tier is None else tier.value,
                "weights_fit": fits,
                "weights": {t.value: n for t, n in weights.items()},
                "room": {t.value: n for t, n in room.items()},
            }
        out["precisions"][prec] = row
    return out


def _room(weights: dict[Tier, int], limits: sizing.Limits) -> dict[Tier, int]:
    """The bytes the device and the host have beside the weights (together, when they share RAM)."""
    fit = sizing.check_fit(weights, limits)
    host = limits.host - weights[Tier.HOST] - (weights[Tier.DEVICE] if limits.device_shares_host else 0)
    return {Tier.DEVICE: max(fit.device_headroom, 0), Tier.HOST: max(host, 0)}


def render(gen: dict[str, Any]) -> None:
    """The KV cache's table: its bytes in each precision, and its tier beside each policy's weights."""
    con = _common.stdout_console()
    table = Table(
        title=f"KV cache of generate: batch {gen['batch']} x {gen['tokens']} tokens x {gen['layers']} layers x "
        f"{gen['kv_heads']} KV heads x {gen['head_dim']} wide, beside the weights alone",
        title_justify="left",
    )
    for col in ("policy", "precision", "KV cache", "room on device", "room on host", "tier"):
        table.add_column(col, justify="left" if col in ("policy", "precision", "tier") else "right")
    for prec, row in gen["precisions"].items():
        for name, e in row["policies"].items():
            tier = e["tier"] or (
                "[red]none[/]: smaller batch or tokens, or more memory"
                if e["weights_fit"]
                else "[red]none[/]: the weights do not fit"
            )
            table.add_row(
                name,
                prec,
                _common.fmt_size(row["kv_cache_bytes"]),
                _common.fmt_size(e["room"]["device"]),
                _common.fmt_size(e["room"]["host"]),
                tier,
            )
    con.print(table)
