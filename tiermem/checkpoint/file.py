"""Checkpoints keyed by parameter name (never by bucket), streamed, atomic, checksummed.

# NOTE [Checkpoint format]
One file: ``MAGIC``, then each tensor's raw bytes (64-byte aligned), then a JSON footer, its
length (8 bytes, little endian), the footer's xxh3_64 (8 bytes, little endian) and ``MAGIC``
again. The footer holds the precision, step, loss scale, hyperparameters and per-parameter step
counts, and for every tensor its name (``master/<param>``, ``exp_avg/<param>``,
``exp_avg_sq/<param>``, ``frozen/<param>``, ``buffers/<buffer>``), dtype, shape, offset, size and
xxh3_64 (16 hex digits), the hash the NVMe store uses (NOTE [Data checksums]): a tensor is hashed
as it is written, in the pass that hands its bytes to the file, at ~25 GB/s on one core, where
zlib's CRC-32 (formats v1 and v2) ran at ~6.5 GB/s here. Parameter names are the module's
qualified names (the first one, for tied weights), so a model with another bucket size loads it.
Files of ``MAGIC_V2`` (CRC-32s in place of the xxh3s, a 4-byte footer CRC-32) and ``MAGIC_V1``
(as v2, without the footer's checksum) still load; they are never written.

Saving streams bucket by bucket (optimizer state on NVMe passes through one host buffer set at
a time, never the whole state), into a temporary ``<path>.tmp-<pid>`` beside the target, created
exclusively (a file or symlink already at that name is refused, never followed) with mode 0600,
and renamed over ``path`` only once complete and synced: a failed save leaves the previous
checkpoint loadable, and a symlink at ``path`` is replaced, not written through. A save first
removes the temporaries of ``path`` that a killed save left: only names of exactly that form,
only of a pid that is not alive on this machine, never this process's.

Loading checks, before it changes anything and in this order: the footer's checksum; every
footer field's type and range (the Adam hyperparameters by the one rule of NOTE [Adam
hyperparameter rules]); each tensor's size against its dtype and shape and its place inside the
file; the names, shapes and dtypes against the model; every tensor's checksum. It unpickles
nothing. A checkpoint of another precision loads (the master weights and moments are fp32
whatever the precision); the loss scale is taken from it only when the precisions agree, so
an fp32 checkpoint resumed in fp16 keeps the run's scale rather than reset it to 1.0.
"""

from __future__ import annotations

import io
import json
import logging
import os
import stat
import struct
import zlib
from typing import Any, BinaryIO, Callable

import torch
import xxhash

from tiermem.checkpoint.convert import Conversion
from tiermem.checkpoint.directory import is_checkpoint_dir, stale_temporaries
from tiermem.checkpoint.footer import MAGIC, MAGIC_V1, MAGIC_V2, Invalid, check_footer, dtype_named
from tiermem.checkpoint.names import FROZEN, MASTER, params_of
from tiermem.checkpoint.opened import RECORD_CAP
from tiermem.checkpoint.view import ModelState, StateReader, StateWriter
from tiermem.errors import ConfigError, StoreError, TierMemError

log = logging.getLogger(__name__)

# footer length (, the footer's checksum)
_TRAILER = {MAGIC: struct.Struct("<QQ"), MAGIC_V2: struct.Struct("<QI"), MAGIC_V1: struct.Struct("<Q")}
_ALIGN = 64
_CHUNK = 64 << 20


def _footer_sum(magic: bytes, footer: bytes) -> int:
    return xxhash.xxh3_64_intdigest(footer) if magic == MAGIC else zlib.crc32(footer)


class _Crc32:
    """zlib's CRC-32 with the update/intdigest of an xxhash object (formats v1 and v2)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


def _data_sum(magic: bytes):
    return xxhash.xxh3_64() if magic == MAGIC else _Crc32()


def _stored_sum(magic: bytes, e: dict) -> int:
    return int(e["xxh3"], 16) if magic == MAGIC else e["crc32"]


# -- save -----------------------------------------------------------------------------------------
def _bytes(t: torch.Tensor):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _write(reader: StateReader, f) -> None:
    f.write(MAGIC)
    entries = []
    for name, t in reader.tensors():
        f.write(b"\0" * (-f.tell() % _ALIGN))
        data = _bytes(t)
        entries.append(
            {
                "name": name,
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "offset": f.tell(),
                "nbytes": data.nbytes,
                "xxh3": f"{xxhash.xxh3_64_intdigest(data):016x}",
            }
        )
        f.write(data)
    footer = json.dumps({"meta": reader.meta(), "tensors": entries}).encode()
    f.write(footer + _TRAILER[MAGIC].pack(len(footer), _footer_sum(MAGIC, footer)) + MAGIC)
    f.flush()
    os.fsync(f.fileno())


def _remove_stale_temporaries(path: str) -> None:
    """Remove the ``<path>.tmp-<pid>`` files of saves that were killed (NOTE [Checkpoint format])."""
    for entry, pid in stale_temporaries(path):
        if entry.is_dir(follow_symlinks=False):
            continue  # a DCP save's (checkpoint_dir.remove_stale)
        try:
            os.unlink(entry.path)  # a symlink itself, never its target
            log.info("tiermem: removed %r, left by a save of process %s, which is gone", entry.path, pid)
        except FileNotFoundError:
            pass  # another save removed it first
        except OSError as e:
            log.warning("tiermem: cannot remove the stale checkpoint temporary %r (%s)", entry.path, e)


def _create(tmp: str, path: str) -> BinaryIO:
    """``tmp``, new, mode 0600: whatever is already at that name (a symlink too) is refused."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
    except FileExistsError:
        raise StoreError(
            f"tiermem: cannot save the checkpoint to {path!r}: its temporary {tmp!r} already exists "
            f"(left by an earlier process with this pid, or planted there) and is never written "
            f"through; remove it and save again"
        ) from None
    os.fchmod(fd, 0o600)  # whatever the umask
    return os.fdopen(fd, "wb")


def _publish(tmp: str, path: str, directory: str) -> None:
    os.replace(tmp, path)  # atomic: readers see the old checkpoint or the new one, never half; a link is replaced
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)  # the rename itself survives a crash
    finally:
        os.close(dfd)


FORMATS = ("file", "dcp")


def save(state: ModelState, path: str, format: str = "file") -> None:
    """Write ``state`` to ``path`` as one file (``format="file"``) or as a torch.distributed.checkpoint
    directory every rank writes its shards to (``"dcp"``: :mod:`tiermem.checkpoint.dcp`)."""
    if format not in FORMATS:
        raise ConfigError(
            f"tiermem: format={format!r} is not a checkpoint format; pass 'file' (one file) or 'dcp' "
            f"(a torch.distributed.checkpoint directory every rank writes), or leave it out"
        )
    if format == "dcp":
        from tiermem.checkpoint import dcp_save  # torch.distributed.checkpoint takes seconds to import

        dcp_save.save(state.reader, path)
    else:
        _save_file(state.reader, path)


def _save_file(reader: StateReader, path: str) -> None:
    """Write ``reader``'s state to the file ``path``. Under data parallelism every rank calls it (reading
    the state gathers it), rank 0 writes, and the file is renamed into place only when every rank
    got through: a rank failing mid-save leaves the previous checkpoint as it was."""
    core = reader.core
    directory = os.path.dirname(os.path.abspath(path))
    if not core.all_ok(os.path.isdir(directory) or not core.writes_files):
        raise StoreError(
            f"tiermem: cannot save a checkpoint to {path!r}: directory {directory!r} does not "
            f"exist on rank 0; create it or choose another path"
        )
    tmp = f"{path}.tmp-{os.getpid()}"
    f: BinaryIO | None = None
    error: BaseException | None = None
    if core.writes_files:
        try:
            _remove_stale_temporaries(path)
            f = _create(tmp, path)
        except OSError as e:
            error = e
    try:
        if f is not None:
            with f:
                _write(reader, f)
        else:
            for _ in reader.tensors():
                pass  # taking part in the gathers (and on rank 0 when the temporary could not be made)
    except BaseException as e:  # noqa: BLE001 - reported after every rank knows
        error = error or e
    published = False
    try:
        if not core.all_ok(error is None):
            raise (
                error
                if error is not None
                else StoreError(
                    f"tiermem: saving the checkpoint to {path!r} failed on another rank (see its error); any "
                    f"previous checkpoint there is unchanged"
                )
            )
        if core.writes_files:
            _publish(tmp, path, directory)
            published = True
    except BaseException as e:  # whatever stopped it (a full disk, an error reading the state): no debris
        if f is not None and not published:
            try:
                os.unlink(tmp)  # the file this save created, and only that
            except FileNotFoundError:
                pass  # renamed into place before the directory's sync failed
        if isinstance(e, OSError) and not isinstance(e, TierMemError):
            raise StoreError(
                f"tiermem: saving the checkpoint to {path!r} failed ({e.strerror or e}); free space "
                f"or choose another path. Any previous checkpoint there is unchanged"
            ) from e
        raise


# -- load: the footer -----------------------------------------------------------------------------
def _read_footer(f: BinaryIO, path: str) -> tuple[dict, bytes]:
    """The footer, checked, and the file's magic (its format)."""

    def bad(why: str) -> StoreError:
        return StoreError(
            f"tiermem: {path!r} is not a readable tiermem checkpoint ({why}); nothing was loaded. "
            f"Pass a file written by tm.save(), unedited"
        )

    size = os.fstat(f.fileno()).st_size
    head = f.read(len(MAGIC))
    if size < 2 * len(MAGIC) + 8 or head not in _TRAILER:
        raise bad("no tiermem header")
    trailer = _TRAILER[head]
    end = size - len(MAGIC) - trailer.size  # where the footer ends
    f.seek(max(end, 0))
    tail = f.read(trailer.size + len(MAGIC))
    if end < len(MAGIC) or tail[trailer.size :] != head:
        raise bad("truncated: no footer")
    n, *checksum = trailer.unpack(tail[: trailer.size])
    if n > end - len(MAGIC):
        raise bad("corrupt footer length")
    if n > RECORD_CAP:  # read in memory to be parsed: bounded before anything is read
        raise bad(f"corrupt footer length: {n} bytes, more than a footer may hold ({RECORD_CAP})")
    if checksum and _streamed_sum(f, head, end - n, n) != checksum[0]:  # before the footer is held in memory
        raise bad("corrupt footer: it fails its checksum, edited or damaged")
    f.seek(end - n)
    footer = f.read(n)
    if checksum and _footer_sum(head, footer) != checksum[0]:  # the bytes held: the file may have changed since
        raise bad("corrupt footer: it fails its checksum, edited or damaged")
    try:
        doc = json.loads(footer)
        check_footer(doc, end - n, head)
    except (ValueError, RecursionError):
        raise bad("corrupt footer: not JSON") from None
    except Invalid as e:
        raise bad(f"corrupt footer: {e}") from None
    return doc, head


def _streamed_sum(f: BinaryIO, magic: bytes, at: int, n: int) -> int:
    """The footer checksum of the ``n`` bytes at ``at``, read 1 MiB at a time."""
    f.seek(at)
    checksum, left = _data_sum(magic), n
    while left:
        chunk = f.read(min(left, 1 << 20))
        if not chunk:
            return -1  # shorter than it claims: no checksum matches
        checksum.update(chunk)
        left -= len(chunk)
    return checksum.intdigest()


# -- load: against the model, then the data -------------------------------------------------------
def _check(writer: StateWriter, doc: dict, magic: bytes, f: BinaryIO, path: str) -> tuple[dict[str, dict], Conversion]:
    def other(what: str) -> TierMemError:
        return TierMemError(
            f"tiermem: checkpoint {path!r} does not match this model: {what}; nothing was loaded. "
            f"Load it into the model it was saved from"
        )

    index = {e["name"]: e for e in doc["tensors"]}
    meta = doc["meta"]
    expected: dict[str, Any] = {name: (shape, dtypes) for name, shape, dtypes in writer.specs(meta["precision"])}
    have: dict[str, Any] = {name: (tuple(e["shape"]), dtype_named(e["dtype"])) for name, e in index.items()}
    conversion = Conversion(expected, have)  # NOTE [Converting state formats]
    expected, have = conversion.reconciled(expected, have)
    missing, unexpected = sorted(set(expected) - set(have)), sorted(set(have) - set(expected))
    if missing or unexpected:
        trained = sorted(params_of(unexpected, MASTER) & params_of(missing, FROZEN))
        if trained:  # NOTE [Freezing and unfreezing]: unfrozen in the run that saved it
            raise TierMemError(
                f"tiermem: checkpoint {path!r} holds optimizer state for {trained[:5]}, which "
                f"{'is' if len(trained) == 1 else 'are'} frozen in this model and never trained in "
                f"it; nothing was loaded. Unfreeze {'it' if len(trained) == 1 else 'them'} "
                f"(requires_grad_(True)) before tm.load(), as in the run that saved it (freezing "
                f"again after the load keeps the state)"
            )
        raise other(f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, (shape, dtypes) in expected.items():
        if tuple(index[name]["shape"]) != shape:
            raise other(f"{name!r} has shape {tuple(index[name]['shape'])}, the model has {shape}")
        if dtype_named(index[name]["dtype"]) not in dtypes:
            held = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise other(f"{name!r} is {index[name]['dtype']}, the model holds it as {held}")
    strangers = sorted(set(meta["param_step"]) - params_of(expected, MASTER))
    if strangers:
        raise other(f"meta.param_step counts steps of {strangers[:5]}, not trainable parameters of this model")
    writer.check_groups(meta["groups"], f"checkpoint {path!r}")
    for e in index.values():  # every checksum before anything changes
        f.seek(e["offset"])
        checksum, left = _data_sum(magic), e["nbytes"]
        while left:
            chunk = f.read(min(left, _CHUNK))
            if not chunk:
                break
            checksum.update(chunk)
            left -= len(chunk)
        if left or checksum.intdigest() != _stored_sum(magic, e):
            raise StoreError(
                f"tiermem: checkpoint {path!r} is corrupt ({e['name']!r} fails its checksum); "
                f"nothing was loaded. Use another checkpoint"
            )
    return index, conversion


def _read_into(f: io.BufferedReader, e: dict, t: torch.Tensor) -> None:
    dtype = dtype_named(e["dtype"])
    f.seek(e["offset"])
    if t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous():
        f.readinto(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy's stubs: no buffer protocol
        return
    tmp = torch.empty(e["shape"], dtype=dtype)
    f.readinto(tmp.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # (as above)
    t.copy_(tmp.reshape(t.shape))  # the model's piece may be flat (optimizer state), the file's shaped


def _open(path: str) -> io.BufferedReader:
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a directory, a FIFO (which would block), a device
            raise StoreError(
                f"tiermem: {path!r} is {'a directory' if os.path.isdir(path) else 'not a regular file'}, "
                f"not a checkpoint; pass the file path given to tm.save()"
            )
        return open(path, "rb")
    except FileNotFoundError:
        raise StoreError(f"tiermem: no checkpoint at {path!r}; pass the path given to tm.save()") from None
    except TierMemError:
        raise
    except OSError as e:
        raise StoreError(
            f"tiermem: cannot open the checkpoint {path!r} ({e.strerror or e}); check its "
            f"permissions or pass another path"
        ) from None


def _open_checked(writer: StateWriter, path: str) -> tuple[io.BufferedReader, dict, tuple[dict[str, dict], Conversion]]:
    f = _open(path)
    try:
        doc, magic = _read_footer(f, path)
        return f, doc, _check(writer, doc, magic, f, path)  # everything checked before anything changes
    except BaseException:
        f.close()
        raise


def load(state: ModelState, path: str) -> None:
    """Check the whole checkpoint (a file, or a directory of :mod:`tiermem.checkpoint.dcp`),
    then load it. Under data parallelism every rank calls it and reads it (it must be where every
    rank sees it); if any rank finds it unusable, every rank raises before anything changes."""
    is_dir = is_checkpoint_dir(path)  # any other directory is refused as the single file refuses one
    if state.core.all_ok(is_dir):
        from tiermem.checkpoint import dcp as checkpoint_dcp

        checkpoint_dcp.load(state.writer, path)
    elif not state.core.all_ok(not is_dir):
        raise StoreError(
            f"tiermem: {path!r} is a directory on some ranks and not on others; nothing was loaded. "
            f"Load a checkpoint from where every rank sees the same files (a shared filesystem)"
        )
    else:
        _load_file(state.writer, path)


def sharded_state_dict(state: ModelState, guard: Callable[[], None]) -> dict:
    """``tm.sharded_state_dict()`` (NOTE [Sharded values for DCP]); ``guard()`` before each read
    when DCP asks (NOTE [Streamed sharded values])."""
    from tiermem.checkpoint import (
        dcp_user as checkpoint_dcp_user,  # torch.distributed.checkpoint takes seconds to import
    )

    return checkpoint_dcp_user.sharded_state_dict(state.reader, guard)


def load_sharded(state: ModelState, tree: dict) -> None:
    """``tm.load_sharded_state_dict(tree)``."""
    from tiermem.checkpoint import dcp_user as checkpoint_dcp_user

    checkpoint_dcp_user.load_sharded(state.writer, tree)


def _load_file(writer: StateWriter, path: str) -> None:
    try:
        f, doc, (index, conversion) = _open_checked(writer, path)
    except TierMemError:
        writer.core.all_ok(False)
        raise
    with f:
        if not writer.core.all_ok(True):
            raise StoreError(
                f"tiermem: checkpoint {path!r} failed its checks on another rank (see its error); nothing was loaded"
            )
        if conversion:
            conversion.say(f"checkpoint {path!r}")
        held: dict[str, Any] = {name: (tuple(e["shape"]), dtype_named(e["dtype"])) for name, e in index.items()}
        writer.load(conversion.reader(lambda name, t: _read_into(f, index[name], t), held), doc["meta"])
