"""What an NVMe slot file holds and how a key and a tensor map onto it: file names, the header
(encode, decode, check), the xxh3 checksums of the data and the byte views the transfers move;
no I/O here (:mod:`tiermem.memory.nvme_io` moves the bytes).

# NOTE [NVMe file layout]
Two slot files per key, ``<name>.0.tmn`` and ``<name>.1.tmn`` (NOTE [Two slots, overwritten in
place] in :mod:`tiermem.memory.nvme_keys` says how they alternate). The first ``HEADER`` (4096) bytes
of a slot hold a header: magic, a crc32-checked JSON record ``{"key", "dtype", "shape",
"nbytes", "gen", "xxh3", "chunk"}``, zero padding. ``gen`` counts the key's successful writes: the
valid slot with the larger ``gen`` holds the newer value. ``xxh3`` checks the tensor's bytes
(NOTE [Data checksums]); ``chunk`` is the chunk size it was computed over. The tensor's bytes follow at offset ``HEADER``. With
direct I/O a slot is padded to a multiple of 4096 (O_DIRECT wants aligned offsets and lengths);
buffered slots end exactly after the last byte. Either way a slot shorter than ``HEADER + nbytes``
is truncated, and a header that does not match what the store wrote (zeroes included: that is
how a slot being rewritten is marked) is corrupt: both are reported, never returned as data.
The header stays at the front: on the disk this was measured on, fio wrote and read 8 MiB blocks
at offset 4096 as fast as at offset 0 (within the run-to-run noise of a few percent).

# NOTE [Data checksums]
Every byte of a value is checked on every read. Each chunk is hashed (xxh3_64: ~28 GB/s on one
core here, ~12 GB/s from memory the cache does not hold, over four times the disk) as it moves,
never in a second pass over the tensor (NOTE [Hashing beside the I/O] says on which thread). The
value's checksum is xxh3_64 over the chunks' digests in order (an incremental ``xxh3_64()``
object), written in the header, which its own crc32 protects. A read hashes each chunk it
fills the same way and compares at the end: a mismatch is :class:`Corrupt`, like a damaged
header (NOTE [Two slots, overwritten in place] says what the store does then). The chunk size
is in the header, so the checksum is defined by the file alone. ``TIERMEM_NVME_CHECKSUMS=0`` in
the environment turns checksums off for stores made after it is set: a benchmarking switch (it
measures what they cost), never for training; such a store warns once when it is made.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import zlib
from typing import Optional, Sequence

import torch
import xxhash

from tiermem.errors import StoreError
from tiermem.memory.aligned import ALIGN, round_up

HEADER = ALIGN
MAGIC = b"TIERMEM\x01"
SUFFIX = ".tmn"
_PREFIX = struct.Struct("<8sII")  # magic, JSON length, crc32 of the JSON
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class ShortRead(Exception):
    """The file ended before the bytes a read needed (internal: the store names the key and file)."""


class Corrupt(Exception):
    """A slot's header is not the one the store wrote (internal: the store names the key and file)."""


# -- names, headers, byte views ---------------------------------------------------------------
def file_name(key: str, slot: int) -> str:
    """The name of ``key``'s slot file ``slot`` (0 or 1), safe for any key: a readable part plus a
    hash of the whole key."""
    assert slot in (0, 1)
    readable = _UNSAFE.sub("_", key).lstrip(".")[:80] or "_"  # never hidden, never "." or ".."
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return f"{readable}.{digest}.{slot}{SUFFIX}"


def check_key(key: object) -> None:
    """Any non-empty string is a key (``file_name`` makes it safe on disk)."""
    if not isinstance(key, str) or not key:
        raise StoreError(
            f"tiermem: NvmeStore keys are non-empty strings, got {key!r}; pass a name "
            f"such as 'blocks.0.fc.weight:exp_avg'"
        )


def encode_header(
    key: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    nbytes: int,
    gen: int,
    xxh3: Optional[int] = None,
    chunk: int = 0,
) -> bytes:
    """The header of a slot; ``xxh3`` (None: not checked) is :func:`combine` of the value's chunk
    digests over chunks of ``chunk`` bytes (NOTE [Data checksums])."""
    record = json.dumps(
        {
            "key": key,
            "dtype": str(dtype).removeprefix("torch."),
            "shape": list(shape),
            "nbytes": nbytes,
            "gen": gen,
            "xxh3": None if xxh3 is None else f"{xxh3:016x}",
            "chunk": chunk,
        }
    ).encode()
    if _PREFIX.size + len(record) > HEADER:
        raise StoreError(
            f"tiermem: key {key!r} with shape {tuple(shape)} does not fit the "
            f"{HEADER}-byte NVMe file header ({_PREFIX.size + len(record)} bytes needed); "
            f"use a shorter key"
        )
    head = _PREFIX.pack(MAGIC, len(record), zlib.crc32(record)) + record
    return head + bytes(HEADER - len(head))


def check_header_fits(key: str, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, chunk: int) -> None:
    """Raise the header's error now, at the caller, rather than on an I/O thread."""
    encode_header(key, dtype, shape, nbytes, gen=2**63, xxh3=2**64 - 1, chunk=chunk)  # the widest header


def check_header(raw: bytes, expected: bytes) -> None:
    """Raise :class:`Corrupt` saying what is wrong unless ``raw`` is the header the store wrote."""
    if raw == expected:
        return
    magic, length, crc = _PREFIX.unpack_from(raw)
    record = raw[_PREFIX.size : _PREFIX.size + length]
    if magic == bytes(len(MAGIC)):
        raise Corrupt("its header is blank (a write to it did not finish)")
    if magic != MAGIC or length > HEADER - _PREFIX.size or zlib.crc32(record) != crc:
        raise Corrupt("its header is damaged")
    raise Corrupt(f"its header describes {json.loads(record)}, not the value the store wrote")


def digest(data: torch.Tensor) -> int:
    """xxh3_64 of a chunk's bytes (``data``: uint8, 1-d, contiguous), NOTE [Data checksums]."""
    return xxhash.xxh3_64_intdigest(buffer_of(data))


def combine(digests: Sequence[Optional[int]]) -> int:
    """The value's checksum: xxh3_64 over its chunks' digests, in order."""
    h = xxhash.xxh3_64()
    for d in digests:
        assert d is not None, "every chunk of a finished transfer has its digest"
        h.update(d.to_bytes(8, "little"))
    return h.intdigest()


def check_data(got: int, want: int) -> None:
    """Raise :class:`Corrupt` unless a value's bytes hash to the checksum its header holds."""
    if got != want:
        raise Corrupt(
            f"its data fails its checksum (xxh3 {got:016x}, the header says {want:016x}: bytes "
            f"changed on disk after tiermem wrote them)"
        )


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous CPU tensor as a 1-d uint8 tensor sharing its memory (bf16 and
    bool included: torch reinterprets them, numpy never sees their dtype)."""
    return t.reshape(-1).view(torch.uint8)


def check_tensor(key: str, t: object, what: str) -> None:
    """What ``byte_view`` can take: a dense CPU tensor (``out`` also without lazy conj/neg bits)."""
    if not isinstance(t, torch.Tensor):
        raise StoreError(
            f"tiermem: NvmeStore needs a torch.Tensor as {what} for {key!r}, got {type(t).__name__}; pass a CPU tensor"
        )
    if t.device.type != "cpu" or t.layout != torch.strided:
        raise StoreError(
            f"tiermem: NvmeStore moves dense CPU tensors only, got {what} for {key!r} on "
            f"{t.device} ({t.layout}); copy it to host memory first (the engine stages "
            f"device tensors through the host store)"
        )
    if what == "out" and (t.is_conj() or t.is_neg()):
        raise StoreError(
            f"tiermem: cannot read {key!r} into a lazily conjugated or negated view; "
            f"pass a plain tensor as `out` (e.g. torch.empty_like(x))"
        )


def buffer_of(t: torch.Tensor) -> memoryview:
    """``t``'s bytes as a buffer (``t`` contiguous, in host memory, viewed as uint8), no copy."""
    return memoryview(t.numpy())  # type: ignore[arg-type]  # numpy's stubs do not declare the buffer protocol


def file_size(nbytes: int, direct: bool) -> int:
    """The size of a slot file holding a value of ``nbytes``: its header, then the data (padded to
    whole blocks for O_DIRECT)."""
    return HEADER + (round_up(nbytes) if direct else nbytes)
