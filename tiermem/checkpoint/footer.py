"""The checkpoint file's markers and the rules its footer is checked by before any tensor is read
(NOTE [Checkpoint format] in :mod:`tiermem.checkpoint.file`): every field's type and range, each
tensor entry's size against its dtype and shape and its place inside the file. Pure functions of
the parsed footer; no file is touched here.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from tiermem.checkpoint.view import HYPER, MEMBERS
from tiermem.config.rules import check_hyper, is_int
from tiermem.config.specs import PRECISIONS
from tiermem.errors import ConfigError

__all__ = [
    "MAGIC",
    "MAGIC_V2",
    "MAGIC_V1",
    "META_KEYS",
    "ENTRY_KEYS",
    "Invalid",
    "sum_key",
    "check_meta",
    "check_entries",
    "check_footer",
    "dtype_named",
]

MAGIC = b"TIERMEM-CKPT-v3\n"
MAGIC_V2 = b"TIERMEM-CKPT-v2\n"  # CRC-32s; read, never written
MAGIC_V1 = b"TIERMEM-CKPT-v1\n"  # CRC-32s, no checksum on the footer; read, never written
META_KEYS = {"precision", "step", "param_step", "scaler", "groups"}
ENTRY_KEYS = {"name", "dtype", "shape", "offset", "nbytes"}


def sum_key(magic: bytes) -> str:
    """The name of a tensor entry's checksum field in files of ``magic``."""
    return "xxh3" if magic == MAGIC else "crc32"


class Invalid(Exception):
    """A footer field breaks its rule; the message says which, its value and the rule."""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _require(ok: bool, where: str, value: Any, rule: str) -> None:
    if not ok:
        raise Invalid(f"{where}={_short(value)} is invalid: it must be {rule}")


def _count(v: Any) -> bool:
    return is_int(v) and v >= 0


def _keys(d: Any, where: str, allowed: set[str], required: set[str]) -> None:
    _require(isinstance(d, dict), where, d, "an object")
    rule = f"the keys {sorted(allowed)}" if required == allowed else f"keys among {sorted(allowed)}"
    _require(required <= d.keys() <= allowed, where + " keys", sorted(d), rule)


def _hyper(where: str, field: str, value: Any, rule: str | None = None) -> None:
    """``field`` by the rule of the Adam hyperparameter ``rule`` (by default its own name) in
    tiermem.config.specs (which refuses booleans: NOTE [Numbers are not bools])."""
    try:
        check_hyper("", **{rule or field: value})
    except ConfigError as e:  # "tiermem: <rule>=<value> is invalid: it must be ...; pass a value that is"
        why = str(e).partition(" is invalid: ")[2].partition("; pass")[0]
        raise Invalid(f"{where}{field}={_short(value)} is invalid: {why}") from None


def check_meta(meta: Any) -> None:
    _keys(meta, "meta", META_KEYS, META_KEYS)
    precision, step = meta["precision"], meta["step"]
    _require(
        isinstance(precision, str) and precision in PRECISIONS,
        "meta.precision",
        precision,
        f"one of {sorted(PRECISIONS)}",
    )
    _require(_count(step), "meta.step", step, "an int >= 0")
    _require(isinstance(meta["param_step"], dict), "meta.param_step", meta["param_step"], "an object")
    for name, n in meta["param_step"].items():
        _require(_count(n) and n <= step, f"meta.param_step[{name!r}]", n, f"an int in [0, step={step}]")
    scaler = meta["scaler"]
    _keys(scaler, "meta.scaler", {"scale", "good_steps"}, {"scale", "good_steps"})
    _hyper("meta.scaler.", "scale", scaler["scale"], "grad_scale")
    _require(_count(scaler["good_steps"]), "meta.scaler.good_steps", scaler["good_steps"], "an int >= 0")
    if precision != "fp16":  # no loss scaling: a scale other than 1 would divide every gradient
        _require(
            scaler == {"scale": 1.0, "good_steps": 0},
            "meta.scaler",
            scaler,
            f"{{'scale': 1.0, 'good_steps': 0}} at precision {precision!r}",
        )
    _require(isinstance(meta["groups"], list), "meta.groups", meta["groups"], "a list")
    for i, group in enumerate(meta["groups"]):
        _keys(group, f"meta.groups[{i}]", {*HYPER, *MEMBERS}, set())
        for name, value in group.items():
            if name == "name":
                _require(isinstance(value, str), f"meta.groups[{i}].name", value, "a str")
            elif name == "params":
                _require(
                    isinstance(value, list) and all(isinstance(n, str) for n in value),
                    f"meta.groups[{i}].params",
                    value,
                    "a list of parameter names",
                )
            else:
                rule = "lr" if name == "initial_lr" else name
                if name == "eps" and isinstance(value, list):  # Adafactor's eps is a pair (eps1 or None, eps2)
                    rule = "adafactor_eps"
                _hyper(f"meta.groups[{i}].", name, value, rule)


def dtype_named(name: Any) -> torch.dtype | None:
    """The torch dtype ``name`` spells as a checkpoint writes it (``float32``, not ``float``)."""
    d = getattr(torch, name, None) if isinstance(name, str) else None
    return d if isinstance(d, torch.dtype) and str(d) == "torch." + name else None


def check_entries(entries: Any, data_end: int, magic: bytes) -> None:
    _require(isinstance(entries, list), "tensors", entries, "a list")
    seen: set[str] = set()
    for i, e in enumerate(entries):
        where = f"tensors[{i}]"
        keys = ENTRY_KEYS | {sum_key(magic)}
        _keys(e, where, keys, keys)
        _require(
            isinstance(e["name"], str) and e["name"] not in seen, where + ".name", e["name"], "a name not seen before"
        )
        seen.add(e["name"])
        where = f"tensors[{i}] ({e['name']!r})"
        dtype, shape, offset, nbytes = dtype_named(e["dtype"]), e["shape"], e["offset"], e["nbytes"]
        _require(dtype is not None, where + ".dtype", e["dtype"], "a torch dtype such as 'float32'")
        _require(
            isinstance(shape, list) and all(_count(n) for n in shape), where + ".shape", shape, "a list of ints >= 0"
        )
        _require(_count(offset) and offset >= len(MAGIC), where + ".offset", offset, f"an int >= {len(MAGIC)}")
        assert dtype is not None  # (_require raised otherwise)
        size = math.prod(shape) * dtype.itemsize
        _require(is_int(nbytes) and nbytes == size, where + ".nbytes", nbytes, f"{size} ({e['dtype']} x {shape})")
        _require(
            offset + nbytes <= data_end,
            where + ".offset",
            offset,
            f"such that its {nbytes} bytes end before the footer, at {data_end}",
        )
        if magic == MAGIC:
            _require(
                isinstance(e["xxh3"], str) and re.fullmatch("[0-9a-f]{16}", e["xxh3"]) is not None,
                where + ".xxh3",
                e["xxh3"],
                "16 lowercase hex digits",
            )
        else:
            _require(_count(e["crc32"]) and e["crc32"] < 2**32, where + ".crc32", e["crc32"], "an int in [0, 2**32)")


def check_footer(doc: Any, data_end: int, magic: bytes) -> None:
    """The parsed footer of a file of ``magic`` whose tensor bytes end at ``data_end``, field by
    field; raises :class:`Invalid` naming the first field that breaks its rule."""
    _keys(doc, "footer", {"meta", "tensors"}, {"meta", "tensors"})
    check_meta(doc["meta"])
    check_entries(doc["tensors"], data_end, magic)
