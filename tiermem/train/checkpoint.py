"""Checkpoints keyed by parameter name (never by bucket), streamed, atomic, checksummed.

# NOTE [Checkpoint format]
One file: ``MAGIC``, then each tensor's raw bytes (64-byte aligned), then a JSON footer, its
length (8 bytes, little endian) and ``MAGIC`` again. The footer holds the step, loss scale,
hyperparameters and per-parameter step counts, and for every tensor its name
(``master/<param>``, ``exp_avg/<param>``, ``exp_avg_sq/<param>``, ``frozen/<param>``,
``buffers/<buffer>``), dtype, shape, offset and CRC-32. Parameter names are the module's
qualified names (the first one, for tied weights), so a model with another bucket size loads it.

Saving streams bucket by bucket (optimizer state on NVMe passes through one host buffer set at
a time, never the whole state), into a temporary file beside the target that is renamed over it
only once complete and synced: a failed save leaves the previous checkpoint loadable. Loading
checks the footer and every checksum before it changes anything, and unpickles nothing.
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from typing import BinaryIO

import torch

from tiermem.errors import StoreError, TierMemError
from tiermem.train.state import ModelState

MAGIC = b"TIERMEM-CKPT-v1\n"
_ALIGN = 64
_CHUNK = 64 << 20


# -- save -----------------------------------------------------------------------------------------
def _bytes(t: torch.Tensor):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _write(state: ModelState, f) -> None:
    f.write(MAGIC)
    entries = []
    for name, t in state.tensors():
        f.write(b"\0" * (-f.tell() % _ALIGN))
        data = _bytes(t)
        entries.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "offset": f.tell(), "nbytes": data.nbytes, "crc32": zlib.crc32(data)})
        f.write(data)
    footer = json.dumps({"meta": state.meta(), "tensors": entries}).encode()
    f.write(footer + struct.pack("<Q", len(footer)) + MAGIC)
    f.flush()
    os.fsync(f.fileno())


def _publish(tmp: str, path: str, directory: str) -> None:
    os.replace(tmp, path)  # atomic: readers see the old checkpoint or the new one, never half
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)  # the rename itself survives a crash
    finally:
        os.close(dfd)


def save(state: ModelState, path: str) -> None:
    """Write ``state`` to ``path``. Under data parallelism every rank calls it (reading the state
    gathers it), rank 0 writes, and the file is renamed into place only when every rank got
    through: a rank failing mid-save leaves the previous checkpoint as it was."""
    directory = os.path.dirname(os.path.abspath(path))
    if not state.all_ok(os.path.isdir(directory) or not state.writes_files):
        raise StoreError(f"tiermem: cannot save a checkpoint to {path!r}: directory {directory!r} does not "
                         f"exist on rank 0; create it or choose another path")
    tmp = f"{path}.tmp-{os.getpid()}"
    error: BaseException | None = None
    try:
        if state.writes_files:
            with open(tmp, "wb") as f:
                _write(state, f)
        else:
            for _ in state.tensors():
                pass  # taking part in the gathers
    except BaseException as e:  # noqa: BLE001 - reported after every rank knows
        error = e
    try:
        if not state.all_ok(error is None):
            raise error if error is not None else StoreError(
                f"tiermem: saving the checkpoint to {path!r} failed on another rank (see its error); any "
                f"previous checkpoint there is unchanged")
        if state.writes_files:
            _publish(tmp, path, directory)
    except BaseException as e:  # whatever stopped it (a full disk, an error reading the state): no debris
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise StoreError(f"tiermem: saving the checkpoint to {path!r} failed ({e.strerror or e}); free space "
                             f"or choose another path. Any previous checkpoint there is unchanged") from e
        raise


# -- load -----------------------------------------------------------------------------------------
def _read_footer(f: BinaryIO, path: str) -> dict:
    def bad(why: str) -> StoreError:
        return StoreError(f"tiermem: {path!r} is not a readable tiermem checkpoint ({why}); pass a file "
                          f"written by tm.save()")
    size = os.fstat(f.fileno()).st_size
    if size < 2 * len(MAGIC) + 8 or f.read(len(MAGIC)) != MAGIC:
        raise bad("no tiermem header")
    f.seek(size - len(MAGIC) - 8)
    tail = f.read(8 + len(MAGIC))
    if tail[8:] != MAGIC:
        raise bad("truncated: no footer")
    (n,) = struct.unpack("<Q", tail[:8])
    if n > size:
        raise bad("corrupt footer length")
    f.seek(size - len(MAGIC) - 8 - n)
    try:
        doc = json.loads(f.read(n))
        meta = doc["meta"]
        for key in ("precision", "step", "param_step", "scaler", "groups"):
            meta[key]  # noqa: B018 - present, or the footer is not ours
        for e in doc["tensors"]:
            if not isinstance(getattr(torch, e["dtype"], None), torch.dtype):
                raise ValueError(e["dtype"])
            e["name"], e["shape"], e["offset"], e["nbytes"], e["crc32"]  # noqa: B018
    except (ValueError, KeyError, TypeError):
        raise bad("corrupt footer") from None
    return doc


def _check(state: ModelState, doc: dict, f: BinaryIO, path: str) -> dict[str, dict]:
    index = {e["name"]: e for e in doc["tensors"]}
    expected = dict(state.shapes())
    missing, unexpected = sorted(set(expected) - set(index)), sorted(set(index) - set(expected))
    if missing or unexpected:
        raise TierMemError(f"tiermem: checkpoint {path!r} does not match this model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}; load it into the model it was saved from")
    for name, shape in expected.items():
        if tuple(index[name]["shape"]) != shape:
            raise TierMemError(f"tiermem: checkpoint {path!r}: {name!r} has shape {tuple(index[name]['shape'])}, "
                               f"the model has {shape}; load it into the model it was saved from")
    if len(doc["meta"]["groups"]) != len(state.param_groups):
        raise TierMemError(f"tiermem: checkpoint {path!r} has {len(doc['meta']['groups'])} param groups, this "
                           f"model {len(state.param_groups)}; use the same optimizer spec")
    for e in index.values():  # every checksum before anything changes
        f.seek(e["offset"])
        crc, left = 0, e["nbytes"]
        while left:
            chunk = f.read(min(left, _CHUNK))
            if not chunk:
                break
            crc, left = zlib.crc32(chunk, crc), left - len(chunk)
        if left or crc != e["crc32"]:
            raise StoreError(f"tiermem: checkpoint {path!r} is corrupt ({e['name']!r} fails its checksum); "
                             f"nothing was loaded. Use another checkpoint")
    return index


def _read_into(f: BinaryIO, e: dict, t: torch.Tensor) -> None:
    dtype = getattr(torch, e["dtype"])
    f.seek(e["offset"])
    if t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous():
        f.readinto(t.reshape(-1).view(torch.uint8).numpy())
        return
    tmp = torch.empty(e["shape"], dtype=dtype)
    f.readinto(tmp.reshape(-1).view(torch.uint8).numpy())
    t.copy_(tmp)


def _open_checked(state: ModelState, path: str) -> tuple[BinaryIO, dict, dict[str, dict]]:
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise StoreError(f"tiermem: no checkpoint at {path!r}; pass the path given to tm.save()") from None
    try:
        doc = _read_footer(f, path)
        return f, doc, _check(state, doc, f, path)  # everything checked before anything changes
    except BaseException:
        f.close()
        raise


def load(state: ModelState, path: str) -> None:
    """Check the whole checkpoint, then load it. Under data parallelism every rank calls it and
    reads the file (it must be where every rank sees it); if any rank finds it unusable, every
    rank raises before anything changes."""
    try:
        f, doc, index = _open_checked(state, path)
    except TierMemError:
        state.all_ok(False)
        raise
    with f:
        if not state.all_ok(True):
            raise StoreError(f"tiermem: checkpoint {path!r} failed its checks on another rank (see its error); "
                             f"nothing was loaded")
        state.load(lambda name, t: _read_into(f, index[name], t), doc["meta"])
