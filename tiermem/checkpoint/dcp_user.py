"""A user's own DCP calls on a TieredModel: ``tm.sharded_state_dict()`` gives this process's pieces
as DCP saves them (NOTE [Sharded values for DCP]), and ``tm.load_sharded_state_dict(tree)`` takes
them back once the user's ``dcp.load`` filled them; ``tm.save``/``tm.load`` of a directory are
:mod:`tiermem.checkpoint.dcp_save` and :mod:`tiermem.checkpoint.dcp`, which this shares the pieces
with."""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from tiermem.checkpoint.dcp import OneBucket, pieces
from tiermem.checkpoint.dcp_check import meta_fits, parse_meta
from tiermem.checkpoint.names import StateName
from tiermem.checkpoint.shards import META, ShardedValue, key, nested
from tiermem.checkpoint.view import PartPieces, Piece, StateReader, StateWriter
from tiermem.errors import ConfigError


def sharded_state_dict(reader: StateReader) -> dict[str, Any]:
    """``tm.sharded_state_dict()``: this process's pieces as ShardedValues (views of the live state
    where it lives in memory, copies of state on NVMe), and the frozen parameters and buffers
    (the model's own tensors), nested as DCP saves them."""
    one = OneBucket(reader)  # each bucket read once

    def source(index: int, part: int, p: Piece) -> torch.Tensor:
        t = one.source(index, part, p)()
        return t if reader.resident(index) else t.clone()  # NVMe's buffer set is the next bucket's

    try:
        values: dict[str, Any] = dict(pieces(reader.core, source))
    finally:
        reader.release()
    values.update(reader.rest())
    return nested(values, json.dumps(reader.meta()))


# -- a user's own dcp.load, handed back -------------------------------------------------------------
def load_sharded(writer: StateWriter, tree: Any) -> None:
    """``tm.load_sharded_state_dict(tree)``: ``tree`` is what :func:`sharded_state_dict` gave this
    model, filled by the user's ``dcp.load``; checked whole, then written home bucket by bucket."""

    def bad(why: str) -> ConfigError:
        return ConfigError(
            f"tiermem: load_sharded_state_dict() takes what this model's tm.sharded_state_dict() "
            f"returned (filled by dcp.load); {why}; nothing was loaded"
        )

    if not isinstance(tree, dict) or set(tree) != {"model", "optim", META}:
        raise bad(f"got {type(tree).__name__} with keys {sorted(tree)[:5] if isinstance(tree, dict) else '-'}")
    meta = parse_meta(tree[META], lambda why: bad(f"its {META!r} entry {why}"))
    meta_fits(writer, meta, lambda what: bad(f"it does not match this model: {what}"), "the state dict")
    core = writer.core
    pieces = core.pieces()
    values: dict[str, Any] = {}
    for index, mine in pieces:
        for part, _, of_part in core.part_pieces(index, mine):
            for p in of_part:
                n = StateName(part, p.name)
                v = values[str(n)] = _lookup(tree, n)
                if not isinstance(v, ShardedValue) or v.local_range != (p.lo, p.hi) or tuple(v.shape) != p.shape:
                    raise bad(f"{key(n)!r} is not this process's ShardedValue of it (elements [{p.lo}, {p.hi}))")
    rest = writer.rest()
    for name, t in rest.items():
        v = values[name] = _lookup(tree, StateName.parse(name))
        if not isinstance(v, torch.Tensor) or isinstance(v, ShardedValue) or v.shape != t.shape:
            raise bad(f"{key(name)!r} is not a tensor of shape {tuple(t.shape)}")
    with writer.updating():
        for index, mine in pieces:
            writer.load_local(index, functools.partial(_copy_pieces, values, core.part_pieces(index, mine)))
        writer.release()
        for name, t in rest.items():
            t.copy_(values[name])  # a no-op where dcp.load filled the model's own tensor
        writer.commit_rest(rest)
    writer.take_meta(meta)


def _lookup(tree: dict, name: StateName) -> Any:
    where = key(name)
    try:
        if name.of_module:
            return tree["model"][name.param]
        return tree["optim"]["state"][name.param][name.part]
    except (KeyError, TypeError):
        raise ConfigError(
            f"tiermem: load_sharded_state_dict() takes what this model's tm.sharded_state_dict() "
            f"returned (filled by dcp.load); it has no {where!r}; nothing was loaded"
        ) from None


def _copy_pieces(values: dict[str, Any], parts: list[PartPieces], views: tuple[torch.Tensor, ...]) -> None:
    for (part, _, mine), t in zip(parts, views):
        for p in mine:
            t[p.at : p.at + p.hi - p.lo].copy_(values[str(StateName(part, p.name))].local())
