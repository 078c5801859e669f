"""Checkpoints as torch.distributed.checkpoint (DCP) directories: every rank writes its own shards
in parallel, and any world size reads them (DCP's planner reshards from the metadata).

What a directory holds is NOTE [Sharded values for DCP] (names, shapes, how a rank's arbitrary
range of a parameter becomes DCP chunks); how its bytes are checked and how it is published is
NOTE [Checkpoint directories]. Here, the flow:

- **save** (every rank): rank 0 makes the temporary directory; each rank hands DCP this process's
  pieces of every bucket's state, and of every frozen bucket sharded over the ranks (NOTE [Frozen
  weights sharded over the ranks]: nothing is gathered), read one bucket at a time when DCP writes
  them (a sorted plan, one writer thread, no copy-ahead: state on NVMe passes through the home's
  one host buffer set, state in memory is written from where it lives), rank 0 adds the other
  frozen parameters, buffers and the ``tiermem`` meta; each rank writes its manifest; rank 0
  publishes once every rank got through, and every rank returns once it has.
- **load** (every rank): the directory and its files are opened once (NOTE [A load reads the
  files it checked]); everything is checked first, in two rounds each agreed by every rank
  (manifests and checksums; then DCP's metadata through a restricted unpickler, the meta, every
  tensor's name, shape, dtype and coverage against the model: NOTE [Nothing in a checkpoint
  runs]); then, bucket by bucket, each rank reads the pieces it keeps now (one ``dcp.load`` of
  that bucket's pieces through those descriptors, no collective inside, straight into the home's
  buffers) and sends the bucket's weights home; then each frozen bucket sharded over the ranks
  (its pieces into a copy of this rank's chunk, which goes home; a parameter's that keeps a copy
  in its own dtype into this rank's piece of that copy, and rounded into the chunk), the other
  frozen parameters and the buffers. A read that fails is kept until the last bucket (each
  bucket's collectives still run), then every rank raises the first failing rank's error and the
  model refuses to compute until a load succeeds (NOTE [A failed load is guarded]).

Every failure, DCP's ``CheckpointException`` (a ``BaseException``) included, leaves as a
``tiermem:`` error (an ``Exception``) on every rank, after the clean-up.

This module holds what both halves share (this process's pieces, DCP's failures as ``tiermem:``
errors) and the load; the save is :mod:`tiermem.checkpoint.dcp_save`.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from tiermem.checkpoint.dcp_check import checked, same_error
from tiermem.checkpoint.dcp_read import Reader
from tiermem.checkpoint.names import FROZEN, StateName
from tiermem.checkpoint.shards import ShardedValue, key
from tiermem.checkpoint.view import PartPieces, Piece, StateCore, StateReader, StateWriter
from tiermem.errors import StoreError, TierMemError

log = logging.getLogger(__name__)


# -- DCP's reads, through the checked files --------------------------------------------------------
def _load(reader: Reader, values: dict[str, Any]) -> None:
    """DCP reads ``values`` (flat keys of tensors) from ``reader``'s checked checkpoint, in this
    process alone (no collective); whatever fails is a ``tiermem:`` error."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)  # asked for: no_dist
            dcp.load(
                values,
                storage_reader=reader,
                no_dist=True,
                planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            )
    except (Exception, CheckpointException) as e:  # DCP's own is a BaseException
        raise from_dcp(e, f"read its part of the checkpoint {reader.opened.path!r}", "check the disk") from e


# -- this process's values ------------------------------------------------------------------------
class OneBucket:
    """This process's part of one bucket's state at a time, read when DCP first asks for it."""

    def __init__(self, reader: StateReader):
        self.reader, self.index = reader, -1
        self.views: tuple[torch.Tensor, ...] = ()

    def source(self, index: int, part: int, p: Piece) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            if self.index != index:
                self.views, self.index = self.reader.read_local(index), index
            return self.views[part][p.at : p.at + p.hi - p.lo]

        return read


def pieces(core: StateCore, source: Callable[[int, int, Piece], Any]) -> dict[str, ShardedValue]:
    """Every piece of optimizer state this process keeps, by tiermem name, in bucket order."""
    out: dict[str, ShardedValue] = {}
    for index, pieces in core.pieces():
        for part_index, (part, dtype, mine) in enumerate(core.part_pieces(index, pieces)):
            for p in mine:
                name = StateName(part, p.name)
                local = source(index, part_index, p)
                device = local.device if isinstance(local, torch.Tensor) else "cpu"
                out[str(name)] = ShardedValue(key(name), p.shape, p.lo, p.hi, local, dtype=dtype, device=device)
    return out


# -- DCP's failures -------------------------------------------------------------------------------
def from_dcp(e: BaseException, doing: str, fix: str) -> TierMemError:
    """A tiermem error inside DCP's exception, else DCP's first failure as a tiermem error (an
    ``Exception``: DCP's own ``CheckpointException`` is a ``BaseException``)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        inner = first[0] if isinstance(first, tuple) else first
        if isinstance(inner, TierMemError):
            return inner
        if isinstance(inner, OSError):
            return StoreError(f"tiermem: rank {min(failures)} could not {doing} ({inner.strerror or inner}); {fix}")
        return TierMemError(
            f"tiermem: torch.distributed.checkpoint failed on rank {min(failures)} to {doing} "
            f"({type(inner).__name__}: {inner})"
        )
    return (
        e
        if isinstance(e, TierMemError)
        else TierMemError(f"tiermem: torch.distributed.checkpoint failed to {doing} ({type(e).__name__}: {e})")
    )


# -- load --------------------------------------------------------------------------------------------
def load(writer: StateWriter, path: str) -> None:
    """Check the whole directory on every rank, then read this process's pieces into the model
    through the files the checks opened. A read that fails part way (every rank learns of it
    after the last bucket, the collectives kept in step) leaves the model refusing to compute
    until a load succeeds (:meth:`StateWriter.updating`)."""
    core = writer.core
    opened, metadata, meta = checked(writer, path)
    with opened:
        reader = Reader(opened, metadata)
        failed: list[TierMemError] = []

        def guarded(read: Callable[..., None]) -> Callable[..., None]:
            def run(*args: Any) -> None:
                if not failed:  # after a failure each bucket still takes part in its collectives
                    try:
                        read(*args)
                    except TierMemError as e:
                        failed.append(e)
                    except Exception as e:  # noqa: BLE001 - reported once every rank got through
                        failed.append(
                            StoreError(
                                f"tiermem: reading the checkpoint {path!r} failed part way ({type(e).__name__}: "
                                f"{e}); the model refuses to compute until a load succeeds: load it, or another "
                                f"checkpoint, again"
                            )
                        )

            return run

        with writer.updating():
            for index, pieces in core.pieces():
                writer.load_local(
                    index, guarded(functools.partial(_read_pieces, reader, core.part_pieces(index, pieces)))
                )
            writer.release()
            for index, mine in core.frozen_pieces():
                writer.load_frozen(index, mine, guarded(functools.partial(_read_frozen, reader, mine)))
            rest = writer.rest(pieces=True)
            guarded(_load)(reader, {key(name): t for name, t in rest.items()})
            error = same_error(core.group, failed[0] if failed else None)
            if error is not None:
                raise error
            writer.commit_rest(rest)
    writer.take_meta(meta)


def _read_frozen(reader: Reader, pieces: list[Piece], targets: dict[str, torch.Tensor]) -> None:
    """This process's ``pieces`` of a frozen bucket read into ``targets`` (:meth:`StateWriter.load_frozen`)."""
    values = {}
    for p in pieces:
        k, t = key(StateName(FROZEN, p.name)), targets[p.name]
        values[k] = ShardedValue(k, p.shape, p.lo, p.hi, t, dtype=t.dtype)
    if values:
        _load(reader, values)


def _read_pieces(reader: Reader, parts: list[PartPieces], views: tuple[torch.Tensor, ...]) -> None:
    values = {}
    for (part, _, pieces), t in zip(parts, views):
        for p in pieces:
            name = StateName(part, p.name)
            local = t[p.at : p.at + p.hi - p.lo]
            values[key(name)] = ShardedValue(key(name), p.shape, p.lo, p.hi, local, dtype=t.dtype, device=t.device)
    if values:
        _load(reader, values)
