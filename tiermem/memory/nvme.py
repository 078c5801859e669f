"""NvmeStore: tensors as files in a directory, moved with direct I/O on the store's own threads.

File format, chunking and staging live in :mod:`tiermem.memory.nvme_io`, the order of requests
(NOTE [Per-key order]) in :mod:`tiermem.memory.nvme_requests`, what each key's slots hold, the
budget and the spare files in :mod:`tiermem.memory.nvme_journal`; this module holds the store: its
threads, the I/O each request does and the errors users see.

Overwrites, crash safety and the budget: NOTE [Two slots, overwritten in place], NOTE [One value
per key, and a few spare files] and NOTE [What the NVMe budget counts] in
:mod:`tiermem.memory.nvme_keys`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import threading
import weakref
from concurrent.futures import Future
from functools import partial
from typing import Any, Iterator, NamedTuple, Optional, Sequence

import torch

from tiermem.config.budgets import ByteSize, parse_bytes
from tiermem.errors import StoreError, checked_arguments, fmt_bytes
from tiermem.handles import Handle
from tiermem.memory import nvme_dir, nvme_io as nio
from tiermem.memory.base import Store, check_same_layout, unknown_key
from tiermem.memory.ledger import Ledger
from tiermem.memory.nvme_journal import Released, SlotJournal
from tiermem.memory.nvme_keys import SPOILT, Copy, Value, cannot_revert, fell_back, io_error, lost, spoilt
from tiermem.memory.nvme_requests import Requests, spanned
from tiermem.types import TensorClass, Tier

log = logging.getLogger(__name__)


class _InFlight(NamedTuple):
    """One read or write on its way: the key, the slot's copy (None: a read of a key whose only
    queued write failed), the slot file's descriptor (None before it opened) and the future its
    caller waits on; what finishing it needs besides its error and digests."""

    key: str
    copy: Optional[Copy]
    fd: Optional[int]
    future: Future[Any]


@checked_arguments
class NvmeStore(Store):
    """Tensors under ``directory``, two slot files per key, read and written asynchronously.

    ``write(key, src)`` returns at once; keep ``src`` unchanged until the handle's ``wait()``
    returns (no snapshot copy). An overwrite goes over the key's other slot file in place and
    switches to it once every byte landed: a failed write leaves the previous value readable.
    ``read(key, out)`` fills ``out`` after any pending write of ``key``. ``budget`` caps the bytes
    held, both slots of a key counted (default: the free space there). ``direct``: True insists
    on O_DIRECT, False never uses it, None falls back to buffered I/O with a warning where the
    filesystem refuses it. ``keep_previous=False`` keeps one value per key: the previous slot is
    released once a write lands (into a pool of at most ``spares`` files of each size band that
    later writes go over in place), so the disk holds each value once, and nothing can be reverted or fallen back to
    (NOTE [One value per key, and a few spare files]). Files stay on disk after ``close()``
    (spares excepted); ``delete(key)`` removes them.
    The store owns ``directory`` until ``close()`` (NOTE [One store owns a directory]): another
    store there is refused with the holder's pid. Every value carries an xxh3_64 checksum that every
    read checks (NOTE [Data checksums]).

    Args:
        directory: an existing directory for the store's files.
        budget: cap on the bytes held (an int or a string such as ``"100GB"``). Default: the
            filesystem's free space.
        io_threads: threads issuing ``os.pwritev``/``os.preadv`` (requests in flight).
        block_size: bytes per I/O request.
        direct: True insists on ``O_DIRECT``, False never uses it, None uses it where the filesystem
            takes it (buffered I/O with a warning elsewhere).
        keep_previous: keep each key's previous value (a damaged value falls back to it); False keeps
            one value per key.
        spares: with ``keep_previous=False``, spare files kept per size band for later writes.
    """

    tier = Tier.NVME

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        budget: ByteSize | None = None,
        io_threads: int = 8,
        block_size: int = 8 * 2**20,
        direct: bool | None = None,
        keep_previous: bool = True,
        spares: int = 4,
    ):
        self.directory = os.path.abspath(os.fspath(directory))
        nvme_dir.check_options(io_threads, block_size)
        nvme_dir.check_journal(keep_previous, spares)
        nvme_dir.check_directory(self.directory)
        self.direct = nvme_dir.choose_direct(self.directory, direct)  # fails first where no file can be made
        self.checksums = nvme_dir.checksums_wanted(self.directory)  # NOTE [Data checksums]
        allowed = (
            shutil.disk_usage(self.directory).free if budget is None else parse_bytes(budget, what="NvmeStore.budget")
        )
        self.ledger = Ledger(Tier.NVME, allowed)
        lock = nvme_dir.DirectoryLock(self.directory)  # NOTE [One store owns a directory], once all is valid
        lock.acquire()
        self._release_lock = weakref.finalize(self, lock.release)  # at close(), or when collected
        self.block_size = block_size
        self.bytes_written = 0  # bytes of writes that completed
        self.bytes_read = 0  # bytes of reads that completed
        self.stall_seconds = 0.0  # time callers spent blocked in wait() on this store's handles
        self._odirect = os.O_DIRECT if self.direct else 0
        self._staging = nio.StagingPool(block_size, io_threads)
        self._lock = threading.Lock()
        # NOTE [Per-key order]; hashing threads where values are hashed: NOTE [Hashing beside the I/O]
        self._requests = Requests(self._lock, io_threads, hashing=self.checksums)
        self._closed = False
        self._journal = SlotJournal(
            self.directory, self.ledger, keep_previous=keep_previous, spares=spares, direct=self.direct
        )  # every call with self._lock held

    # -- the Store interface --------------------------------------------------------------------
    def write(self, key: str, src: torch.Tensor, kind: Optional[TensorClass] = None) -> Handle:
        """Queue a bit-exact copy of ``src`` under ``key``; keep ``src`` unchanged until ``wait()``.

        Args:
            key: the value's name (a plain string: no path separators).
            src: a CPU tensor to store.
            kind: the :class:`~tiermem.TensorClass` it is, so the ledger reports bytes per class.

        Returns:
            A :class:`~tiermem.Handle`; ``wait()`` returns once every byte landed (or raises a
            :class:`~tiermem.StoreError`).
        """
        nio.check_key(key)
        nio.check_tensor(key, src, "src")
        data = nio.byte_view(src.detach().resolve_conj().resolve_neg().contiguous())
        value = Value(src.dtype, tuple(src.shape), data.numel())
        nio.check_header_fits(key, value.dtype, value.shape, value.nbytes, self.block_size)
        with self._lock:
            self._check_open()
            state = self._journal.admit(key, value, kind)  # NOTE [What the NVMe budget counts]
            future = self._requests.enqueue(state, partial(self._start_write, key, value, data))
        return Handle(future, on_stall=self._add_stall)

    def read(self, key: str, out: torch.Tensor) -> Handle:
        """Queue a copy of ``key``'s value into ``out``, after any pending write of ``key``.

        Args:
            key: a key written before.
            out: a contiguous CPU tensor of the value's dtype and element count.

        Returns:
            A :class:`~tiermem.Handle`; ``wait()`` returns once ``out`` holds the checked value
            (or raises a :class:`~tiermem.StoreError` naming the file).
        """
        nio.check_key(key)
        nio.check_tensor(key, out, "out")
        with self._lock:
            self._check_open()
            if (value := self._journal.latest(key)) is None:
                raise unknown_key(key, self.tier)
            check_same_layout(key, value.dtype, value.numel, out, self.tier)
            start = partial(self._start_read, key, nio.byte_view(out), out)
            future = self._requests.enqueue(self._journal.keys[key], start)
        return Handle(future, on_stall=self._add_stall)

    def delete(self, key: str) -> None:
        """Remove ``key`` and its files once its queued requests are done. Unknown keys are ignored.

        Args:
            key: the key to remove.
        """
        with self._lock:
            self._check_open()
            if self._journal.latest(key) is None:
                return
            future = self._requests.enqueue(self._journal.keys[key], partial(self._start_delete, key))
        future.result()

    def revert(self, key: str) -> None:
        """Once ``key``'s queued requests are done, undo its latest write: the key holds the value
        it held before again (the other slot's). Lets a caller that wrote several keys undo them
        all when one fails; a key keeps one value back, so this works once per write.

        Args:
            key: a key written before (with ``keep_previous=True``).
        """
        with self._lock:
            self._check_open()
            if self._journal.latest(key) is None:
                raise unknown_key(key, self.tier)
            future = self._requests.enqueue(self._journal.keys[key], partial(self._start_revert, key))
        future.result()

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return isinstance(key, str) and self._journal.latest(key) is not None

    def keys(self) -> Iterator[str]:
        """The keys that hold a value."""
        with self._lock:
            return iter(self._journal.held_keys())

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """``(shape, dtype)`` of the latest value written under ``key``.

        Args:
            key: a key written before.
        """
        value = self._value(key)
        return value.shape, value.dtype

    def nbytes(self, key: str) -> int:
        """Bytes of the latest value written under ``key``.

        Args:
            key: a key written before.
        """
        return self._value(key).nbytes

    def close(self) -> None:
        """Finish every queued request, then stop the I/O threads. The files stay on disk."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._requests.drain()
            self._journal.spares.drop_all()  # they hold no value
        self._requests.shutdown()
        self._release_lock()

    def __enter__(self) -> "NvmeStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"NvmeStore({self.directory!r}, {'direct' if self.direct else 'buffered'} I/O, "
            f"{len(list(self.keys()))} keys, {fmt_bytes(self.used)} of {fmt_bytes(self.allowed)})"
        )

    # -- seams: tests replace these on one store to inject failures -------------------------------
    def _pwritev(self, fd: int, bufs: Sequence[nio.Buf], offset: int) -> int:
        return os.pwritev(fd, bufs, offset)

    def _preadv(self, fd: int, bufs: Sequence[nio.Buf], offset: int) -> int:
        return os.preadv(fd, bufs, offset)

    def _fallocate(self, fd: int, size: int) -> None:
        nio.allocate(fd, size)

    # -- requests (run on the I/O threads) ------------------------------------------------------
    @property
    def keep_previous(self) -> bool:
        """Whether each key keeps its previous value (NOTE [One value per key, and a few spare files])."""
        return self._journal.keep_previous

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
            want = nio.file_size(value.nbytes, self.direct)
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
            [partial(nio.digest, data[b0:b1]) for b0, b1 in spans] if beside else None,
            hash_first=True,
        )

    def _finish_write(self, io: _InFlight, err: Optional[BaseException], digests: Sequence[Optional[int]] = ()) -> None:
        key, copy, fd, future = io
        assert copy is not None  # a write has its slot
        if fd is not None:
            try:
                if err is None:  # the switch, step 3 of NOTE [Two slots, overwritten in place]
                    v = copy.value
                    xxh3 = nio.combine(digests) if self.checksums else None
                    copy = dataclasses.replace(
                        copy,
                        xxh3=xxh3,
                        header=nio.encode_header(key, v.dtype, v.shape, v.nbytes, copy.gen, xxh3, self.block_size),
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
        except (OSError, nio.ShortRead, nio.Corrupt) as e:
            self._finish_read(_InFlight(key, current, fd, future), e)
            return
        checked = current.xxh3 is not None
        beside = checked and self._hash_beside(current.value.nbytes)  # NOTE [Hashing beside the I/O]

        def chunk(b0: int, b1: int) -> Optional[int]:
            head, digest = nio.read_chunk(
                self._preadv, fd, data, b0, b1, b0 == 0, self._staging, self.direct, checked and not beside
            )
            if head is not None:
                nio.check_header(head, current.header)
            return digest

        spans = nio.chunks(current.value.nbytes, self.block_size)
        self._requests.fan_out(
            [spanned("read", key, partial(chunk, b0, b1)) for b0, b1 in spans],
            partial(self._finish_read, _InFlight(key, current, fd, future)),
            [partial(nio.digest, data[b0:b1]) for b0, b1 in spans] if beside else None,
        )

    def _finish_read(self, io: _InFlight, err: Optional[BaseException], digests: Sequence[Optional[int]] = ()) -> None:
        key, copy, fd, future = io
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        if err is None and copy is not None and copy.xxh3 is not None:
            try:
                nio.check_data(nio.combine(digests), copy.xxh3)
            except nio.Corrupt as e:
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

    def _value(self, key: str) -> Value:
        with self._lock:
            if (value := self._journal.latest(key)) is None:
                raise unknown_key(key, self.tier)
        return value

    def _add_stall(self, seconds: float) -> None:
        with self._lock:
            self.stall_seconds += seconds

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(
                f"tiermem: NvmeStore({self.directory!r}) is closed; make a new store to keep using the directory"
            )
