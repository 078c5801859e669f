"""NvmeStore's hashing beside the I/O (NOTE [Hashing beside the I/O] in tiermem/memory/nvme_io.py):
chunks of at least HASH_HANDOFF bytes are hashed on the store's hashing threads while the I/O
threads move the next chunks; the checksum stays the one the file format defines; a request ends
only once every chunk's I/O and hash ended; a write of concurrent parts whose one part fails (I/O
or hash) never switches the value; a torn read is detected; small chunks are hashed inline."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from tiermem import StoreError
from tiermem.memory import nvme_io as nio, nvme_layout as layout
from tiermem.memory.aligned import aligned_empty
from tiermem.memory.nvme import NvmeStore
from tiermem.memory.nvme_dir import LOCK_NAME

BLOCK = nio.HASH_HANDOFF  # the smallest chunk that is handed over: several chunks per value, little data
N = 3 * BLOCK + 4099  # bytes: three full chunks and a ragged fourth


def _value(nbytes: int, seed: int, *, aligned: bool = True) -> torch.Tensor:
    """Random bytes, page-aligned (read and written in place) or 64 bytes off (staged)."""
    g = torch.Generator().manual_seed(seed)
    buf = aligned_empty(nbytes + 64, pin=False)
    x = buf[0:nbytes] if aligned else buf[64 : 64 + nbytes]
    return x.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))


def _read(store: NvmeStore, key: str, nbytes: int) -> torch.Tensor:
    out = aligned_empty(nbytes, pin=False)[:nbytes].zero_()
    store.read(key, out).wait()
    return out


def _files(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name != LOCK_NAME)


@pytest.fixture
def store(tmp_path):
    with NvmeStore(tmp_path, block_size=BLOCK) as s:
        yield s


@pytest.fixture
def hashed_on(monkeypatch) -> list[str]:
    """The names of the threads that hashed a chunk, in the order the hashes ended."""
    names, real = [], layout.digest

    def digest(data):
        d = real(data)
        names.append(threading.current_thread().name)
        return d

    monkeypatch.setattr(layout, "digest", digest)
    return names


@pytest.mark.parametrize("aligned", [True, False], ids=["in place", "staged"])
def test_big_chunks_are_hashed_on_the_hashing_threads_and_the_checksum_is_the_formats(
    store, tmp_path, hashed_on, aligned
):
    x = _value(N, 1, aligned=aligned)
    store.write("k", x).wait()
    assert len(hashed_on) == 4 and all(n.startswith("tiermem-nvme-hash") for n in hashed_on)
    want = layout.combine([layout.digest(x[b0:b1]) for b0, b1 in nio.chunks(N, BLOCK)])
    raw = (tmp_path / layout.file_name("k", 0)).read_bytes()
    assert f'"xxh3": "{want:016x}", "chunk": {BLOCK}'.encode() in raw[: layout.HEADER]
    hashed_on.clear()
    out = aligned_empty(N + 64, pin=False)
    out = (out[:N] if aligned else out[64 : 64 + N]).zero_()
    store.read("k", out).wait()
    assert torch.equal(out, x)
    assert len(hashed_on) == 4 and all(n.startswith("tiermem-nvme-hash") for n in hashed_on)


def test_small_chunks_are_hashed_inline_on_the_io_threads(tmp_path, hashed_on):
    with NvmeStore(tmp_path, block_size=BLOCK // 2) as s:  # chunks below HASH_HANDOFF
        x = _value(3 * BLOCK // 2, 2)
        s.write("k", x).wait()
        assert torch.equal(_read(s, "k", x.numel()), x)
    assert len(hashed_on) == 6 and all(n.startswith("tiermem-nvme_") for n in hashed_on)


def test_a_request_ends_only_once_its_last_hash_ended(store, tmp_path, monkeypatch):
    """The I/O of every chunk is done, one hash is held: neither handle is done, the slot's header
    is still blank (no switch without the checksum), and the read has not been checked yet."""
    held, release, real = threading.Event(), threading.Event(), layout.digest
    hold = {"on": True}

    def slow(data):
        if hold["on"] and data.numel() < BLOCK:  # the ragged last chunk
            held.set()
            assert release.wait(10)
        return real(data)

    monkeypatch.setattr(layout, "digest", slow)
    x = _value(N, 3)
    h = store.write("k", x)
    assert held.wait(10)
    assert not h.done() and (tmp_path / layout.file_name("k", 0)).read_bytes()[: layout.HEADER] == bytes(layout.HEADER)
    release.set()
    h.wait()
    held.clear()
    release.clear()
    out = aligned_empty(N, pin=False)[:N].zero_()
    r = store.read("k", out)
    assert held.wait(10)
    assert not r.done()
    release.set()
    r.wait()
    assert torch.equal(out, x)


@pytest.mark.parametrize("where", ["I/O", "hash"])
def test_a_write_whose_one_part_fails_never_switches_the_value(store, tmp_path, monkeypatch, where):
    """A write split into concurrent parts (chunks on the I/O threads, hashes on the hashing
    threads) whose middle chunk fails: the key keeps its previous value, the slot the write went
    over is removed, and the other parts' late ends change nothing."""
    old = _value(N, 4)
    store.write("k", old).wait()
    failed = []
    if where == "I/O":
        real = store._pwritev

        def pwritev(fd, bufs, offset):
            if offset == layout.HEADER + BLOCK:
                failed.append(offset)
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real(fd, bufs, offset)

        monkeypatch.setattr(store, "_pwritev", pwritev)
        match = r"write of 'k' .* failed: Input/output error; 'k' keeps its previous value"
    else:
        real_digest, calls = layout.digest, []

        def digest(data):
            calls.append(data)
            if len(calls) == 2:
                failed.append(len(calls))
                raise MemoryError("out of memory while hashing")  # not an I/O error: passed on as it is
            return real_digest(data)

        monkeypatch.setattr(layout, "digest", digest)
        match = "out of memory while hashing"
    with pytest.raises((StoreError, MemoryError), match=match):
        store.write("k", _value(N, 5)).wait()
    assert failed
    monkeypatch.undo()
    assert torch.equal(_read(store, "k", N), old)
    assert _files(tmp_path) == [layout.file_name("k", 0)] and store.used == N
    y = _value(N, 6)
    store.write("k", y).wait()  # the store works after the failure
    assert torch.equal(_read(store, "k", N), y)


def test_a_torn_read_is_detected_and_falls_back(store, monkeypatch):
    """A read whose syscall reports every byte but left one chunk torn (half of it stale, as a
    read racing a writer would): the checksum catches it and the key falls back."""
    old, new = _value(N, 7), _value(N, 8)
    store.write("k", old).wait()
    store.write("k", new).wait()
    real, tore = store._preadv, []

    def torn(fd, bufs, offset):
        got = real(fd, bufs, offset)
        if offset == layout.HEADER + 2 * BLOCK and not tore:  # once: the fall back reads the other slot whole
            tore.append(offset)
            view = memoryview(bufs[0]).cast("B")
            view[BLOCK // 2 :] = bytes(len(view) - BLOCK // 2)
        return got

    monkeypatch.setattr(store, "_preadv", torn)
    with pytest.raises(StoreError, match=r"its data fails its checksum .*'k' falls back to its previous value"):
        store.read("k", torch.empty(N, dtype=torch.uint8)).wait()
    assert tore
    monkeypatch.undo()
    assert torch.equal(_read(store, "k", N), old)


def test_short_reads_are_completed_before_the_chunk_is_hashed(store, monkeypatch):
    """A disk that returns each chunk in several short pieces: every piece lands before the chunk
    is handed over, so the checksum passes and the bytes are the value's."""
    x = _value(N, 9)
    store.write("k", x).wait()
    real, pieces = store._preadv, []

    def short(fd, bufs, offset):
        first = memoryview(bufs[0]).cast("B")
        if len(first) > 3 * 4096:
            bufs = [first[: len(first) // 3 // 4096 * 4096]]  # a third of the first buffer, page-aligned
            pieces.append(offset)
        return real(fd, bufs, offset)

    monkeypatch.setattr(store, "_preadv", short)
    assert torch.equal(_read(store, "k", N), x)
    assert len(pieces) > 4


def test_close_stops_the_hashing_threads_and_checksums_off_has_none(tmp_path, monkeypatch):
    def hashing() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("tiermem-nvme-hash")]

    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    before = set(hashing())
    s = NvmeStore(tmp_path / "on", block_size=BLOCK)
    x = _value(N, 10)
    s.write("k", x).wait()
    assert set(hashing()) - before
    s.close()
    assert not set(hashing()) - before
    monkeypatch.setenv("TIERMEM_NVME_CHECKSUMS", "0")
    with NvmeStore(tmp_path / "off", block_size=BLOCK) as off:
        off.write("k", x).wait()
        assert torch.equal(_read(off, "k", N), x) and not set(hashing()) - before
