"""The save half of :mod:`tiermem.checkpoint.dcp` (whose docstring has the whole flow): every rank
writes this process's pieces of a DCP directory through tiermem's hashed, exclusive files (NOTE
[Checkpoint directories]), one bucket read at a time, and rank 0 publishes the directory once every
rank got through.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem

from tiermem.checkpoint import directory as disk
from tiermem.checkpoint.dcp import OneAtATime, flat_value, from_dcp, frozen_pieces, own_piece, pieces, whole_frozen
from tiermem.checkpoint.shards import MANIFESTS, META, key, nested
from tiermem.checkpoint.view import Piece, StateCore, StateReader
from tiermem.errors import StoreError, TierMemError

log = logging.getLogger(__name__)


# -- DCP's storage, through tiermem's files --------------------------------------------------------
class _HashingFileSystem(FileSystem):
    """DCP's local filesystem, but every file it writes is created by :func:`disk.create_exclusive`
    and hashed as written; ``written`` is this process's files (NOTE [Checkpoint directories])."""

    def __init__(self) -> None:
        super().__init__()
        self.written: disk.Files = {}

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[Any]:
        if "r" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with disk.HashedFile(disk.create_exclusive(str(path))) as f:
            yield f
        self.written[os.path.basename(str(path))] = (f.nbytes, f.digest())

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        self.written[os.path.basename(str(new_path))] = self.written.pop(os.path.basename(str(path)))

    def rm_file(self, path) -> None:
        super().rm_file(path)
        self.written.pop(os.path.basename(str(path)), None)


class _Writer(FileSystemWriter):
    """One file per rank, written in the plan's order by one thread, each tensor resolved just
    before it is written (no copy-ahead): one bucket of state in memory at a time."""

    def __init__(self, path: str):
        super().__init__(
            path, single_file_per_rank=True, sync_files=True, thread_count=1, per_thread_copy_ahead=0, overwrite=False
        )
        self.fs: _HashingFileSystem = _HashingFileSystem()


class _InOrder(DefaultSavePlanner):
    """DCP's planner, with each rank's writes in bucket order (``order``: key -> position)."""

    def __init__(self, order: dict[str, int]):
        super().__init__(dedup_save_to_lowest_rank=True)
        self._order = order

    def finish_plan(self, new_plan):
        plan = super().finish_plan(new_plan)
        last = len(self._order)
        return dataclasses.replace(plan, items=sorted(plan.items, key=lambda i: self._order.get(i.index.fqn, last)))


# -- save --------------------------------------------------------------------------------------------
def save(reader: StateReader, path: str) -> None:
    """Write a DCP directory at ``path`` (NOTE [Checkpoint directories]); every rank calls it."""
    group = reader.core.group
    path = os.path.abspath(path)
    pid = int(group.broadcast_(torch.tensor([os.getpid()], dtype=torch.int64)).item())  # rank 0's names the temporary
    tmp = f"{path}.tmp-{pid}"
    made = _temporary(reader.core, path, pid)
    writer = _Writer(tmp)
    try:
        _write_agreed(reader, writer, tmp, path)
        _publish(reader.core, tmp, path)
    except BaseException as e:
        _discard_if(made, tmp)  # the new checkpoint unpublished, or the previous one publish swapped out
        if isinstance(e, TierMemError) or not isinstance(e, Exception):
            raise
        raise _save_failed(e, path) from e


def _write_agreed(reader: StateReader, writer: _Writer, tmp: str, path: str) -> None:
    """Every rank writes its part and its manifest into ``tmp``, then learns whether every rank did: if one did
    not, each raises (its own error, or one naming another rank's)."""
    group = reader.core.group
    error: BaseException | None = None
    try:
        _write(reader, writer)
        disk.write_manifest(tmp, group.rank, group.world, writer.fs.written)
    except BaseException as e:  # noqa: BLE001 - reported after every rank knows
        error = e
    finally:
        reader.release()
    if not group.all_ok(error is None):
        raise (
            error
            if error is not None
            else StoreError(
                f"tiermem: saving the checkpoint to {path!r} failed on another rank (see its error); any previous "
                f"checkpoint there is unchanged"
            )
        )


def _save_failed(e: Exception, path: str) -> BaseException:
    """A save's failure that is not a ``tiermem:`` error yet, as one."""
    if isinstance(e, OSError):
        return _as_store(e, path)
    return TierMemError(
        f"tiermem: saving the checkpoint to {path!r} failed ({type(e).__name__}: {e}); any previous "
        f"checkpoint there is unchanged"
    )


def _temporary(core: StateCore, path: str, pid: int) -> bool:
    """Rank 0 makes the temporary directory; every rank checks that it sees it. Whether this
    process made it (to remove it on failure)."""
    group, tmp = core.group, f"{path}.tmp-{pid}"
    error: BaseException | None = None
    made = False
    if core.writes_files:
        try:
            if not os.path.isdir(os.path.dirname(path)):
                raise StoreError(
                    f"tiermem: cannot save a checkpoint to {path!r}: directory "
                    f"{os.path.dirname(path)!r} does not exist on rank 0; create it or choose another "
                    f"path"
                )
            disk.check_target(path)
            disk.make_temporary(path, pid)
            made = True
        except (OSError, TierMemError) as e:
            error = e
    if not group.all_ok(error is None):
        raise (
            _as_store(error, path)
            if error is not None
            else StoreError(
                f"tiermem: saving the checkpoint to {path!r} failed on rank 0 (see its error); any previous "
                f"checkpoint there is unchanged"
            )
        )
    sees = os.path.isdir(tmp)
    if not group.all_ok(sees):
        _discard_if(made, tmp)
        who = f"rank {group.rank} of {group.world}" if not sees else "another rank"
        raise StoreError(
            f"tiermem: {who} does not see the directory {tmp!r} rank 0 made for the checkpoint; nothing "
            f"was written. Save it where every rank sees the same files (a shared filesystem)"
        )
    return made


def _publish(core: StateCore, tmp: str, path: str) -> None:
    """Rank 0 moves the complete directory into place; every rank returns only once it is there,
    and raises if it is not."""
    error: BaseException | None = None
    if core.writes_files:
        try:
            _check_complete(tmp, core.group.world)
            disk.sync_dir(tmp)
            disk.publish(tmp, path)
        except BaseException as e:  # noqa: BLE001 - reported after every rank knows
            error = e
    if not core.group.all_ok(error is None):  # the published checkpoint, on every rank
        raise (
            error
            if error is not None
            else StoreError(
                f"tiermem: publishing the checkpoint at {path!r} failed on rank 0 (see its error); any "
                f"previous checkpoint there is unchanged"
            )
        )


def _write(reader: StateReader, writer: _Writer) -> None:
    """DCP writes this process's pieces, one bucket read at a time, those of the sharded frozen
    parameters too; rank 0 also the rest (frozen parameters not sharded, buffers)."""
    core = reader.core
    values: dict[str, Any] = dict(pieces(core, OneAtATime(reader.read_local, reader, copy=False).source))
    chunks, frozen = OneAtATime(lambda index: (reader.read_frozen(index),), reader, copy=True), core.layout.frozen

    def frozen_source(index: int, p: Piece) -> Any:
        if frozen.keeps_copy(p.name):
            return functools.partial(own_piece, frozen, p.name)  # its piece of its own-dtype copy
        return chunks.source(index, 0, p)

    values.update(frozen_pieces(core, frozen_source))  # read at home: nothing gathered
    if core.writes_files:  # the same on every rank: rank 0's are saved, as by the single file
        # each frozen parameter read from its home only when DCP writes it (one tensor at a time):
        # a frozen base homed on NVMe passes through host memory one parameter at a time
        values.update(whole_frozen(core, lambda n: functools.partial(flat_value, frozen, n)))
    order = {key(name): i for i, name in enumerate(values)}
    tree = nested(values, json.dumps(reader.meta()))
    if core.writes_files:
        tree[MANIFESTS] = core.group.world
    else:
        del tree[META]  # one copy, rank 0's
    group = core.group
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)  # one process: no_dist
            dcp.save(
                tree, storage_writer=writer, planner=_InOrder(order), process_group=group.pg, no_dist=group.world == 1
            )
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException; it carries every rank's failure
        raise from_dcp(e, "write its part of the checkpoint", "free space or choose another path") from e


def _check_complete(tmp: str, world: int) -> None:
    present = set(os.listdir(tmp))
    missing = [disk.MANIFEST.format(rank=r) for r in range(world) if disk.MANIFEST.format(rank=r) not in present]
    if missing or disk.METADATA not in present:
        raise StoreError(
            f"tiermem: the checkpoint in {tmp!r} lacks {missing[:3] or [disk.METADATA]} after every rank "
            f"wrote its part: save it where every rank sees the same files (a shared filesystem)"
        )


def _discard_if(condition: bool, tmp: str) -> None:
    if condition:
        disk.discard(tmp)


def _as_store(e: BaseException, path: str) -> BaseException:
    if isinstance(e, TierMemError) or not isinstance(e, OSError):
        return e
    return StoreError(
        f"tiermem: saving the checkpoint to {path!r} failed ({e.strerror or e}); free space or choose "
        f"another path. Any previous checkpoint there is unchanged"
    )
