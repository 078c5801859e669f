"""The work of each :class:`~tiermem.memory.nvme.NvmeStore` request, on the store's threads: a
read's and a write's start (open the slot, fan its chunks out) and finish (switch or check the
checksum, fall back to the previous value), a delete's and a revert's, and the error a user sees.

:class:`NvmeTransfers` is a mixin of the store: its methods use the store's journal, requests,
staging pool and lock; the syscall seams tests replace on one store live here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence

import torch

from tiermem.errors import StoreError
from tiermem.memory import nvme_io as nio, nvme_layout as layout
from tiermem.memory.base import check_same_layout, unknown_key
from tiermem.memory.nvme_journal import Released, SlotJournal
from tiermem.memory.nvme_keys import SPOILT, Copy, Value, cannot_revert, fell_back, io_error, lost, spoilt
from tiermem.memory.nvme_requests import Requests, spanned
from tiermem.types import Tier

log = logging.getLogger("tiermem.memory.nvme")  # the store's logger: its warnings keep their name


class _InFlight(NamedTuple):
    """One read or write on its way: the key, the slot's copy (None: a read of a key whose only
    queued write failed), the slot file's descriptor (None before it opened) and the future its
    caller waits on; what finishing it needs besides its error and digests."""

    key: str
    copy: Optional[Copy]
    fd: Optional[int]
    future: Future[Any]


class NvmeTransfers:
    """The requests of an NVMe store as they run on its I/O threads (mixed into NvmeStore)."""

    tier: Tier
    directory: str
    direct: bool
    checksums: bool
    block_size: int
    bytes_written: int
    bytes_read: int
    _odirect: int
    _staging: nio.StagingPool
    _lock: threading.Lock
    _requests: Requests
    _journal: SlotJournal

    if TYPE_CHECKING:  # NvmeStore's property

        @property
        def keep_previous(self) -> bool: ...

    # -- seams: tests replace these on one store to inject failures -------------------------------
    def _pwritev(self, fd: int, bufs: Sequence[nio.Buf], offset: int) -> int:
        return os.pwritev(fd, bufs, offset)

    def _preadv(self, fd: int, bufs: Sequence[nio.Buf], offset: int) -> int:
        return os.preadv(fd, bufs, offset)

    def _fallocate(self, fd: int, size: int) -> None:
        nio.allocate(fd, size)

    # -- requests (run on the I/O threads) ------------------------------------------------------
    def _start_write(self, key: str, value: Value, data: torch.Tensor, future: Future[Any]) -> None:
        with self._lock:
            copy = self._journal.next_copy(key, value)
        fd = None
        try:  # steps 1 and 2 of NOTE [Two slots, overwritten in place]
            if copy.gen == 0:  # the key holds nothing: a file in the other slot is left from an earlier store
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._journal.path(key, 1 - copy.slot))
            if not self.keep_previous and not os.path.lexists(copy.path):
                with self._lock:
                    spare = self._journal.take_spare(value)
                if spare is not None:  # reuse its blocks: NOTE [One value per key, and a few spare files]
                    os.rename(spare, copy.path)
            fd = os.open(copy.path, nio.WRITE_FLAGS | self._odirect, 0o600)  # never through a symlink
            want = layout.file_size(value.nbytes, self.direct)
            nio.ready_slot(self._pwritev, self._fallocate, fd, want, self._staging, self.direct)
        except OSError as e:
            self._finish_write(_InFlight(key, copy, fd, future), e)
            return
        spans = nio.chunks(value.nbytes, self.block_size)
        beside = self._hash_beside(value.nbytes)  # NOTE [Hashing beside the I/O]
        self._requests.fan_out(
            [
                spanned(
                    "write",
                    key,
                    partial(
                        nio.write_chunk,
                        self._pwritev,
                        fd,
                        data,
                        b0,
                        b1,
                        self._staging,
                        self.direct,
                        self.checksums and not beside,
                    ),
                )
                for b0, b1 in spans
            ],
            partial(self._finish_write, _InFlight(key, copy, fd, future)),
            [partial(layout.digest, data[b0:b1]) for b0, b1 in spans] if beside else None,
            hash_first=True,
        )

    def _finish_write(self, io: _InFlight, err: Optional[BaseException], digests: Sequence[Optional[int]] = ()) -> None:
        key, copy, fd, future = io
        assert copy is not None  # a write has its slot
        if fd is not None:
            try:
                if err is None:  # the switch, step 3 of NOTE [Two slots, overwritten in place]
                    v = copy.value
                    xxh3 = layout.combine(digests) if self.checksums else None
                    copy = dataclasses.replace(
                        copy,
                        xxh3=xxh3,
                        header=layout.encode_header(key, v.dtype, v.shape, v.nbytes, copy.gen, xxh3, self.block_size),
                    )
                    nio.write_header(self._pwritev, fd, copy.header, self._staging, self.direct)
            except OSError as e:
                err = e
            try:
                os.close(fd)
            except OSError as e:
                err = err or e
        if err is not None:  # the slot holds nothing usable now: give its blocks back
            with contextlib.suppress(OSError):
                os.unlink(copy.path)
        with self._lock:
            released = self._journal.landed(key, copy, err is None)  # NOTE [One value per key, and a few spare files]
            if err is None:
                self.bytes_written += copy.value.nbytes
        if released is not None:
            self._release_file(released)
        self._complete(key, future, self._error("write", key, copy, err))

    def _start_read(self, key: str, data: torch.Tensor, out: torch.Tensor, future: Future[Any]) -> None:
        with self._lock:
            current = self._journal.current(key)
        fd = None
        try:
            if current is None:  # its only queued write failed
                raise unknown_key(key, self.tier)
            check_same_layout(key, current.value.dtype, current.value.numel, out, self.tier)
            with self._lock:
                self._journal.check_no_mix(key, current)  # NOTE [No mix after a fall back]
            fd = nio.open_slot(current.path, current.value.nbytes, self._odirect)
        except (OSError, layout.ShortRead, layout.Corrupt) as e:
            self._finish_read(_InFlight(key, current, fd, future), e)
            return
        checked = current.xxh3 is not None
        beside = checked and self._hash_beside(current.value.nbytes)  # NOTE [Hashing beside the I/O]

        def chunk(b0: int, b1: int) -> Optional[int]:
            head, digest = nio.read_chunk(
                self._preadv, fd, data, b0, b1, b0 == 0, self._staging, self.direct, checked and not beside
            )
            if head is not None:
                layout.check_header(head, current.header)
            return digest

        spans = nio.chunks(current.value.nbytes, self.block_size)
        self._requests.fan_out(
            [spanned("read", key, partial(chunk, b0, b1)) for b0, b1 in spans],
            partial(self._finish_read, _InFlight(key, current, fd, future)),
            [partial(layout.digest, data[b0:b1]) for b0, b1 in spans] if beside else None,
        )

    def _finish_read(self, io: _InFlight, err: Optional[BaseException], digests: Sequence[Optional[int]] = ()) -> None:
        key, copy, fd, future = io
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        if err is None and copy is not None and copy.xxh3 is not None:
            try:
                layout.check_data(layout.combine(digests), copy.xxh3)
            except layout.Corrupt as e:
                err = e
        if copy is not None and isinstance(err, SPOILT):
            err = self._fall_back(key, copy, err)
        elif err is None:
            with self._lock:
                self.bytes_read += copy.value.nbytes  # type: ignore[union-attr]
        self._complete(key, future, self._error("read", key, copy, err))

    def _fall_back(self, key: str, bad: Copy, why: BaseException) -> StoreError:
        """The current copy of ``key`` is spoilt: switch to the previous one if it is intact
        (NOTE [Two slots, overwritten in place]). Returns the error the read fails with."""
        with self._lock:
            previous = self._journal.previous(key, bad)
        said = spoilt(key, bad, why)
        if previous is not None:
            why_too = nio.check_slot(
                self._preadv,
                previous.path,
                previous.value.nbytes,
                previous.header,
                previous.xxh3,
                self._staging,
                self.direct,
            )
            if why_too is None:
                with self._lock:
                    self._journal.fall_back(key, bad, previous, said)
                with contextlib.suppress(OSError):
                    os.unlink(bad.path)
                log.warning("tiermem: %s; %r falls back to its previous value", said, key)
                return fell_back(key, said, previous, self.directory)
            said += f"; so is the previous value's: {spoilt(key, previous, why_too)}"
        return lost(key, said, self.directory)

    def _start_delete(self, key: str, future: Future[Any]) -> None:
        with self._lock:
            self._journal.forget_copies(key)  # writes queued after this delete still land
        err = None
        for slot in (0, 1):
            path = self._journal.path(key, slot)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                err = err or StoreError(
                    f"tiermem: could not remove {path} holding {key!r} ({e.strerror}); "
                    f"the key is forgotten, remove the file by hand"
                )
        self._complete(key, future, err)

    def _start_revert(self, key: str, future: Future[Any]) -> None:
        with self._lock:
            dropped = self._journal.revert(key)
        if dropped is not None:
            with contextlib.suppress(OSError):
                os.unlink(dropped.path)  # a reader going by generations must not find it either
        self._complete(key, future, cannot_revert(key) if dropped is None else None)

    def _complete(self, key: str, future: Future[Any], err: Optional[BaseException]) -> None:
        with self._lock:
            if self._requests.finished(self._journal.keys.get(key), future):  # the key's last request
                self._journal.forget_if_empty(key)  # nothing stored, nothing queued: forget it
        if err is None:
            future.set_result(None)
        else:
            future.set_exception(err)

    # -- helpers -------------------------------------------------------------------------------
    def _hash_beside(self, nbytes: int) -> bool:
        """Whether a value of ``nbytes`` is hashed on the hashing threads (NOTE [Hashing beside the I/O])."""
        return self._requests.hasher is not None and min(nbytes, self.block_size) >= nio.HASH_HANDOFF

    def _release_file(self, released: Released) -> None:
        """A slot file whose value is no longer wanted: kept as its spare, or unlinked."""
        renamed = False
        if released.spare is not None:
            try:
                os.rename(released.path, released.spare)
                renamed = True
            except OSError:
                pass
            with self._lock:
                self._journal.kept_spare(released, renamed)
        if not renamed:
            with contextlib.suppress(OSError):
                os.unlink(released.path)

    def _error(self, op: str, key: str, copy: Optional[Copy], err: Optional[BaseException]) -> Optional[BaseException]:
        """The error a user sees for a failed request: names the key, the file and what to change."""
        if err is None or isinstance(err, StoreError) or not isinstance(err, OSError):
            return err  # already explained, or a bug (not an I/O failure): let it through as it is
        with self._lock:
            kept = None if op != "write" else self._journal.holds(key)
        return io_error(op, key, copy.value.nbytes if copy is not None else None, self.directory, err, kept)
