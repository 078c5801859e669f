"""The NVMe store's aligned, chunked transfers: the staging pool and the reads and writes of a
slot file's header and chunks (what the bytes mean: :mod:`tiermem.memory.nvme_layout`).

# NOTE [Hashing beside the I/O]
A request keeps ``io_threads`` chunks in flight, one per I/O thread, as fio keeps ``iodepth``
blocks in flight. An I/O thread that hashed its chunk after the syscall would leave the disk one
request short for as long as the hash takes (on a device emulated to reward every request in
flight, bench/nvme.py: 7.5 chunks in flight of 8 with the hash inline, 7.65 handed over, 7.8
with no checksums; 1.03x the throughput of inline hashing). So the chunks of a request of at
least ``HASH_HANDOFF`` bytes per chunk are hashed on the store's hashing threads: a write's chunk
is handed over as its I/O starts (the source stays unchanged until the write's handle returns,
so its bytes are the ones that land), a read's once its bytes have landed, and the I/O thread
goes straight to the next chunk. The binding releases the GIL while it hashes (xxhash >= 3,
inputs past 64 KiB), so the hash runs on another core while the I/O threads wait in their
syscalls. A request ends once every chunk's I/O and hash have ended; a hash whose chunk failed
is skipped. Smaller chunks are hashed inline, right after their syscall: handing over a few KiB
would cost more than hashing them. What hashing still costs is CPU, ~0.07 s per GiB (xxh3 at
~14 GB/s from memory the cache does not hold): on 2 cores that other processes keep busy, a
write with checksums ran at 0.80-0.91x the same write without them.

# NOTE [Chunks and staging]
A request is split into chunks of ``block_size`` bytes (a multiple of 4096) that run
concurrently on the store's threads. A read's chunk 0 also carries the header, in the same
syscall; a write's header is a separate 4096-byte write after every chunk landed. With direct
I/O, a tensor whose first byte sits on a 4096 boundary is read and written in place; only a
ragged tail (< 4096 bytes) and the header go through a staging slot. A tensor that is not
aligned goes through a staging slot chunk by chunk (one memcpy per chunk). Slots come from a
bounded pool: at most one per I/O thread, allocated on first use and reused after that.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Callable, Optional, Sequence, Union

import torch

from tiermem.memory import nvme_layout as layout  # layout.digest looked up at each call: tests replace it
from tiermem.memory.aligned import ALIGN, aligned_empty, is_aligned, round_up
from tiermem.memory.nvme_layout import HEADER, Corrupt, ShortRead, buffer_of, check_data, check_header, combine

HASH_HANDOFF = 2**20  # chunks of at least this many bytes are hashed beside the I/O, NOTE [Hashing beside the I/O]
WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW  # slot files: 0600, never via a symlink
Buf = Union[memoryview, bytes, bytearray]  # what the vectored reads and writes take
PWritev = Callable[[int, Sequence[Buf], int], int]
PReadv = Callable[[int, Sequence[Buf], int], int]


def chunks(nbytes: int, block: int) -> list[tuple[int, int]]:
    """Body ranges ``[b0, b1)`` of at most ``block`` bytes; an empty value still has chunk 0
    (a read's chunk 0 carries the header)."""
    return [(b0, min(b0 + block, nbytes)) for b0 in range(0, max(nbytes, 1), block)]


# -- the staging pool ----------------------------------------------------------------------------
class StagingPool:
    """At most ``limit`` aligned slots of ``HEADER + block`` bytes, made on first use, then reused."""

    def __init__(self, block: int, limit: int):
        self.block, self.limit = block, limit
        self._free: list[torch.Tensor] = []
        self._made = 0
        self._cond = threading.Condition()

    def acquire(self) -> torch.Tensor:
        with self._cond:
            while not self._free and self._made >= self.limit:
                self._cond.wait()
            if self._free:
                return self._free.pop()
            self._made += 1
        return aligned_empty(HEADER + self.block, pin=False)

    def release(self, slot: torch.Tensor) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    @property
    def allocated(self) -> int:
        return self._made


# -- one chunk of a transfer ------------------------------------------------------------------
def write_chunk(
    pwritev: PWritev, fd: int, src: torch.Tensor, b0: int, b1: int, pool: StagingPool, direct: bool, checked: bool
) -> Optional[int]:
    """Write body bytes ``[b0, b1)`` of ``src`` (uint8, 1-d) at ``HEADER + b0``; returns their
    digest when ``checked`` (NOTE [Data checksums])."""
    _write_body(pwritev, fd, src, b0, b1, pool, direct)
    return layout.digest(src[b0:b1]) if checked else None


def _write_body(
    pwritev: PWritev, fd: int, src: torch.Tensor, b0: int, b1: int, pool: StagingPool, direct: bool
) -> None:
    n, offset = b1 - b0, HEADER + b0
    if not n:
        return
    if not direct:
        write_all(pwritev, fd, [buffer_of(src[b0:b1])], offset)
        return
    main = n // ALIGN * ALIGN if is_aligned(src) else 0
    tail = n - main
    if tail == 0:
        write_all(pwritev, fd, [buffer_of(src[b0:b1])], offset)  # aligned chunk: no copy
        return
    slot = pool.acquire()
    try:
        padded = round_up(tail)
        slot[:tail].copy_(src[b0 + main : b1])
        slot[tail:padded].zero_()  # no stale memory on disk
        bufs = ([buffer_of(src[b0 : b0 + main])] if main else []) + [buffer_of(slot[:padded])]
        write_all(pwritev, fd, bufs, offset)  # aligned body in place, the tail from the slot
    finally:
        pool.release(slot)


def write_header(pwritev: PWritev, fd: int, header: Optional[bytes], pool: StagingPool, direct: bool) -> None:
    """Write ``header`` (``HEADER`` bytes) at offset 0; None writes zeroes, which no reader takes
    for a header (NOTE [Two slots, overwritten in place])."""
    raw = header if header is not None else bytes(HEADER)
    if not direct:
        write_all(pwritev, fd, [raw], 0)
        return
    slot = pool.acquire()
    try:
        slot[:HEADER].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        write_all(pwritev, fd, [buffer_of(slot[:HEADER])], 0)
    finally:
        pool.release(slot)


def allocate(fd: int, size: int) -> None:
    """Reserve ``size`` bytes for the file ``fd`` (just size it where the filesystem cannot reserve)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # the filesystem cannot reserve space; just size the file


def ready_slot(
    pwritev: PWritev, fallocate: Callable[[int, int], None], fd: int, want: int, pool: StagingPool, direct: bool
) -> None:
    """Make the slot file ``fd`` ready for a value's data, ``want`` bytes in all: its header blanked
    (a file being rewritten never reads as valid), then grown (``fallocate``) or truncated to size
    (steps 1 and 2 of NOTE [Two slots, overwritten in place])."""
    st = os.fstat(fd)
    size = st.st_size
    if st.st_mode & 0o077:  # a file left by an older tiermem, made under the umask
        os.fchmod(fd, 0o600)
    if size:
        write_header(pwritev, fd, None, pool, direct)
    if size < want:
        fallocate(fd, want)
    elif size > want:
        os.ftruncate(fd, want)


def read_header(preadv: PReadv, fd: int, pool: StagingPool, direct: bool) -> bytes:
    """The ``HEADER`` bytes at offset 0 (raises :class:`ShortRead` if the file is shorter)."""
    if not direct:
        raw = bytearray(HEADER)
        read_all(preadv, fd, [raw], 0, HEADER)
        return bytes(raw)
    slot = pool.acquire()
    try:
        read_all(preadv, fd, [buffer_of(slot[:HEADER])], 0, HEADER)
        return bytes(buffer_of(slot[:HEADER]))
    finally:
        pool.release(slot)


def read_chunk(
    preadv: PReadv,
    fd: int,
    out: torch.Tensor,
    b0: int,
    b1: int,
    want_header: bool,
    pool: StagingPool,
    direct: bool,
    checked: bool,
) -> tuple[Optional[bytes], Optional[int]]:
    """Read body bytes ``[b0, b1)`` into ``out`` (uint8, 1-d); returns the header (chunk 0 only)
    and, when ``checked``, the digest of the bytes read (NOTE [Data checksums])."""
    head = _read_body(preadv, fd, out, b0, b1, want_header, pool, direct)
    return head, (layout.digest(out[b0:b1]) if checked else None)


def _read_body(
    preadv: PReadv, fd: int, out: torch.Tensor, b0: int, b1: int, want_header: bool, pool: StagingPool, direct: bool
) -> Optional[bytes]:
    n = b1 - b0
    offset = 0 if want_header else HEADER + b0
    need = n + (HEADER if want_header else 0)
    if not direct:
        head = bytearray(HEADER) if want_header else None
        into: list[Buf] = [head] if head is not None else []
        into += [buffer_of(out[b0:b1])] if n else []
        read_all(preadv, fd, into, offset, need)
        return bytes(head) if head is not None else None
    main = n // ALIGN * ALIGN if is_aligned(out) else 0
    tail = n - main
    if not want_header and tail == 0:
        read_all(preadv, fd, [buffer_of(out[b0:b1])], offset, need)  # aligned middle chunk: no copy
        return None
    slot = pool.acquire()
    try:
        padded = round_up(tail) if tail else 0
        staged = buffer_of(slot)
        if main:
            bufs = ([staged[:HEADER]] if want_header else []) + [buffer_of(out[b0 : b0 + main])]
            bufs += [staged[HEADER : HEADER + padded]] if padded else []
        else:
            bufs = [staged[(0 if want_header else HEADER) : HEADER + padded]]
        read_all(preadv, fd, bufs, offset, need)
        if tail:
            out[b0 + main : b1].copy_(slot[HEADER : HEADER + tail])
        return bytes(staged[:HEADER]) if want_header else None
    finally:
        pool.release(slot)


def open_slot(path: str, nbytes: int, flags: int) -> int:
    """Open a slot file for reading (``flags``: e.g. O_DIRECT); raises :class:`ShortRead` if it is
    too short to hold ``nbytes`` after its header."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Corrupt("it is a symbolic link, which tiermem never follows (its target is untouched)") from e
        raise
    size = os.fstat(fd).st_size
    if size < HEADER + nbytes:
        os.close(fd)
        raise ShortRead(f"{size} bytes on disk, {HEADER + nbytes} expected")
    return fd


def check_slot(
    preadv: PReadv, path: str, nbytes: int, header: bytes, xxh3: Optional[int], pool: StagingPool, direct: bool
) -> Optional[BaseException]:
    """None if the slot file at ``path`` has the length, the header and (``xxh3`` not None) the
    data of the value the store wrote there; otherwise what is wrong with it (missing, truncated,
    corrupt, unreadable). Reads the whole slot, through one staging slot, chunk by chunk."""
    try:
        fd = open_slot(path, nbytes, os.O_DIRECT if direct else 0)
        try:
            check_header(read_header(preadv, fd, pool, direct), header)
            if xxh3 is not None:
                check_data(_slot_digest(preadv, fd, nbytes, pool, direct), xxh3)
        finally:
            os.close(fd)
    except (OSError, ShortRead, Corrupt) as e:
        return e
    return None


def _slot_digest(preadv: PReadv, fd: int, nbytes: int, pool: StagingPool, direct: bool) -> int:
    digests = []
    slot = pool.acquire()
    try:
        for b0, b1 in chunks(nbytes, pool.block):
            n = b1 - b0
            if n:
                read_all(preadv, fd, [buffer_of(slot[: round_up(n) if direct else n])], HEADER + b0, n)
            digests.append(layout.digest(slot[:n]))
    finally:
        pool.release(slot)
    return combine(digests)


def write_all(pwritev: PWritev, fd: int, bufs: Sequence[Buf], offset: int) -> None:
    """Write every byte of ``bufs`` at ``offset``, however many calls it takes."""
    todo = sum(len(b) for b in bufs)
    while todo:
        done = pwritev(fd, bufs, offset)
        if done <= 0:
            raise OSError(errno.EIO, "write made no progress")
        offset, todo, bufs = offset + done, todo - done, _skip(bufs, done)


def read_all(preadv: PReadv, fd: int, bufs: Sequence[Buf], offset: int, need: int) -> None:
    """Fill ``bufs`` from ``offset``; the file must hold at least ``need`` of those bytes (a
    direct read may ask for padding past the end of a file, which is fine)."""
    got, todo = 0, sum(len(b) for b in bufs)
    while got < need:
        r = preadv(fd, bufs, offset + got)
        if r <= 0:
            raise ShortRead(f"{got} of {need} bytes at offset {offset}")
        got, todo, bufs = got + r, todo - r, _skip(bufs, r)
        if not todo:
            break


def _skip(bufs: Sequence[Buf], n: int) -> list[memoryview]:
    out = []
    for b in bufs:
        b = memoryview(b)
        if n >= len(b):
            n -= len(b)
        else:
            out.append(b[n:])
            n = 0
    return out
