"""A user's own DCP calls on a TieredModel: ``tm.sharded_state_dict()`` gives this process's pieces
as DCP saves them (NOTE [Sharded values for DCP]), and ``tm.load_sharded_state_dict(tree)`` takes
them back once the user's ``dcp.load`` filled them; ``tm.save``/``tm.load`` of a directory are
:mod:`tiermem.checkpoint.dcp_save` and :mod:`tiermem.checkpoint.dcp`, which this shares the pieces
with.

NOTE [Streamed sharded values]
``tm.sharded_state_dict()`` hands back state that lives in memory as views of it (a ``dcp.save``
writes it from where it lives, a ``dcp.load`` fills it in place, as FSDP2's DTensors do): the
optimizer state of buckets homed in memory, and frozen values in host memory (a copy in their own
dtype, or the working copy when the device is the CPU: ``FrozenParams.live``). State that does
not (optimizer state on NVMe; a frozen base off the device, or a rank's pieces of it) cannot be
handed back whole: for a model bigger than the machine that is the whole point. Those values hold
nothing when returned. Each is a ShardedValue with a :class:`~tiermem.checkpoint.shards.Streamed`
source, which reads its home when DCP asks: the save planner's ``__create_write_items__`` drops
what a source kept; the first box of a bucket reads that bucket's part of this process into the
home's own buffer set (no new memory), and each box DCP gets is a copy of its own bytes, taken
under the source's lock together with the read (a writer may resolve from several threads, and
keep a box past the next read: torch's on a CUDA host resolves 10 MB ahead, in size order). What
the writer keeps is its business: torch's ``FileSystemWriter`` keeps every tensor of a file until
the file is written, so with its default of one file per rank a save holds this process's share
of that state (as it did when this call copied it all), and with ``single_file_per_rank=False``
(a file per tensor) one tensor; ``tm.save`` hands DCP views of the buffer set and holds nothing.
Each bucket is read once per pass over it: DCP's plan writes the weights, then the moments, so
twice, where ``tm.save`` reads once; a writer that reorders (torch's size order on a CUDA host,
unless ``per_thread_copy_ahead=0``) reads a bucket again each time it comes back to it.

The load planner's ``__create_chunk_list__`` gives each streamed value a buffer for DCP to fill,
and each box DCP asks for is marked filled; ``tm.load_sharded_state_dict`` refuses a value not
filled whole (a partial load), checks the tree whole, sends it home bucket by bucket, then drops
the buffers. So a load holds this process's share of that state while the user's ``dcp.load``
runs (``tm.load`` of a directory ``tm.save`` wrote holds one bucket). A dict a load filled cannot
be saved before the model took it (its views and its buffers would be of two checkpoints).

The dict's step counts and hyperparameters (its ``tiermem`` entry) are the call's. So when a
``dcp.save`` plans it, each value checks, locally (each rank plans on its own), what the call
checked (no step half done, no failed load) and that no step, no load and no change of what
trains happened since (``StateCore.loads``, ``Trainable.changes``): a save after any of them
would pair the entry with other state.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import Any, Callable, Optional

import torch

from tiermem.checkpoint.dcp import OneAtATime, frozen_pieces, own_piece, pieces, whole_frozen
from tiermem.checkpoint.dcp_check import meta_fits, parse_meta
from tiermem.checkpoint.names import FROZEN, StateName
from tiermem.checkpoint.shards import META, ShardedValue, Source, Streamed, key, nested
from tiermem.checkpoint.view import PartPieces, Piece, StateReader, StateWriter
from tiermem.errors import ConfigError


class _Piece(Streamed):
    """Elements ``[at, at + n)`` of part ``part`` of bucket ``index``, read through ``one``."""

    __slots__ = ("one", "index", "part", "at")

    def __init__(self, one: OneAtATime, index: int, part: int, p: Piece):
        self.one, self.index, self.part, self.at = one, index, part, p.at

    def box(self, begin: int, n: int) -> torch.Tensor:
        return self.one.box(self.index, self.part, self.at + begin, n)

    def forget(self) -> None:
        self.one.forget()


class _Whole(Streamed):
    """A frozen parameter this process keeps whole, or its piece of one's copy in its own dtype,
    read from home (flat) when a box of it is first asked for and kept for the next boxes."""

    __slots__ = ("read", "value", "lock")

    def __init__(self, read: Callable[[], torch.Tensor]):
        self.read, self.lock = read, threading.Lock()
        self.value: Optional[torch.Tensor] = None

    def box(self, begin: int, n: int) -> torch.Tensor:
        with self.lock:
            if self.value is None:
                self.value = self.read().reshape(-1)
            return self.value[begin : begin + n].clone()

    def forget(self) -> None:
        with self.lock:
            self.value = None


def sharded_state_dict(reader: StateReader, guard: Callable[[], None]) -> dict[str, Any]:
    """``tm.sharded_state_dict()``: this process's pieces as ShardedValues, nested as DCP saves
    them: views of the live state where it lives in memory, read from home when DCP asks where
    it does not (NOTE [Streamed sharded values]); the frozen parameters sharded over the ranks in
    this process's pieces, the others whole, the buffers the module's own. ``guard()`` refuses a
    save the call itself would have refused (checked when DCP plans one). Reads nothing but
    scalar or empty frozen parameters."""
    core = reader.core
    state = OneAtATime(reader.read_local, reader, copy=False)
    chunks = OneAtATime(lambda index: (reader.read_frozen(index),), reader, copy=True)
    frozen = core.layout.frozen

    def state_source(index: int, part: int, p: Piece) -> Source:
        if not reader.resident(index):
            return _Piece(state, index, part, p)
        return reader.read_local(index)[part][p.at : p.at + p.hi - p.lo]  # the live state: nothing read

    def frozen_source(index: int, p: Piece) -> Source:
        if not frozen.keeps_copy(p.name):
            return _Piece(chunks, index, 0, p)
        live = frozen.live(p.name)  # this rank's piece of its copy in its own dtype
        return live if live is not None else _Whole(functools.partial(own_piece, frozen, p.name))

    def whole_source(name: str) -> Source:
        live = frozen.live(name)
        return live if live is not None else _Whole(functools.partial(frozen.value, name))

    values: dict[str, Any] = dict(pieces(core, state_source, guard))
    values.update(frozen_pieces(core, frozen_source, guard))  # NOTE [Frozen weights sharded over the ranks]
    values.update(whole_frozen(core, whole_source, guard))
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
    pieces, frozen = core.pieces(), core.frozen_pieces()
    values: dict[str, Any] = {}
    for index, mine in pieces:
        for part, _, of_part in core.part_pieces(index, mine):
            for p in of_part:
                _check_piece(values, tree, StateName(part, p.name), (p.lo, p.hi), p.shape, bad)
    for _, mine in frozen:
        for p in mine:
            _check_piece(values, tree, StateName(FROZEN, p.name), (p.lo, p.hi), p.shape, bad)
    rest = writer.rest(pieces=True)
    for name, t in rest.items():
        v = values[name] = _lookup(tree, StateName.parse(name))
        if isinstance(v, ShardedValue) and v.local_range == (0, t.numel()) and v.shape == t.shape:
            _check_loaded(v, name, bad)
        elif not isinstance(v, torch.Tensor) or isinstance(v, ShardedValue) or v.shape != t.shape:
            raise bad(f"{key(name)!r} is not a tensor of shape {tuple(t.shape)}")
    with writer.updating():
        for index, mine in pieces:
            writer.load_local(index, functools.partial(_copy_pieces, values, core.part_pieces(index, mine)))
        writer.release()
        for index, mine in frozen:
            writer.load_frozen(index, mine, functools.partial(_copy_frozen, values, mine))
        for name, t in rest.items():
            v = values[name]
            t.copy_(v.local().view(t.shape) if isinstance(v, ShardedValue) else v)  # a no-op where dcp.load filled t
        writer.commit_rest(rest)
    for v in values.values():
        if isinstance(v, ShardedValue):
            v.drop_loaded()  # home now: the tree holds nothing more
    writer.take_meta(meta)


def _check_piece(values: dict[str, Any], tree: dict, n: StateName, span: tuple[int, int], shape: tuple, bad) -> None:
    v = values[str(n)] = _lookup(tree, n)
    if not isinstance(v, ShardedValue) or v.local_range != span or tuple(v.shape) != tuple(shape):
        raise bad(f"{key(n)!r} is not this process's ShardedValue of it (elements [{span[0]}, {span[1]}))")
    _check_loaded(v, str(n), bad)


def _check_loaded(v: ShardedValue, name: str, bad) -> None:
    if not v.filled:
        raise bad(
            f"{key(name)!r} was not filled by a dcp.load (its value lives off memory and is read when asked: "
            f"NOTE [Streamed sharded values]); call dcp.load(sd, ...) on this very dict first"
        )


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


def _copy_frozen(values: dict[str, Any], mine: list[Piece], targets: dict[str, torch.Tensor]) -> None:
    for p in mine:
        targets[p.name].copy_(values[str(StateName(FROZEN, p.name))].local())
