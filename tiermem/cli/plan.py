"""``tiermem plan``: bytes per tensor class and per tier for each built-in policy, and whether they fit."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from rich.table import Table

from tiermem.cli import _common, plan_kv
from tiermem.cli.models import ModelSize, from_config, from_factory, parse_count
from tiermem.config.budgets import parse_bytes
from tiermem.config.specs import PRECISION_CHOICES, resolve_precision
from tiermem.errors import ConfigError
from tiermem.optim.formats import ADAM, StateFormat
from tiermem.plan import sizing
from tiermem.types import Tier

DESCRIPTION = """\
Print how many bytes a model's training state needs (params, grads, fp32 master, Adam momentum and
variance), how each built-in policy spreads them over the device, host and NVMe tiers in each
precision, and whether that fits this machine (or the sizes you give). Sizes are decimal (1 GB =
10^9 bytes); activations are not counted, the device headroom left for them is shown instead."""

EPILOG = """\
examples:
  tiermem plan --params 7.5e9
  tiermem plan --model mypkg.models:gpt_small --device-mem 24GB
  tiermem plan --config llama-7b/config.json --json plan.json
  tiermem plan --params 7.5e9 --policy auto --device-mem 80GB --host-mem 256GB
  tiermem plan --params 70e9 --ranks 8 --device-mem 80GB   # bytes per rank of 8 data-parallel ranks
  tiermem plan --config llama-7b/config.json --generate 8,4096   # and the KV cache of generate"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="bytes per tensor class and per tier for each policy; does it fit?",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_args(p)
    _add_choice_args(p)
    _add_capacity_args(p)
    _add_ranks_args(p)
    plan_kv.add_argument(p)
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="write the plan as JSON to FILE (stdout when FILE is omitted or '-')",
    )
    p.set_defaults(run=run)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """What model to size: exactly one of a count, a factory or a config."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", metavar="N", help="number of parameters, e.g. 7.5e9, 7.5B or 125M")
    src.add_argument(
        "--model",
        metavar="PKG.MOD:FACTORY",
        help="a function (or nn.Module) to count; built on the meta device, no memory used",
    )
    src.add_argument("--config", metavar="CONFIG.JSON", help="a Hugging Face style config.json")


def _add_choice_args(p: argparse.ArgumentParser) -> None:
    """Which precisions and policies to show, and what ``--policy auto`` times a step by."""
    p.add_argument(
        "--precision",
        choices=PRECISION_CHOICES,
        action="append",
        help="only this precision (repeatable; default: all, and for --policy auto this machine's); "
        "'auto': bf16 where the device computes it natively, else fp32 on a CPU, fp16 on an older GPU",
    )
    p.add_argument(
        "--policy",
        choices=list(sizing.builtin_placements()) + ["auto"],
        action="append",
        help="only this built-in policy (repeatable; default: all); 'auto': what policies.Auto "
        "would choose, the predicted seconds per stage, and the alternatives it rejected",
    )
    p.add_argument(
        "--forward-backward",
        type=float,
        metavar="SECONDS",
        help="with --policy auto: the measured seconds of one forward and backward",
    )
    p.add_argument(
        "--tokens",
        type=int,
        metavar="N",
        help="with --policy auto, without --forward-backward: the tokens of one step (batch x sequence "
        "x micro-batches), to predict forward and backward at the precision's matmul rate",
    )


def _add_capacity_args(p: argparse.ArgumentParser) -> None:
    """Each tier's capacity, where the default (this machine's) is not wanted."""
    p.add_argument(
        "--device-mem",
        metavar="SIZE",
        help="device memory, e.g. 80GB (default: the accelerator's; without one, the host RAM the device tier shares)",
    )
    p.add_argument("--host-mem", metavar="SIZE", help="host RAM (default: this machine's total)")
    p.add_argument(
        "--nvme-free", metavar="SIZE", help="free space for NVMe offload (default: free space under --nvme-path)"
    )
    p.add_argument(
        "--nvme-path",
        default=".",
        metavar="DIR",
        help="where NVMe offload would write, for the default --nvme-free (default: .)",
    )


def _add_ranks_args(p: argparse.ArgumentParser) -> None:
    """Data parallelism: the bytes shown are one rank's."""
    p.add_argument(
        "--ranks",
        type=int,
        default=1,
        metavar="N",
        help="bytes per rank of N data-parallel ranks: each keeps 1/N of the grads and optimizer "
        "state, and of the weights when they live off the device (ZeRO-3) or with --shard-weights",
    )
    p.add_argument(
        "--shard-weights",
        action="store_true",
        help="with --ranks: weights on the device sharded over the ranks too (TieredModel(..., "
        "shard_weights=True)); without it they are whole on every rank",
    )


def _model_size(args: argparse.Namespace) -> ModelSize:
    if args.params is not None:
        n = parse_count(args.params)
        return ModelSize(n, 0, source=f"--params {args.params}")
    if args.model is not None:
        return from_factory(args.model)
    return from_config(args.config)


def _limits(args: argparse.Namespace) -> tuple[sizing.Limits, dict[str, str]]:
    """The tiers' capacities and, for the printout, where each figure came from."""
    origin = {}
    for opt in ("device_mem", "host_mem", "nvme_free"):  # parsed here, so the error is parse_bytes' own
        if getattr(args, opt) is not None:
            setattr(args, opt, parse_bytes(getattr(args, opt), what="--" + opt.replace("_", "-")))
    host = args.host_mem if args.host_mem is not None else _common.host_memory()
    origin["host"] = "--host-mem" if args.host_mem is not None else "this machine's RAM"
    dev_mem = _common.device_memory()
    shares = dev_mem is None  # no accelerator: the device tier is carved out of host RAM
    if args.device_mem is not None:
        device, origin["device"] = args.device_mem, "--device-mem"
    elif dev_mem is not None:
        device, origin["device"] = dev_mem, _common.accelerator() or "accelerator"
    else:
        device, origin["device"] = host, "no accelerator: shares host RAM"
    if args.nvme_free is not None:
        nvme, origin["nvme"] = args.nvme_free, "--nvme-free"
    else:
        path = _common.existing_dir("--nvme-path", args.nvme_path)
        nvme, origin["nvme"] = _common.disk_free(path), f"free under {path}"
    return sizing.Limits(device=device, host=host, nvme=nvme, device_shares_host=shares), origin


def build_plan(
    size: ModelSize,
    limits: sizing.Limits,
    precisions: list[str],
    policies: list[str],
    *,
    ranks: int = 1,
    shard_weights: bool = False,
) -> dict[str, Any]:
    """The plan as plain data (what ``--json`` writes); every byte figure is an exact int, per
    rank of ``ranks`` data-parallel ranks."""
    out: dict[str, Any] = {
        "source": size.source,
        "note": size.note,
        "ranks": ranks,
        "shard_weights": shard_weights,
        "params": {"trainable": size.trainable, "frozen": size.frozen, "total": size.total},
        "limits": {
            "device_bytes": limits.device,
            "host_bytes": limits.host,
            "nvme_bytes": limits.nvme,
            "device_shares_host": limits.device_shares_host,
        },
        "precisions": {},
    }
    for prec in precisions:
        out["precisions"][prec] = _precision_entry(size, limits, prec, policies, ranks, shard_weights)
    return out


def _precision_entry(
    size: ModelSize, limits: sizing.Limits, prec: str, policies: list[str], ranks: int, shard_weights: bool
) -> dict[str, Any]:
    """One precision's part of :func:`build_plan`: its bytes per parameter, and each policy's bytes
    per tier, with Adam's state and with each smaller state option."""
    state = sizing.state_bytes(size.trainable, prec, frozen=size.frozen)
    entry: dict[str, Any] = {
        "bytes_per_param": sizing.bytes_per_param(prec).as_dict(),
        "state_bytes": {**state.as_dict(), "total": state.total},
        "policies": {},
    }

    def need_of(name: str, state: StateFormat = ADAM) -> dict[Tier, int]:
        return sizing.tier_bytes(
            size.trainable,
            prec,
            sizing.placement_of(name),
            frozen=size.frozen,
            world=ranks,
            shard_weights=shard_weights,
            state=state,
        )

    for name in policies:
        need = need_of(name)
        fit = sizing.check_fit(need, limits)
        entry["policies"][name] = {
            "tiers": {t.value: {"bytes": need[t], "short_bytes": fit.short.get(t, 0)} for t in Tier},
            "total_bytes": sum(need.values()),
            "fits": fit.fits,
            "device_headroom_bytes": fit.device_headroom,
        }
    entry["state_options"] = {}  # the same policies with fewer optimizer-state bytes (NOTE [State formats])
    for name in policies:
        options = {}
        for option in sizing.STATE_OPTIONS:
            fmt = sizing.state_option(option, size.trainable, prec)
            options[option] = None if fmt is None else {t.value: n for t, n in need_of(name, fmt).items()}
        entry["state_options"][name] = options
    return entry


def _render(plan: dict[str, Any], origin: dict[str, str]) -> None:
    con = _common.stdout_console()
    p = plan["params"]
    frozen = f" + {p['frozen']:,} frozen" if p["frozen"] else ""
    con.print(f"[bold]{p['trainable']:,}[/] trainable parameters{frozen}  ({plan['source']})")
    if plan["note"]:
        con.print(f"  {plan['note']}")
    precs = list(plan["precisions"])
    con.print(_classes_table(plan, precs))
    con.print(_policies_table(plan, precs))
    _render_state_options(con, plan, precs)
    _render_notes(con, plan, origin)


def _classes_table(plan: dict[str, Any], precs: list[str]) -> Table:
    """Bytes per parameter and in all of each tensor class, one pair of columns per precision."""
    classes = Table(title="Training state by tensor class (Adam)", title_justify="left")
    classes.add_column("part")
    for prec in precs:
        classes.add_column(f"{prec} B/param", justify="right")
        classes.add_column(prec, justify="right")
    for part in ("params", "grads", "master", "momentum", "variance", "total"):
        row = [part]
        for prec in precs:
            per = plan["precisions"][prec]["bytes_per_param"]
            row.append(str(sum(per.values()) if part == "total" else per[part]))
            row.append(_common.fmt_size(plan["precisions"][prec]["state_bytes"][part]))
        classes.add_row(*row, style="bold" if part == "total" else None)
    return classes


def _policies_table(plan: dict[str, Any], precs: list[str]) -> Table:
    """Bytes on each tier per (policy, precision) under a row of the tiers' capacities, and whether
    they fit."""
    per_rank = (
        f", per rank of {plan['ranks']} data-parallel ranks"
        + (" (device weights sharded too)" if plan["shard_weights"] else "")
        if plan["ranks"] > 1
        else ""
    )
    tiers = Table(
        title=f"Bytes per tier for each built-in policy{per_rank} (activations not counted)", title_justify="left"
    )
    for col, just in (
        ("policy", "left"),
        ("precision", "left"),
        ("device", "right"),
        ("host", "right"),
        ("nvme", "right"),
        ("fits?", "left"),
    ):
        tiers.add_column(col, justify=just)  # type: ignore[arg-type]  # rich wants a Literal: these are
    tiers.add_row("[dim]capacity[/]", "", *(f"[dim]{c}[/]" for c in _capacities(plan["limits"])), "")
    for name in next(iter(plan["precisions"].values()))["policies"]:
        for prec in precs:
            tiers.add_row(name, prec, *_tier_cells(plan["precisions"][prec]["policies"][name]))
    return tiers


def _capacities(lim: dict[str, Any]) -> list[str]:
    """The device, host and NVMe capacities as the tier table's first row shows them."""
    caps = [_common.fmt_size(lim[f"{t}_bytes"]) for t in ("device", "host", "nvme")]
    if lim["device_shares_host"]:
        caps[0] = "in host RAM" if lim["device_bytes"] >= lim["host_bytes"] else f"{caps[0]} of host RAM"
        caps[1] += " (with device)"
    return caps


def _tier_cells(e: dict[str, Any]) -> list[str]:
    """One policy's row in one precision: its bytes on each tier (red where short), then the verdict."""
    cells = []
    for t in ("device", "host", "nvme"):
        b = e["tiers"][t]["bytes"]
        text = _common.fmt_size(b) if b else "-"
        if t == "device":
            text = f"{text} + act." if b else "act. only"
        cells.append(f"[red]{text}[/]" if e["tiers"][t]["short_bytes"] else text)
    if e["fits"]:
        verdict = f"[green]yes[/], {_common.fmt_size(e['device_headroom_bytes'])} left for activations"
    else:
        verdict = "[red]no[/]: short " + ", ".join(
            f"{_common.fmt_size(v['short_bytes'])} on {t}" for t, v in e["tiers"].items() if v["short_bytes"]
        )
    return [*cells, verdict]


def _render_notes(con: Any, plan: dict[str, Any], origin: dict[str, str]) -> None:
    """The footnotes: where each capacity came from, and what the tables count and leave out."""
    con.print(f"[dim]capacity: device: {origin['device']}; host: {origin['host']}; nvme: {origin['nvme']}.[/]")
    con.print(
        "[dim]grads: the class table counts them in the params' dtype (as autograd makes them on "
        "the device); tiermem accumulates them at their home in fp32, 4 B/param, and the tier table "
        "counts that. nvme: each value once (a failed step is completed by retrying it). Not counted: "
        "activations; tiermem's working buffers, sized by bucket_size and the largest parameter and "
        "module (grads in flight on the device, weight staging, the NVMe pipelines and the NVMe "
        "writes in flight); the host's copy of frozen weights; host buffers rounded up to whole "
        "pages (--policy auto counts all of these).[/]"
    )
    if plan["limits"]["device_shares_host"]:
        con.print(
            "[dim]no accelerator: the device tier lives in host RAM, so device + host must fit "
            "in the host's capacity together.[/]"
        )


def _render_state_options(con: Any, plan: dict[str, Any], precs: list[str]) -> None:
    """One column per optimizer state option: the training state's bytes on each tier the policy uses."""
    first = plan["precisions"][precs[0]]["state_options"]
    options = list(next(iter(first.values())))
    table = Table(
        title="Bytes per tier with each optimizer state option (tiermem.AdamW, AdamW8bit, bf16_stochastic_round=True)",
        title_justify="left",
    )
    for col in ("policy", "precision", *options):
        table.add_column(col, justify="left" if col in ("policy", "precision") else "right")
    for name in first:
        for prec in precs:
            cells = []
            for option in options:
                tiers = plan["precisions"][prec]["state_options"][name][option]
                cells.append(
                    "-" if tiers is None else ", ".join(f"{t} {_common.fmt_size(b)}" for t, b in tiers.items() if b)
                )
            table.add_row(name, prec, *cells)
    con.print(table)


def run(args: argparse.Namespace) -> int:
    _common.check_output_path("--json", args.json)
    if args.ranks < 1:
        raise ConfigError(f"tiermem: --ranks {args.ranks} is not a number of ranks; give a whole number >= 1")
    size = _model_size(args)
    limits, origin = _limits(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precisions = [resolve_precision(p, device) for p in args.precision or sizing.PRECISIONS]
    named = list(dict.fromkeys(args.policy or []))
    auto = "auto" in named
    named = [n for n in named if n != "auto"]
    plan: dict[str, Any] = {}
    if named or not auto:
        plan = build_plan(
            size,
            limits,
            list(dict.fromkeys(precisions)),
            sizing.policies(named or None),
            ranks=args.ranks,
            shard_weights=args.shard_weights,
        )
    if auto:
        from tiermem.cli import plan_auto  # imports the policies and the machine profile: only when asked

        mine = precisions[0] if args.precision else resolve_precision("auto", device)
        plan["auto"] = plan_auto.choose(args, size.trainable, size.frozen, limits, mine)
    if args.generate is not None:
        policies = sizing.policies(named or None)
        plan["generate"] = plan_kv.entry(args, size.total, limits, list(dict.fromkeys(precisions)), policies)
    if args.json is not None:
        _common.write_json(args.json, plan)
    if args.json != "-":
        if "precisions" in plan:
            _render(plan, origin)
        if auto:
            plan_auto.render(plan["auto"])
        if "generate" in plan:
            plan_kv.render(plan["generate"])
    return 0
