"""The NVMe store's on-disk format and the aligned, chunked transfers behind it.

# NOTE [NVMe file layout]
One file per key. The first ``HEADER`` (4096) bytes hold a header: magic, a crc32-checked JSON
record ``{"key", "dtype", "shape", "nbytes"}``, zero padding. The tensor's bytes follow at offset
``HEADER``. With direct I/O the file is padded to a multiple of 4096 (O_DIRECT wants aligned
offsets and lengths); buffered files end exactly after the last byte. Either way a file shorter
than ``HEADER + nbytes`` is truncated, and a header that does not match what the store wrote is
corrupt: both are reported, never returned as data.

# NOTE [Chunks and staging]
A request is split into chunks of ``block_size`` bytes (a multiple of 4096) that run
concurrently on the store's threads. Chunk 0 also carries the header, in the same syscall. With
direct I/O, a tensor whose first byte sits on a 4096 boundary is read and written in place; only
a ragged tail (< 4096 bytes) and the header go through a staging slot. A tensor that is not
aligned goes through a staging slot chunk by chunk (one memcpy per chunk). Slots come from a
bounded pool: at most one per I/O thread, allocated on first use and reused after that.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import struct
import threading
import uuid
import zlib
from typing import Callable, Optional, Sequence

import torch

from tiermem.errors import ConfigError, StoreError
from tiermem.stores.aligned import ALIGN, aligned_empty, is_aligned, round_up

HEADER = ALIGN
MAGIC = b"TIERMEM\x01"
SUFFIX = ".tmn"
_PREFIX = struct.Struct("<8sII")  # magic, JSON length, crc32 of the JSON
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")

PWritev = Callable[[int, Sequence, int], int]
PReadv = Callable[[int, Sequence, int], int]


class ShortRead(Exception):
    """The file ended before the bytes a read needed (internal: the store names the key and file)."""


# -- names, headers, byte views ---------------------------------------------------------------
def file_name(key: str) -> str:
    """A file name that is safe for any key: a readable part plus a hash of the whole key."""
    readable = _UNSAFE.sub("_", key).lstrip(".")[:80] or "_"  # never hidden, never "." or ".."
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return f"{readable}.{digest}{SUFFIX}"


def check_key(key: object) -> None:
    """Any non-empty string is a key (``file_name`` makes it safe on disk)."""
    if not isinstance(key, str) or not key:
        raise StoreError(f"tiermem: NvmeStore keys are non-empty strings, got {key!r}; pass a name "
                         f"such as 'blocks.0.fc.weight:exp_avg'")


def encode_header(key: str, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> bytes:
    record = json.dumps({"key": key, "dtype": str(dtype).removeprefix("torch."),
                         "shape": list(shape), "nbytes": nbytes}).encode()
    if _PREFIX.size + len(record) > HEADER:
        raise StoreError(f"tiermem: key {key!r} with shape {tuple(shape)} does not fit the "
                         f"{HEADER}-byte NVMe file header ({_PREFIX.size + len(record)} bytes needed); "
                         f"use a shorter key")
    head = _PREFIX.pack(MAGIC, len(record), zlib.crc32(record)) + record
    return head + bytes(HEADER - len(head))


def check_header(raw: bytes, expected: bytes, *, key: str, path: str) -> None:
    """Raise a clear error unless the header read from disk is the one the store wrote."""
    if raw == expected:
        return
    magic, length, crc = _PREFIX.unpack_from(raw)
    record = raw[_PREFIX.size:_PREFIX.size + length]
    if magic != MAGIC or length > HEADER - _PREFIX.size or zlib.crc32(record) != crc:
        what = "its header is damaged"
    else:
        what = f"its header describes {json.loads(record)}, not the value the store wrote"
    raise StoreError(f"tiermem: NVMe file {path} holding {key!r} is corrupt: {what}; the stored value "
                     f"is lost: write {key!r} again, and check that nothing else writes to that directory")


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous CPU tensor as a 1-d uint8 tensor sharing its memory (bf16 and
    bool included: torch reinterprets them, numpy never sees their dtype)."""
    return t.reshape(-1).view(torch.uint8)


def check_tensor(key: str, t: object, what: str) -> None:
    """What ``byte_view`` can take: a dense CPU tensor (``out`` also without lazy conj/neg bits)."""
    if not isinstance(t, torch.Tensor):
        raise StoreError(f"tiermem: NvmeStore needs a torch.Tensor as {what} for {key!r}, got "
                         f"{type(t).__name__}; pass a CPU tensor")
    if t.device.type != "cpu" or t.layout != torch.strided:
        raise StoreError(f"tiermem: NvmeStore moves dense CPU tensors only, got {what} for {key!r} on "
                         f"{t.device} ({t.layout}); copy it to host memory first (the engine stages "
                         f"device tensors through the host store)")
    if what == "out" and (t.is_conj() or t.is_neg()):
        raise StoreError(f"tiermem: cannot read {key!r} into a lazily conjugated or negated view; "
                         f"pass a plain tensor as `out` (e.g. torch.empty_like(x))")


def _mv(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy())


def chunks(nbytes: int, block: int) -> list[tuple[int, int]]:
    """Body ranges ``[b0, b1)`` of at most ``block`` bytes; an empty value still has chunk 0
    (it carries the header)."""
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


class Fanout:
    """Runs one request's chunks on several threads; the thread that ends the last chunk calls
    ``finish`` with the first error (or None). Chunks after an error are skipped."""

    __slots__ = ("_left", "_error", "_lock", "_finish")

    def __init__(self, n: int, finish: Callable[[Optional[BaseException]], None]):
        self._left, self._error, self._lock, self._finish = n, None, threading.Lock(), finish

    def run(self, job: Callable[[], object]) -> None:
        error = None
        if self._error is None:
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - handed to finish, which fails the request
                error = e
        with self._lock:
            self._error = self._error or error
            self._left -= 1
            last = self._left == 0
        if last:
            self._finish(self._error)


# -- one chunk of a transfer ------------------------------------------------------------------
def write_chunk(pwritev: PWritev, fd: int, src: torch.Tensor, b0: int, b1: int, header: Optional[bytes],
                pool: StagingPool, direct: bool) -> None:
    """Write body bytes ``[b0, b1)`` of ``src`` (uint8, 1-d); ``header`` goes with chunk 0."""
    n = b1 - b0
    offset = 0 if header is not None else HEADER + b0
    if not direct:
        bufs = ([header] if header is not None else []) + ([_mv(src[b0:b1])] if n else [])
        _write_all(pwritev, fd, bufs, offset)
        return
    main = n // ALIGN * ALIGN if is_aligned(src) else 0
    tail = n - main
    if header is None and tail == 0:
        _write_all(pwritev, fd, [_mv(src[b0:b1])], offset)  # aligned middle chunk: no copy
        return
    slot = pool.acquire()
    try:
        padded = round_up(tail) if tail else 0
        if tail:
            slot[HEADER:HEADER + tail].copy_(src[b0 + main:b1])
            slot[HEADER + tail:HEADER + padded].zero_()  # no stale memory on disk
        if header is not None:
            slot[:HEADER].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        staged = _mv(slot)
        if main:  # aligned body in place; header and tail from the slot around it
            bufs = ([staged[:HEADER]] if header is not None else []) + [_mv(src[b0:b0 + main])]
            bufs += [staged[HEADER:HEADER + padded]] if padded else []
        else:  # header and body are contiguous in the slot
            bufs = [staged[(0 if header is not None else HEADER):HEADER + padded]]
        _write_all(pwritev, fd, bufs, offset)
    finally:
        pool.release(slot)


def read_chunk(preadv: PReadv, fd: int, out: torch.Tensor, b0: int, b1: int, want_header: bool,
               pool: StagingPool, direct: bool) -> Optional[bytes]:
    """Read body bytes ``[b0, b1)`` into ``out`` (uint8, 1-d); chunk 0 also returns the header."""
    n = b1 - b0
    offset = 0 if want_header else HEADER + b0
    need = n + (HEADER if want_header else 0)
    if not direct:
        head = bytearray(HEADER) if want_header else None
        bufs = ([head] if head is not None else []) + ([_mv(out[b0:b1])] if n else [])
        _read_all(preadv, fd, bufs, offset, need)
        return bytes(head) if head is not None else None
    main = n // ALIGN * ALIGN if is_aligned(out) else 0
    tail = n - main
    if not want_header and tail == 0:
        _read_all(preadv, fd, [_mv(out[b0:b1])], offset, need)  # aligned middle chunk: no copy
        return None
    slot = pool.acquire()
    try:
        padded = round_up(tail) if tail else 0
        staged = _mv(slot)
        if main:
            bufs = ([staged[:HEADER]] if want_header else []) + [_mv(out[b0:b0 + main])]
            bufs += [staged[HEADER:HEADER + padded]] if padded else []
        else:
            bufs = [staged[(0 if want_header else HEADER):HEADER + padded]]
        _read_all(preadv, fd, bufs, offset, need)
        if tail:
            out[b0 + main:b1].copy_(slot[HEADER:HEADER + tail])
        return bytes(staged[:HEADER]) if want_header else None
    finally:
        pool.release(slot)


def _write_all(pwritev: PWritev, fd: int, bufs: list, offset: int) -> None:
    todo = sum(len(b) for b in bufs)
    while todo:
        done = pwritev(fd, bufs, offset)
        if done <= 0:
            raise OSError(errno.EIO, "write made no progress")
        offset, todo, bufs = offset + done, todo - done, _skip(bufs, done)


def _read_all(preadv: PReadv, fd: int, bufs: list, offset: int, need: int) -> None:
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


def _skip(bufs: list, n: int) -> list:
    out = []
    for b in bufs:
        b = memoryview(b)
        if n >= len(b):
            n -= len(b)
        else:
            out.append(b[n:])
            n = 0
    return out


# -- the directory ------------------------------------------------------------------------------
def check_directory(directory: str) -> None:
    if not os.path.exists(directory):
        raise ConfigError(f"tiermem: NvmeStore directory {directory} does not exist; create it first "
                          f"(mkdir -p {directory}) or pass an existing directory as nvme_dir")
    if not os.path.isdir(directory):
        raise ConfigError(f"tiermem: NvmeStore directory {directory} is not a directory; "
                          f"pass a directory as nvme_dir")


def probe_direct(directory: str, direct: Optional[bool]) -> tuple[bool, Optional[OSError]]:
    """Create, write and remove one small probe file: fails unless the directory takes files.
    Returns whether O_DIRECT works there (never tried when ``direct`` is False) and, when it
    does not, the error the filesystem gave."""
    path = os.path.join(directory, f"tiermem-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    refused: Optional[OSError] = None
    if direct is not False:
        try:
            _probe_write(path, os.O_DIRECT)
            return True, None
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise _not_writable(directory, e) from e
            refused = e
    try:
        _probe_write(path, 0)
    except OSError as e:
        raise _not_writable(directory, e) from e
    return False, refused


def _probe_write(path: str, extra_flags: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | extra_flags, 0o600)
    try:
        block = aligned_empty(ALIGN, pin=False).zero_()
        os.pwrite(fd, _mv(block), 0)
    finally:
        os.close(fd)
        os.unlink(path)


def _not_writable(directory: str, e: OSError) -> ConfigError:
    return ConfigError(f"tiermem: NvmeStore cannot create files in {directory} ({e.strerror}); "
                       f"make it writable or pass a writable directory as nvme_dir")
