"""The two slots of each NVMe key: what they hold, which is current, what they cost on disk, and
the words for what went wrong with them.

# NOTE [Two slots, overwritten in place]
A key has two slot files (NOTE [NVMe file layout]). A write goes to the slot that does not hold
the key's current value, reusing that slot's blocks: writing over blocks a file already has is
faster than filling freshly allocated ones, whose extents the filesystem converts as they are
written (fio, 8 MiB O_DIRECT writes on the disk this was built on: ~2.8 GB/s against ~2.0). Only
a slot that must grow is extended (fallocate, so a full disk usually fails before any byte
moves); one that shrinks is truncated. A write, in order:

1. blanks the slot's header (zeroes at offset 0), so a slot being rewritten never reads as valid;
2. resizes the slot if its size changes, then writes every chunk of the value;
3. writes the slot's header, ``gen`` one more than the current value's: this is the switch.

Until step 3 lands the key's current value, in the other slot, is untouched: a write that fails
(ENOSPC, EIO) or a process that dies mid-way leaves it readable, and the slot it spoilt is blank
or missing, never mistaken for data. A failed write removes its slot file. The order relies on
each O_DIRECT write having reached the device when it returns (buffered: the page cache); the
store never asks the disk to flush its volatile cache (fdatasync), so, as before slots, it
promises nothing across a power cut.

A read checks the current slot's length and header (the header carries ``gen``, so a slot left
from an older write does not pass). If that slot is missing, truncated or spoilt, the store
looks at the other slot: when that one still holds the previous value intact, the key falls back
to it and the read fails once, saying so; a read after that returns the previous value. The read
that finds the damage fails rather than hand back the previous value silently: a caller that
reads several keys as one state (optimizer state per bucket) would otherwise mix two steps.
The same holds for a slot whose data fails its checksum (NOTE [Data checksums]); the previous
slot is taken only when its header and every byte of its data check out.

# NOTE [No mix after a fall back]
A fall back leaves the key one write behind the keys written with it: a training run that
retried its step would read this key's older value beside the others' newer ones (master
weights from one step, moments from the next). The store cannot tell which keys belong
together, so it refuses all that could mix: once ``k`` fell back to the value it wrote at
sequence number ``s`` (every successful write takes the next number), a read of any other key
whose current value was written after ``s`` and before the fall back fails, saying to resume
from the last checkpoint. ``k`` itself reads back its previous value, as said above. A key
written again after the fall back is readable again (its value is newer than the damage).

``revert(key)`` makes the previous value current on purpose (undoing a multi-key update).

# NOTE [One value per key, and a few spare files]
``NvmeStore(keep_previous=False)`` (what TieredModel uses) keeps one value per key at rest. A
write still goes to the slot that does not hold the current value, with the same three steps, so
a write that fails or a process that dies mid-way leaves the current value whole; but once the
switch (step 3) has landed, the previous slot's file is released instead of kept. The disk then
holds each value once, plus, while writes are in flight, one file per write beside its key's
value: the journal, bounded by how many writes the caller keeps in flight (TieredModel: a few
buckets, NOTE [Footprint] in tiermem/plan/footprint.py). There is no previous value to fall back
to or ``revert`` to: a damaged value is lost (the read says so, and to resume from the last
checkpoint), and a caller that writes several keys as one state must make a failed update
complete rather than undo it (NOTE [A failed step is rolled forward] in
tiermem/train/homes/nvme_state.py).

A released file is not unlinked at once: it is renamed to ``spare-<n>.tmn`` in a pool of at most
``spares`` files of each size band (sizes within the same power of two), and the next write whose
slot file does not exist takes the spare closest in size (within a factor of two) by renaming it
to its slot, so that it goes over blocks already allocated, which is what made two slots fast
(NOTE [Two slots, overwritten in place]). Renames are metadata only, and never follow a symlink.
A spare holds no value: its old header names another key and is blanked before any data moves.
The file's band is full: it is unlinked. The limit is per band because one shared limit let the
frequent size crowd out the others: ZeroInfinity writes two 8 MiB weight files per 100 MB state
file, the pool filled with weight files, and a third of the state writes made a new file and
fallocated it (bench/RESULTS.md, "2026-12-01 ZeroInfinity's NVMe step"). A
write that needs room the budget lacks first unlinks the spares; ``close()`` unlinks them; a
store made on a directory where a killed run left spares takes them into its pool.

# NOTE [What the NVMe budget counts]
The ledger counts the payload bytes the slot files hold (not the 4096-byte headers or the direct
I/O padding): a key written once counts its size, a key overwritten counts its current and its
previous value, which stays on disk so that the next write can reuse its blocks. An overwrite
therefore needs room for both values, as every crash-safe overwrite does while it runs. While
writes are queued a key holds the sum of the two largest sizes among its slots and its queued
writes, which bounds what its slots ever take on disk at once. With one value per key (NOTE [One
value per key, and a few spare files]) a key at rest counts its one value, and the spare files
count under ``<spare files>`` until a write takes them or they are unlinked.
"""

from __future__ import annotations

import errno
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from tiermem.errors import OutOfTierMemory, StoreError, fmt_bytes
from tiermem.memory import nvme_layout as layout
from tiermem.types import TensorClass, Tier


@dataclass(frozen=True, eq=False)
class Value:
    """What one write stores: the tensor's dtype, shape and size."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        return self.nbytes // self.dtype.itemsize


@dataclass(frozen=True)
class Copy:
    """A value as one slot file holds it."""

    value: Value
    slot: int
    gen: int
    path: str
    header: bytes
    xxh3: Optional[int] = None  # NOTE [Data checksums]; None: written without checksums
    seq: int = 0  # the store's count of successful writes when this one landed, NOTE [No mix after a fall back]


@dataclass(frozen=True)
class FellBack:
    """One fall back (NOTE [No mix after a fall back]): ``key`` went back to the value written
    at ``after``, when the store's last write was ``upto``; ``said`` is what was wrong."""

    key: str
    after: int
    upto: int
    said: str

    def spans(self, key: str, copy: Copy) -> bool:
        """Whether reading ``copy`` of ``key`` now would mix it with this fall back's key."""
        return key != self.key and self.after < copy.seq <= self.upto


@dataclass(eq=False)
class KeyState:
    """Everything the store knows of one key (NOTE [Two slots, overwritten in place])."""

    copies: list[Optional[Copy]] = field(default_factory=lambda: [None, None])  # per slot
    queued: list[Value] = field(default_factory=list)  # writes issued, not finished, in order
    tail: Optional[Future[Any]] = None  # the last request queued, NOTE [Per-key order]
    kind: Optional[TensorClass] = None  # for the ledger's per-class figures

    def current(self) -> Optional[Copy]:
        """The copy reads return: the newer of the slots that hold a value."""
        held = [c for c in self.copies if c is not None]
        return max(held, key=lambda c: c.gen) if held else None

    def latest(self) -> Optional[Value]:
        """What the key holds once its queued writes land (None: nothing)."""
        if self.queued:
            return self.queued[-1]
        cur = self.current()
        return cur.value if cur is not None else None

    def on_disk(self, extra: int = 0) -> int:
        """The bytes the ledger holds for the key, NOTE [What the NVMe budget counts]."""
        sizes = [c.value.nbytes for c in self.copies if c is not None]
        sizes += [v.nbytes for v in self.queued] + [extra]
        return sum(sorted(sizes)[-2:])


SPOILT = (FileNotFoundError, layout.ShortRead, layout.Corrupt)  # what a slot's damage looks like to a read


def spoilt(key: str, copy: Copy, why: BaseException) -> str:
    """What is wrong with ``copy``'s slot file, in words."""
    what = {
        FileNotFoundError: "is missing (removed outside tiermem)",
        layout.ShortRead: f"is truncated ({why})",
        layout.Corrupt: f"is corrupt: {why}",
    }.get(type(why))  # type: ignore[arg-type]  # another type: None
    if what is None:
        what = f"could not be read ({getattr(why, 'strerror', None) or why})"
    return f"NVMe file {copy.path} holding {key!r} {what}"


def io_error(
    op: str, key: str, nbytes: Optional[int], directory: str, err: OSError, kept: Optional[bool]
) -> StoreError:
    """A failed read or write, for the user: the key, the size, the cause and what to change.
    ``kept`` (writes only): whether the key still holds a value."""
    said = "" if kept is None else (f"; {key!r} keeps its previous value" if kept else f"; {key!r} holds no value")
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = (
            "free space on that filesystem, pass a different nvme_dir, or set an NVMe budget below the "
            "free space (Budgets(nvme=...) or NvmeStore(budget=...)) so tiermem refuses before the disk fills"
        )
    elif err.errno == errno.ELOOP:
        fix = (
            f"{err.filename} is a symbolic link, which tiermem never writes through (its target is "
            f"untouched); remove it, and find out who planted it"
        )
    else:
        fix = "check the disk (dmesg) and the directory, or pass a different nvme_dir"
    size = fmt_bytes(nbytes) if nbytes is not None else "?"
    error = StoreError(
        f"tiermem: NVMe {op} of {key!r} ({size}) in {directory} failed: {err.strerror or err}{said}; {fix}"
    )
    error.__cause__ = err
    return error


def over_budget(key: str, need: int, nbytes: int, used: int, allowed: int) -> OutOfTierMemory:
    """A write of ``nbytes`` under ``key`` that would take the key to ``need`` bytes does not fit."""
    kept = need - nbytes
    why = (
        f"{key!r} keeps its previous value ({fmt_bytes(kept)}) on disk beside the new one, so that a "
        f"failed write loses nothing; "
        if kept
        else ""
    )
    return OutOfTierMemory(
        tier=Tier.NVME,
        key=key,
        asked=need,
        used=used,
        allowed=allowed,
        hint=f"{why}pass a budget of at least {fmt_bytes(used + need)} (Budgets(nvme=...) or "
        f"NvmeStore(budget=...)), delete keys you no longer need, or place less on NVMe",
    )


def fell_back(key: str, said: str, previous: Copy, directory: str) -> StoreError:
    """The read that found ``key``'s current slot spoilt (``said``) and fell back to ``previous``."""
    v = previous.value
    return StoreError(
        f"tiermem: {said}; {key!r} falls back to its previous value ({v.numel} x {v.dtype}, "
        f"the one written before the latest) in {previous.path}: read {key!r} again to get "
        f"that value, or write {key!r} again; a training run cannot go on from it (keys "
        f"written with the lost value would mix two steps): resume from the last checkpoint; "
        f"check the disk and that nothing else writes to {directory}"
    )


def lost(key: str, said: str, directory: str) -> StoreError:
    """No slot of ``key`` holds a usable value (``said``: what is wrong)."""
    return StoreError(
        f"tiermem: {said}; the stored value is lost: write {key!r} again (a training run: "
        f"resume from the last checkpoint), and check the disk and that nothing else writes "
        f"to {directory}"
    )


def would_mix(key: str, copy: Copy, why: FellBack) -> StoreError:
    """A read refused by NOTE [No mix after a fall back]."""
    return StoreError(
        f"tiermem: refusing to read {key!r} from {copy.path}: it was written after the value "
        f"{why.key!r} fell back to ({why.said}); read together they would mix two "
        f"generations (e.g. weights of one step with optimizer state of the next): resume from "
        f"the last checkpoint, or write {key!r} again"
    )


def cannot_revert(key: str) -> StoreError:
    return StoreError(
        f"tiermem: cannot revert {key!r}: it holds no value from before its latest write (it was "
        f"written once, or its latest write failed and so changed nothing, or it was reverted "
        f"already); revert only keys whose write succeeded, once each"
    )
