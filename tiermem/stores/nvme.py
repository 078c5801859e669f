"""NvmeStore: tensors as files in a directory, moved with direct I/O on the store's own threads.

File format, chunking and staging live in :mod:`tiermem.stores.nvme_io`; this module holds the
store: the per-key order of requests, the budget, crash safety and the errors users see.

# NOTE [Per-key order]
Every request (write, read, delete) of a key waits for the key's previous request, so a read
sees the latest write issued before it, and an overwrite never races an older write. The wait is
a done-callback that submits the next request to the pool, so no I/O thread ever blocks on
another. Requests of different keys run concurrently, each split into chunks.

# NOTE [Write, then switch]
A write goes to ``<file>.part`` (space reserved up front with fallocate, so a full disk usually
fails before any byte moves) and replaces the key's file with an atomic rename only once every
byte landed. A failed write (ENOSPC, EIO) removes the part file and leaves the previous value
readable. While an overwrite is in flight the ledger holds the larger of the old and new sizes.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Optional, Sequence

import torch

from tiermem.budgets import ByteSize, Ledger, parse_bytes
from tiermem.errors import ConfigError, OutOfTierMemory, StoreError, fmt_bytes
from tiermem.handles import Handle
from tiermem.stores import nvme_io as nio
from tiermem.stores.aligned import ALIGN, round_up
from tiermem.stores.base import Store, check_same_layout, unknown_key
from tiermem.types import Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Entry:
    """One value of a key: where it lives and what it is."""

    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    header: bytes

    @property
    def numel(self) -> int:
        return self.nbytes // self.dtype.itemsize


class NvmeStore(Store):
    """Tensors under ``directory``, one file per key, read and written asynchronously.

    ``write(key, src)`` returns at once; ``src`` must stay unchanged until the handle's
    ``wait()`` returns (the store reads it in place, no snapshot copy). ``read(key, out)`` fills
    ``out`` after any pending write of ``key``. ``budget`` caps the bytes held (default: the free
    space on that filesystem). ``direct``: True insists on O_DIRECT, False never uses it, None
    probes the directory and falls back to buffered I/O with a warning where it is refused.
    Files stay on disk after ``close()``; ``delete(key)`` removes a key's file.
    """

    tier = Tier.NVME

    def __init__(self, directory: str | os.PathLike, *, budget: ByteSize | None = None,
                 io_threads: int = 8, block_size: int = 8 * 2**20, direct: bool | None = None):
        self.directory = os.path.abspath(os.fspath(directory))
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise ConfigError(f"tiermem: NvmeStore.io_threads={io_threads!r} must be an int >= 1; "
                              f"pass e.g. io_threads=8")
        if (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < ALIGN
                or block_size % ALIGN):
            raise ConfigError(f"tiermem: NvmeStore.block_size={block_size!r} must be a positive multiple "
                              f"of {ALIGN} bytes (direct I/O needs aligned lengths); pass e.g. 8 * 2**20")
        nio.check_directory(self.directory)
        self.direct, refused = nio.probe_direct(self.directory, direct)
        if refused is not None and direct:
            raise ConfigError(f"tiermem: NvmeStore(direct=True) but {self.directory} refuses O_DIRECT "
                              f"({refused.strerror}); pass direct=None to fall back to buffered I/O, or "
                              f"put nvme_dir on a filesystem with direct I/O (ext4, xfs)")
        if refused is not None:
            log.warning("tiermem: %s refuses O_DIRECT (%s): NvmeStore falls back to buffered I/O through "
                        "the page cache, which is slower and takes RAM; put nvme_dir on a filesystem "
                        "with direct I/O (ext4, xfs) to avoid this", self.directory, refused.strerror)
        allowed = (shutil.disk_usage(self.directory).free if budget is None
                   else parse_bytes(budget, what="NvmeStore.budget"))
        self.ledger = Ledger(Tier.NVME, allowed)
        self.block_size = block_size
        self.bytes_written = 0  # bytes of writes that completed
        self.bytes_read = 0  # bytes of reads that completed
        self.stall_seconds = 0.0  # time callers spent blocked in wait() on this store's handles
        self._odirect = os.O_DIRECT if self.direct else 0
        self._staging = nio.StagingPool(block_size, io_threads)
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="tiermem-nvme")
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._latest: dict[str, _Entry] = {}  # what each key holds once its queued writes land
        self._committed: dict[str, _Entry] = {}  # what each key's file holds now
        self._in_flight: dict[str, list[int]] = {}  # sizes of each key's queued writes
        self._tail: dict[str, Future] = {}  # each key's last queued request, NOTE [Per-key order]
        self._outstanding = 0
        self._closed = False
        self._kinds: dict[str, object] = {}  # key -> TensorClass, for the ledger's per-class figures

    # -- the Store interface --------------------------------------------------------------------
    def write(self, key: str, src: torch.Tensor, kind: object = None) -> Handle:
        """Queue a bit-exact copy of ``src`` under ``key``; keep ``src`` unchanged until ``wait()``.
        ``kind`` (a TensorClass) lets the ledger report bytes per class."""
        nio.check_key(key)
        nio.check_tensor(key, src, "src")
        data = nio.byte_view(src.detach().resolve_conj().resolve_neg().contiguous())
        shape, nbytes = tuple(src.shape), data.numel()
        entry = _Entry(os.path.join(self.directory, nio.file_name(key)), src.dtype, shape, nbytes,
                       nio.encode_header(key, src.dtype, shape, nbytes))
        with self._lock:
            self._check_open()
            held, used = self.ledger.held(key), self.ledger.used
            if nbytes > held and used - held + nbytes > self.ledger.allowed:
                raise OutOfTierMemory(
                    tier=Tier.NVME, key=key, asked=nbytes, used=used - held, allowed=self.ledger.allowed,
                    hint=f"pass a budget of at least {fmt_bytes(used - held + nbytes)} (Budgets(nvme=...) "
                         f"or NvmeStore(budget=...)), delete keys you no longer need, or place less on NVMe")
            if kind is not None:
                self._kinds[key] = kind
            self.ledger.reserve(key, max(held, nbytes), self._kinds.get(key))  # NOTE [Write, then switch]
            self._in_flight.setdefault(key, []).append(nbytes)
            self._latest[key] = entry
            future = self._enqueue(key, partial(self._start_write, key, entry, data))
        return Handle(future, on_stall=self._add_stall)

    def read(self, key: str, out: torch.Tensor) -> Handle:
        """Queue a copy of ``key``'s value into ``out`` (same dtype and element count, contiguous)."""
        nio.check_key(key)
        nio.check_tensor(key, out, "out")
        with self._lock:
            self._check_open()
            entry = self._latest.get(key)
            if entry is None:
                raise unknown_key(key, self.tier)
            check_same_layout(key, entry.dtype, entry.numel, out, self.tier)
            future = self._enqueue(key, partial(self._start_read, key, nio.byte_view(out), out))
        return Handle(future, on_stall=self._add_stall)

    def delete(self, key: str) -> None:
        """Remove ``key`` and its file once its queued requests are done. Unknown keys are ignored."""
        with self._lock:
            self._check_open()
            if key not in self._latest:
                return
            future = self._enqueue(key, partial(self._start_delete, key))
        future.result()

    def __contains__(self, key: object) -> bool:
        return key in self._latest

    def keys(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._latest))

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """``(shape, dtype)`` of the latest value written under ``key``."""
        entry = self._entry(key)
        return entry.shape, entry.dtype

    def nbytes(self, key: str) -> int:
        return self._entry(key).nbytes

    def close(self) -> None:
        """Finish every queued request, then stop the I/O threads. The files stay on disk."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._outstanding:
                self._idle.wait()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "NvmeStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"NvmeStore({self.directory!r}, {'direct' if self.direct else 'buffered'} I/O, "
                f"{len(self._latest)} keys, {fmt_bytes(self.used)} of {fmt_bytes(self.allowed)})")

    # -- seams: tests replace these on one store to inject failures -------------------------------
    def _pwritev(self, fd: int, bufs: Sequence, offset: int) -> int:
        return os.pwritev(fd, bufs, offset)

    def _preadv(self, fd: int, bufs: Sequence, offset: int) -> int:
        return os.preadv(fd, bufs, offset)

    def _fallocate(self, fd: int, size: int) -> None:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            os.ftruncate(fd, size)  # the filesystem cannot reserve space; just size the file

    # -- requests (run on the I/O threads) ------------------------------------------------------
    def _enqueue(self, key: str, start: Callable[[Future], None]) -> Future:
        """Queue ``start`` behind ``key``'s previous request (NOTE [Per-key order]); holds the lock."""
        future: Future = Future()
        previous = self._tail.get(key)
        self._tail[key] = future
        self._outstanding += 1
        go = lambda _done=None: self._pool.submit(start, future)  # noqa: E731
        if previous is None:
            go()
        else:
            previous.add_done_callback(go)
        return future

    def _start_write(self, key: str, entry: _Entry, data: torch.Tensor, future: Future) -> None:
        part, fd = entry.path + ".part", None
        try:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | self._odirect, 0o644)
            self._fallocate(fd, nio.HEADER + (round_up(entry.nbytes) if self.direct else entry.nbytes))
        except OSError as e:
            self._finish_write(key, entry, fd, future, e)
            return
        self._fan_out([partial(nio.write_chunk, self._pwritev, fd, data, b0, b1,
                               entry.header if b0 == 0 else None, self._staging, self.direct)
                       for b0, b1 in nio.chunks(entry.nbytes, self.block_size)],
                      lambda err: self._finish_write(key, entry, fd, future, err))

    def _finish_write(self, key: str, entry: _Entry, fd: Optional[int], future: Future,
                      err: Optional[BaseException]) -> None:
        part = entry.path + ".part"
        if fd is not None:
            try:
                os.close(fd)
            except OSError as e:
                err = err or e
        if err is None:
            try:
                os.replace(part, entry.path)  # the switch: NOTE [Write, then switch]
            except OSError as e:
                err = e
        if err is not None:
            with contextlib.suppress(OSError):
                os.unlink(part)
        with self._lock:
            self._in_flight[key].remove(entry.nbytes)
            if err is None:
                self._committed[key] = entry
                self.bytes_written += entry.nbytes
            elif self._latest.get(key) is entry:  # nothing newer queued: the key keeps its old value
                if key in self._committed:
                    self._latest[key] = self._committed[key]
                else:
                    del self._latest[key]
            self._settle(key)
        self._complete(key, future, self._error("write", key, entry, err))

    def _start_read(self, key: str, data: torch.Tensor, out: torch.Tensor, future: Future) -> None:
        with self._lock:
            entry = self._committed.get(key)
        fd = None
        try:
            if entry is None:  # its only queued write failed
                raise unknown_key(key, self.tier)
            check_same_layout(key, entry.dtype, entry.numel, out, self.tier)
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC | self._odirect)
            except FileNotFoundError:
                raise StoreError(
                    f"tiermem: NVMe file {entry.path} holding {key!r} is missing (removed outside tiermem); "
                    f"write {key!r} again, and keep other programs from deleting files in "
                    f"{self.directory}") from None
            size = os.fstat(fd).st_size
            if size < nio.HEADER + entry.nbytes:
                raise nio.ShortRead(f"{size} bytes on disk, {nio.HEADER + entry.nbytes} expected")
        except (OSError, nio.ShortRead) as e:
            self._finish_read(key, entry, fd, future, e)
            return

        def first_chunk(b1: int) -> None:
            raw = nio.read_chunk(self._preadv, fd, data, 0, b1, True, self._staging, self.direct)
            nio.check_header(raw, entry.header, key=key, path=entry.path)

        parts = nio.chunks(entry.nbytes, self.block_size)
        self._fan_out([partial(first_chunk, parts[0][1])]
                      + [partial(nio.read_chunk, self._preadv, fd, data, b0, b1, False, self._staging,
                                 self.direct) for b0, b1 in parts[1:]],
                      lambda err: self._finish_read(key, entry, fd, future, err))

    def _finish_read(self, key: str, entry: Optional[_Entry], fd: Optional[int], future: Future,
                     err: Optional[BaseException]) -> None:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        if err is None:
            with self._lock:
                self.bytes_read += entry.nbytes  # type: ignore[union-attr]
        self._complete(key, future, self._error("read", key, entry, err))

    def _start_delete(self, key: str, future: Future) -> None:
        with self._lock:
            entry = self._committed.pop(key, None)
            if not self._in_flight.get(key):  # a write queued after this delete keeps its entry
                self._latest.pop(key, None)
            self._settle(key)
        err = None
        if entry is not None:
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass
            except OSError as e:
                err = StoreError(f"tiermem: could not remove {entry.path} holding {key!r} ({e.strerror}); "
                                 f"the key is forgotten, remove the file by hand")
        self._complete(key, future, err)

    def _fan_out(self, jobs: list[Callable[[], object]],
                 finish: Callable[[Optional[BaseException]], None]) -> None:
        """Run ``jobs`` on the pool, the first (it carries the header) on this thread; the thread
        that ends the last one calls ``finish``."""
        fan = nio.Fanout(len(jobs), finish)
        for job in jobs[1:]:
            self._pool.submit(fan.run, job)
        fan.run(jobs[0])

    def _complete(self, key: str, future: Future, err: Optional[BaseException]) -> None:
        with self._lock:
            if self._tail.get(key) is future:
                del self._tail[key]
            self._outstanding -= 1
            if not self._outstanding:
                self._idle.notify_all()
        if err is None:
            future.set_result(None)
        else:
            future.set_exception(err)

    # -- helpers -------------------------------------------------------------------------------
    def _settle(self, key: str) -> None:
        """Hold the larger of ``key``'s stored and queued sizes (only ever shrinks); holds the lock."""
        sizes = self._in_flight.get(key)
        if sizes == []:
            del self._in_flight[key]
        committed = self._committed.get(key)
        if committed is None and not sizes:
            self.ledger.release(key)
        else:
            self.ledger.reserve(key, max([committed.nbytes if committed else 0, *(sizes or [])]),
                                self._kinds.get(key))

    def _error(self, op: str, key: str, entry: Optional[_Entry],
               err: Optional[BaseException]) -> Optional[BaseException]:
        """The error a user sees for a failed request: names the key, the file and what to change."""
        if err is None or isinstance(err, StoreError):
            return err
        path = entry.path if entry is not None else self.directory
        if isinstance(err, nio.ShortRead):
            return StoreError(f"tiermem: NVMe file {path} holding {key!r} is truncated ({err}); the stored "
                              f"value is lost: write {key!r} again, and check the disk and that nothing "
                              f"else writes to {self.directory}")
        if not isinstance(err, OSError):
            return err  # a bug, not an I/O failure: let it through as it is
        kept = ""
        if op == "write":
            kept = (f"; {key!r} keeps its previous value" if key in self._committed
                    else f"; {key!r} holds no value")
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = (f"free space on that filesystem, pass a different nvme_dir, or set an NVMe budget "
                   f"below the free space (Budgets(nvme=...) or NvmeStore(budget=...)) so tiermem "
                   f"refuses before the disk fills")
        else:
            fix = "check the disk (dmesg) and the directory, or pass a different nvme_dir"
        nbytes = fmt_bytes(entry.nbytes) if entry is not None else "?"
        error = StoreError(f"tiermem: NVMe {op} of {key!r} ({nbytes}) in {self.directory} failed: "
                           f"{err.strerror or err}{kept}; {fix}")
        error.__cause__ = err
        return error

    def _entry(self, key: str) -> _Entry:
        entry = self._latest.get(key)
        if entry is None:
            raise unknown_key(key, self.tier)
        return entry

    def _add_stall(self, seconds: float) -> None:
        with self._lock:
            self.stall_seconds += seconds

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"tiermem: NvmeStore({self.directory!r}) is closed; make a new store to "
                             f"keep using the directory")
