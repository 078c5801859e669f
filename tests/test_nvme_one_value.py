"""NvmeStore(keep_previous=False): one value per key on disk, a bounded pool of spare files that
later writes go over in place, failed and torn writes that keep the current value whole, damage
that is reported as lost (nothing to fall back to), the budget, and spares left by a killed run.
NOTE [One value per key, and a few spare files] in tiermem/memory/nvme_keys.py."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from tiermem import OutOfTierMemory, StoreError
from tiermem.errors import ConfigError
from tiermem.memory import nvme_layout as layout
from tiermem.memory.aligned import ALIGN
from tiermem.memory.nvme import NvmeStore
from tiermem.memory.nvme_dir import LOCK_NAME

BLOCK = 4 * ALIGN


def _files(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name != LOCK_NAME)


def _spares(directory) -> list[str]:
    return [name for name in _files(directory) if name.startswith("spare-")]


def _value(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _read(store: NvmeStore, key: str, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    store.read(key, out).wait()
    return out


def _file_bytes(n_floats: int, direct: bool) -> int:
    nbytes = 4 * n_floats
    return layout.HEADER + (-(-nbytes // ALIGN) * ALIGN if direct else nbytes)


@pytest.fixture
def store(tmp_path):
    with NvmeStore(tmp_path, block_size=BLOCK, keep_previous=False, spares=2) as s:
        yield s


def test_each_key_holds_one_file_and_spares_are_reused_in_place(store, tmp_path):
    sizes = {"a": 3 * 1024 + 5, "b": 3 * 1024 + 5, "c": 700}
    inodes_after_warm_up = None
    for round_ in range(6):
        for key, n in sizes.items():
            x = _value(n, 10 * round_ + len(key))
            store.write(key, x).wait()
            assert torch.equal(_read(store, key, x), x)
        slots = [name for name in _files(tmp_path) if not name.startswith("spare-")]
        # one slot file per key at rest, and no more spares than the pool allows
        assert sorted(slots) == sorted(
            layout.file_name(k, 0) if round_ % 2 == 0 else layout.file_name(k, 1) for k in sizes
        )
        assert len(_spares(tmp_path)) <= 2
        # the budget counts each value once, plus the spares' payload
        spare_payload = sum(os.path.getsize(tmp_path / s) - layout.HEADER for s in _spares(tmp_path))
        assert store.used == sum(4 * n for n in sizes.values()) + spare_payload
        inodes = {os.stat(tmp_path / name).st_ino for name in _files(tmp_path)}
        if round_ == 1:
            inodes_after_warm_up = inodes
        elif round_ > 1:  # overwrites go over files already made: the set of files does not grow
            assert len(inodes | inodes_after_warm_up) <= len(inodes_after_warm_up) + 1
    store.delete("a")
    assert layout.file_name("a", 1) not in _files(tmp_path) and "a" not in store


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_write_torn_mid_way_keeps_the_current_value_whole(store, tmp_path, monkeypatch, code):
    old = _value(5 * 1024, 1)
    store.write("k", old).wait()
    store.write("k", _value(5 * 1024, 2)).wait()  # now in slot 1; slot 0's file went to the pool
    current = _value(5 * 1024, 3)
    store.write("k", current).wait()
    used = store.used
    real, calls = store._pwritev, []

    def torn(fd, bufs, offset):  # the header blanked and the first data chunk written, then the disk fails
        calls.append(offset)
        if len(calls) > 2:
            raise OSError(code, os.strerror(code))
        return real(fd, bufs, offset)

    monkeypatch.setattr(store, "_pwritev", torn)
    with pytest.raises(StoreError, match=rf"write of 'k' .* failed: {os.strerror(code)}; 'k' keeps its previous value"):
        store.write("k", _value(5 * 1024, 4)).wait()
    monkeypatch.undo()
    assert torch.equal(_read(store, "k", current), current)
    assert store.used <= used and layout.file_name("k", 1) not in _files(tmp_path)  # the torn file is gone
    assert store.meta("k") == ((5 * 1024,), torch.float32)


@pytest.mark.parametrize("where", [40, layout.HEADER + 3], ids=["header", "data"])
def test_a_damaged_value_is_lost_never_replaced_by_an_older_one(store, tmp_path, where):
    for seed in range(3):
        store.write("k", _value(2000, seed)).wait()
    path = tmp_path / layout.file_name("k", 0)  # the third write's slot
    with open(path, "r+b") as f:
        f.seek(where)
        f.write(b"\xff")
    for _ in range(2):  # nothing to fall back to: every read says the value is lost
        with pytest.raises(StoreError, match=rf"NVMe file {path} holding 'k' is corrupt.*the stored value is lost"):
            _read(store, "k", torch.empty(2000))
    with pytest.raises(StoreError, match="cannot revert 'k'"):
        store.revert("k")
    x = _value(2000, 9)
    store.write("k", x).wait()  # writing it again repairs it
    assert torch.equal(_read(store, "k", x), x)


def test_the_budget_needs_room_for_one_value_and_a_write_in_flight(tmp_path):
    n = 2048
    with NvmeStore(tmp_path, block_size=BLOCK, keep_previous=False, spares=4, budget=2 * 4 * n + 100) as s:
        for seed in range(5):  # an overwrite needs the value and the new one; spares are given back for it
            x = _value(n, seed)
            s.write("k", x).wait()
            assert torch.equal(_read(s, "k", x), x)
            assert s.used <= s.allowed
        with pytest.raises(OutOfTierMemory, match="out of nvme memory placing 'other'"):
            s.write("other", _value(n + 100, 0))
        assert s.used == 4 * n and _spares(tmp_path) == []  # the spare was unlinked to make room, in vain
        assert torch.equal(_read(s, "k", _value(n, 4)), _value(n, 4))


def test_each_size_band_keeps_its_own_spares(tmp_path):
    """A store writing two sizes (ZeroInfinity: small weight files, large state files) keeps up to
    ``spares`` files of each: the frequent small ones do not crowd the large ones out, so every
    overwrite of the large key goes over a spare's blocks."""
    small, big = 700, 40 * 1024
    with NvmeStore(tmp_path, block_size=BLOCK, keep_previous=False, spares=1) as s:
        for seed in range(2):
            s.write("big", _value(big, seed)).wait()
            s.write("small", _value(small, seed)).wait()
        sizes = sorted(os.path.getsize(tmp_path / n) for n in _spares(tmp_path))
        assert sizes == [_file_bytes(small, s.direct), _file_bytes(big, s.direct)]  # one of each band
        spare_inodes = {os.stat(tmp_path / n).st_ino for n in _spares(tmp_path)}
        x = _value(big, 9)
        s.write("big", x).wait()  # goes over the large spare, though a small one was released since
        assert os.stat(tmp_path / layout.file_name("big", 0)).st_ino in spare_inodes
        assert torch.equal(_read(s, "big", x), x)


def test_spares_left_by_a_killed_run_are_taken_over_and_close_removes_them(tmp_path):
    s = NvmeStore(tmp_path, block_size=BLOCK, keep_previous=False, spares=3)
    for seed in range(3):
        for key in ("a", "b", "c"):
            s.write(key, _value(3000, seed)).wait()
    left = _spares(tmp_path)
    assert left  # each write takes the spare the write before it released: one stays in the pool
    s._release_lock()  # as a killed process's lock dies with it; its files stay as they were
    s._requests.pool.shutdown(wait=True)
    again = NvmeStore(tmp_path, block_size=BLOCK, keep_previous=False, spares=3)
    assert again.used == sum(os.path.getsize(tmp_path / n) - layout.HEADER for n in left)
    inodes = {os.stat(tmp_path / n).st_ino for n in left}
    x = _value(3000, 7)
    again.write("z", x).wait()  # a key with no file yet: its slot is a spare, renamed
    assert os.stat(tmp_path / layout.file_name("z", 0)).st_ino in inodes
    assert torch.equal(_read(again, "z", x), x)
    again.close()
    assert _spares(tmp_path) == []


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"keep_previous": "no"}, r"NvmeStore.keep_previous='no' must be True or False"),
        ({"spares": -1}, r"NvmeStore.spares=-1 must be an int >= 0"),
        ({"spares": True}, r"NvmeStore.spares=True must be an int >= 0"),
    ],
)
def test_bad_arguments_are_refused(tmp_path, kw, message):
    with pytest.raises(ConfigError, match=message):
        NvmeStore(tmp_path, **kw)


def test_a_key_named_like_a_spare_is_never_taken_for_one(tmp_path):
    """A killed run left both a spare and the file of a key whose name starts like a spare's: the
    next store takes over the spare only, and the key's file is never renamed to another key."""
    s = NvmeStore(tmp_path, block_size=BLOCK, keep_previous=False, spares=3)
    for seed in range(3):
        s.write("spare-1", _value(3000, seed)).wait()
    s._release_lock()  # as a killed process's lock dies with it
    s._requests.pool.shutdown(wait=True)
    again = NvmeStore(tmp_path, block_size=BLOCK, keep_previous=False, spares=3)
    adopted = {os.path.basename(p) for p in again._journal.spares.ready}
    key_files = {layout.file_name("spare-1", slot) for slot in (0, 1)} & set(_files(tmp_path))
    assert adopted and key_files and not adopted & key_files
    again.close()
