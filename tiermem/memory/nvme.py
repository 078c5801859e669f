"""NvmeStore: tensors as files in a directory, moved with direct I/O on the store's own threads.

This module holds the store's surface: its construction, the entry points that queue requests
(write, read, delete, revert), the budget, and close. What each request does on the I/O threads
is in :mod:`tiermem.memory.nvme_transfers`; the file format in :mod:`tiermem.memory.nvme_layout`,
chunking and staging in :mod:`tiermem.memory.nvme_io`, the order of requests (NOTE [Per-key
order]) in :mod:`tiermem.memory.nvme_requests`, what each key's slots hold, the budget and the
spare files in :mod:`tiermem.memory.nvme_journal`.

Overwrites, crash safety and the budget: NOTE [Two slots, overwritten in place], NOTE [One value
per key, and a few spare files] and NOTE [What the NVMe budget counts] in
:mod:`tiermem.memory.nvme_keys`.
"""

from __future__ import annotations

import os
import shutil
import threading
import weakref
from functools import partial
from typing import Iterator, Optional

import torch

from tiermem.config.budgets import ByteSize, parse_bytes
from tiermem.errors import StoreError, checked_arguments, fmt_bytes
from tiermem.handles import Handle
from tiermem.memory import nvme_dir, nvme_io as nio, nvme_layout as layout
from tiermem.memory.base import Store, check_same_layout, unknown_key
from tiermem.memory.ledger import Ledger
from tiermem.memory.nvme_journal import SlotJournal
from tiermem.memory.nvme_keys import Value
from tiermem.memory.nvme_requests import Requests
from tiermem.memory.nvme_transfers import NvmeTransfers
from tiermem.types import TensorClass, Tier


@checked_arguments
class NvmeStore(NvmeTransfers, Store):
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
        layout.check_key(key)
        layout.check_tensor(key, src, "src")
        data = layout.byte_view(src.detach().resolve_conj().resolve_neg().contiguous())
        value = Value(src.dtype, tuple(src.shape), data.numel())
        layout.check_header_fits(key, value.dtype, value.shape, value.nbytes, self.block_size)
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
        layout.check_key(key)
        layout.check_tensor(key, out, "out")
        with self._lock:
            self._check_open()
            if (value := self._journal.latest(key)) is None:
                raise unknown_key(key, self.tier)
            check_same_layout(key, value.dtype, value.numel, out, self.tier)
            start = partial(self._start_read, key, layout.byte_view(out), out)
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

    # -- properties and helpers -----------------------------------------------------------------
    @property
    def keep_previous(self) -> bool:
        """Whether each key keeps its previous value (NOTE [One value per key, and a few spare files])."""
        return self._journal.keep_previous

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
