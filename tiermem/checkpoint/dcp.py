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
import math
import threading
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from tiermem.checkpoint.dcp_check import checked, same_error
from tiermem.checkpoint.dcp_read import Reader
from tiermem.checkpoint.names import BUFFERS, FROZEN, StateName
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
class OneAtATime:
    """This process's part of one bucket (or one frozen chunk) at a time, read from its home when a
    piece of it is first asked for: into the home's own buffer set (optimizer state; valid until
    its next read), or copied out and the home's buffer released at once (``copy``: a frozen
    chunk, read into a buffer of its own). ``source`` gives views for a save that writes each
    before the next read (``tm.save``); ``box`` a copy taken under the lock together with the read
    (NOTE [Streamed sharded values]: a writer may resolve from several threads)."""

    def __init__(self, read: Callable[[int], tuple[torch.Tensor, ...]], reader: StateReader, *, copy: bool):
        self._read, self._reader, self._copy = read, reader, copy
        self._index, self._parts = -1, ()  # type: tuple[int, tuple[torch.Tensor, ...]]
        self._lock = threading.Lock()

    def forget(self) -> None:
        with self._lock:
            self._index, self._parts = -1, ()

    def _part(self, index: int, part: int) -> torch.Tensor:
        """Part ``part`` of bucket ``index``, read if it is not the one held (the lock held)."""
        if self._index != index:
            self._index, self._parts = -1, ()  # the previous bucket goes before the next is read
            if self._copy:
                try:
                    self._parts = tuple(t.to("cpu", copy=True) for t in self._read(index))
                finally:
                    self._reader.release()
            else:
                self._parts = self._read(index)
            self._index = index
        return self._parts[part]

    def source(self, index: int, part: int, p: Piece) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            with self._lock:
                return self._part(index, part)[p.at : p.at + p.hi - p.lo]

        return read

    def box(self, index: int, part: int, begin: int, n: int) -> torch.Tensor:
        """Elements ``[begin, begin + n)`` of part ``part`` of bucket ``index``, in a tensor of their own."""
        with self._lock:
            return self._part(index, part)[begin : begin + n].to("cpu", copy=True)


def pieces(
    core: StateCore, source: Callable[[int, int, Piece], Any], guard: Optional[Callable[[], None]] = None
) -> dict[str, ShardedValue]:
    """Every piece of optimizer state this process keeps, by tiermem name, in bucket order;
    ``source(index, part, piece)`` gives each its local elements (a ShardedValue's ``local``)."""
    out: dict[str, ShardedValue] = {}
    for index, pieces in core.pieces():
        for part_index, (part, dtype, mine) in enumerate(core.part_pieces(index, pieces)):
            for p in mine:
                name = StateName(part, p.name)
                local = source(index, part_index, p)
                device = local.device if isinstance(local, torch.Tensor) else "cpu"
                out[str(name)] = ShardedValue(
                    key(name), p.shape, p.lo, p.hi, local, dtype=dtype, device=device, guard=guard
                )
    return out


def frozen_pieces(
    core: StateCore, source: Callable[[int, Piece], Any], guard: Optional[Callable[[], None]] = None
) -> dict[str, ShardedValue]:
    """The pieces of the frozen parameters sharded over the ranks this process keeps, by tiermem
    name, in bucket order, each in its own dtype (NOTE [Frozen weights sharded over the ranks]):
    ``source(index, piece)`` gives each its local elements (of its copy in its own dtype where it
    keeps one, else of its working copy in chunk ``index``)."""
    out: dict[str, ShardedValue] = {}
    for index, mine in core.frozen_pieces():
        for p in mine:
            name = StateName(FROZEN, p.name)
            out[str(name)] = ShardedValue(
                key(name), p.shape, p.lo, p.hi, source(index, p), dtype=core.frozen_dtype(p.name), guard=guard
            )
    return out


def whole_frozen(
    core: StateCore, source: Callable[[str], Any], guard: Optional[Callable[[], None]] = None
) -> dict[str, Any]:
    """The frozen parameters this process keeps whole (not sharded over the ranks), by tiermem
    name, each a ShardedValue of all its elements whose local elements ``source(name)`` gives (a
    scalar or an empty one: its value, read now), then the buffers (the module's own tensors)."""
    frozen = core.layout.frozen
    out: dict[str, Any] = {}
    for n in core.whole_frozen(pieces=True):
        shape, dtype = frozen.meta(n)
        name = StateName(FROZEN, n)
        if not shape or not math.prod(shape):  # nothing to stream
            out[str(name)] = frozen.value(n)
        else:
            out[str(name)] = ShardedValue(key(name), shape, 0, math.prod(shape), source(n), dtype=dtype, guard=guard)
    out.update((str(StateName(BUFFERS, b)), t) for b, t in core.module.named_buffers())
    return out


def flat_value(frozen: Any, name: str) -> torch.Tensor:
    """Frozen parameter ``name``'s value, flat, read now."""
    return frozen.value(name).reshape(-1)


def own_piece(frozen: Any, name: str) -> torch.Tensor:
    """This process's piece of frozen parameter ``name``'s copy in its own dtype, read now."""
    return frozen.copy_piece(name)[0]


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
