"""Nothing on disk is read back silently: a table of disk defects (a flipped data byte, a flipped
header byte, a truncated file, another key's file, a planted symlink), each with its error and
with every other stored value unchanged; files are 0600 and never opened through a symlink; a
directory is owned by one store at a time (NOTE [One store owns a directory])."""

from __future__ import annotations

import os
import re
import shutil
import stat

import forked
import pytest
import torch

from tiermem import StoreError
from tiermem.errors import ConfigError
from tiermem.memory import nvme_io as nio, nvme_layout as layout
from tiermem.memory.aligned import ALIGN
from tiermem.memory.nvme import NvmeStore
from tiermem.memory.nvme_dir import LOCK_NAME

BLOCK = 4 * ALIGN  # several chunks per value, so a flipped byte lands in a chunk of its own


def _value(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _read(store: NvmeStore, key: str, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    store.read(key, out).wait()
    return out


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def _flip_data(path, tmp_path) -> None:
    _flip(path, layout.HEADER + 2 * BLOCK + 123)  # the middle of the third chunk


def _flip_header(path, tmp_path) -> None:
    _flip(path, 40)  # inside the header's JSON record


def _truncate(path, tmp_path) -> None:
    os.truncate(path, layout.HEADER + BLOCK)


def _other_keys_file(path, tmp_path) -> None:
    shutil.copyfile(tmp_path / layout.file_name("other", 0), path)


def _symlink(path, tmp_path) -> None:
    os.unlink(path)
    os.symlink(tmp_path / "target", path)


DEFECTS = [
    (
        _flip_data,
        r"is corrupt: its data fails its checksum \(xxh3 [0-9a-f]{16}, the header says [0-9a-f]{16}: "
        r"bytes changed on disk after tiermem wrote them\)",
    ),
    (_flip_header, r"is corrupt: its header is damaged"),
    (_truncate, r"is truncated \(20480 bytes on disk, \d+ expected\)"),
    (_other_keys_file, r"is corrupt: its header describes \{'key': 'other'.*\}, not the value the store wrote"),
    (_symlink, r"is corrupt: it is a symbolic link, which tiermem never follows \(its target is untouched\)"),
]
IDS = ["data byte", "header byte", "truncated", "another key's file", "symlink"]
N = 5 * BLOCK // 4 + 7  # float32 elements: five full chunks and a ragged sixth


def _stored(store: NvmeStore, tmp_path):
    """``other`` written once, then ``k`` twice (slot 0: v0, slot 1: v1, the current value), and
    a file a planted symlink points at."""
    v0, v1, other = _value(N, 0), _value(N, 1), _value(N, 2)
    for key, x in (("other", other), ("k", v0), ("k", v1)):
        store.write(key, x).wait()
    (tmp_path / "target").write_bytes(b"precious")
    return v0, v1, other


@pytest.mark.parametrize("direct", [None, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("defect, message", DEFECTS, ids=IDS)
def test_a_damaged_latest_value_is_an_error_and_falls_back_intact(tmp_path, defect, message, direct):
    with NvmeStore(tmp_path, block_size=BLOCK, direct=direct) as store:
        v0, v1, other = _stored(store, tmp_path)
        path = tmp_path / layout.file_name("k", 1)
        defect(path, tmp_path)
        with pytest.raises(
            StoreError,
            match=rf"^tiermem: NVMe file {path} holding 'k' {message}; 'k' falls back "
            rf"to its previous value .*resume from the last checkpoint",
        ):
            _read(store, "k", v1)
        assert (tmp_path / "target").read_bytes() == b"precious"
        assert not os.path.lexists(path)  # the damaged slot (or the planted link) is gone, never followed
        assert _same(_read(store, "k", v0), v0)  # the previous value, bit-exact
        assert _same(_read(store, "other", other), other)  # written before both values of 'k'
        y = _value(N, 3)
        store.write("k", y).wait()
        assert _same(_read(store, "k", y), y)  # the store goes on


@pytest.mark.parametrize("defect, message", DEFECTS, ids=IDS)
def test_a_damaged_only_value_is_lost_never_returned(tmp_path, defect, message):
    with NvmeStore(tmp_path, block_size=BLOCK) as store:
        other = _value(N, 2)
        store.write("other", other).wait()
        x = _value(N, 4)
        store.write("k", x).wait()
        (tmp_path / "target").write_bytes(b"precious")
        path = tmp_path / layout.file_name("k", 0)
        defect(path, tmp_path)
        with pytest.raises(
            StoreError,
            match=rf"^tiermem: NVMe file {path} holding 'k' {message}; the stored value "
            rf"is lost: write 'k' again \(a training run: resume from the last "
            rf"checkpoint\)",
        ):
            _read(store, "k", x)
        assert (tmp_path / "target").read_bytes() == b"precious"
        assert _same(_read(store, "other", other), other)


def test_a_damaged_previous_value_is_not_fallen_back_to(tmp_path):
    """The fall back checks every byte of the previous slot too, not only its header."""
    with NvmeStore(tmp_path, block_size=BLOCK) as store:
        v0, v1, other = _stored(store, tmp_path)
        _flip_data(tmp_path / layout.file_name("k", 0), tmp_path)
        _flip_header(tmp_path / layout.file_name("k", 1), tmp_path)
        with pytest.raises(
            StoreError,
            match=r"its header is damaged; so is the previous value's: .*\.0\.tmn "
            r"holding 'k' is corrupt: its data fails its checksum.*the stored "
            r"value is lost",
        ):
            _read(store, "k", v1)
        assert _same(_read(store, "other", other), other)


def test_after_a_fall_back_keys_written_since_the_previous_value_are_refused(tmp_path):
    """NOTE [No mix after a fall back]: 'a' and 'b' written together twice, 'a' falls back to the
    first: 'b' (second generation) is refused until written again; 'old' (before) is not."""
    with NvmeStore(tmp_path, block_size=BLOCK) as store:
        old = _value(100, 9)
        store.write("old", old).wait()
        gens = [(_value(N, 10 + g), _value(N, 20 + g)) for g in range(2)]
        for a, b in gens:
            store.write("a", a).wait()
            store.write("b", b).wait()
        _flip_data(tmp_path / layout.file_name("a", 1), tmp_path)
        with pytest.raises(StoreError, match="falls back to its previous value"):
            _read(store, "a", gens[1][0])
        assert _same(_read(store, "a", gens[0][0]), gens[0][0])
        with pytest.raises(
            StoreError,
            match=r"^tiermem: refusing to read 'b' from .*: it was written after the "
            r"value 'a' fell back to \(NVMe file .* holding 'a' is corrupt: its "
            r"data fails its checksum.*\); read together they would mix two "
            r"generations .*resume from the last checkpoint, or write 'b' again",
        ):
            _read(store, "b", gens[1][1])
        assert _same(_read(store, "old", old), old)
        store.write("b", gens[0][1]).wait()
        assert _same(_read(store, "b", gens[0][1]), gens[0][1])


def test_checksums_are_computed_while_writing_and_checked_on_every_read(tmp_path):
    with NvmeStore(tmp_path, block_size=BLOCK) as store:
        x = _value(N, 5)
        store.write("k", x).wait()
        raw = (tmp_path / layout.file_name("k", 0)).read_bytes()
        digests = [layout.digest(x.view(torch.uint8)[b0:b1]) for b0, b1 in nio.chunks(x.nbytes, BLOCK)]
        assert f'"xxh3": "{layout.combine(digests):016x}", "chunk": {BLOCK}'.encode() in raw[: layout.HEADER]
        assert store.checksums


def test_the_benchmark_switch_turns_checksums_off_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TIERMEM_NVME_CHECKSUMS", "0")
    with NvmeStore(tmp_path, block_size=BLOCK) as store:
        assert not store.checksums and "for benchmarks only" in caplog.text
        x = _value(N, 6)
        store.write("k", x).wait()
        assert _same(_read(store, "k", x), x)
    monkeypatch.setenv("TIERMEM_NVME_CHECKSUMS", "off")
    with pytest.raises(StoreError.__mro__[1], match=r"TIERMEM_NVME_CHECKSUMS='off' must be 0 or 1"):
        NvmeStore(tmp_path)


def test_files_are_0600_whatever_the_umask_and_older_files_are_tightened(tmp_path):
    old_umask = os.umask(0o002)
    try:
        (tmp_path / layout.file_name("k", 0)).write_bytes(b"left by an older tiermem")
        os.chmod(tmp_path / layout.file_name("k", 0), 0o644)
        with NvmeStore(tmp_path, block_size=BLOCK) as store:
            for key in ("k", "k", "other"):
                store.write(key, _value(N, 7)).wait()
            for name in (layout.file_name("k", 0), layout.file_name("k", 1), layout.file_name("other", 0)):
                assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600, name
    finally:
        os.umask(old_umask)


def test_a_symlink_planted_at_a_slot_is_never_written_through(tmp_path):
    with NvmeStore(tmp_path, block_size=BLOCK) as store:
        x = _value(N, 8)
        store.write("k", x).wait()
        (tmp_path / "target").write_bytes(b"precious")
        os.symlink(tmp_path / "target", tmp_path / layout.file_name("k", 1))  # where the next write goes
        with pytest.raises(
            StoreError,
            match=r"write of 'k' .* failed: Too many levels of symbolic links; 'k' keeps "
            r"its previous value; .*\.1\.tmn is a symbolic link, which tiermem "
            r"never writes through \(its target is untouched\)",
        ):
            store.write("k", _value(N, 9)).wait()
        assert (tmp_path / "target").read_bytes() == b"precious"
        assert _same(_read(store, "k", x), x)


# -- one store owns a directory ----------------------------------------------------------------------
def _hold(directory: str, ready, done) -> None:
    """In a child process: own ``directory`` until told to stop."""
    store = NvmeStore(directory)
    ready.set()
    done.wait(60)
    store.close()


def _try(directory: str, queue) -> None:
    """In a child process: try to make a store in ``directory``; report the error, or None."""
    try:
        NvmeStore(directory).close()
        queue.put(None)
    except ConfigError as e:
        queue.put(str(e))


def test_a_second_store_in_this_process_is_refused_until_the_first_closes(tmp_path):
    first = NvmeStore(tmp_path)
    first.write("k", torch.ones(3)).wait()
    lock = tmp_path / LOCK_NAME
    assert lock.read_text() == f"{os.getpid()}\n" and stat.S_IMODE(os.stat(lock).st_mode) == 0o600
    with pytest.raises(
        ConfigError,
        match=rf"^tiermem: NVMe directory {tmp_path} is in use by another NvmeStore, "
        rf"in this process \(pid {os.getpid()}\): close the other NvmeStore "
        rf"first.*or pass another nvme_dir",
    ):
        NvmeStore(tmp_path)
    assert _same(_read(first, "k", torch.ones(3)), torch.ones(3))  # the owner is unaffected
    first.close()
    assert not lock.exists()
    with NvmeStore(tmp_path):
        assert lock.exists()
    abandoned = NvmeStore(tmp_path)
    del abandoned  # nothing references it: it lets go when collected
    NvmeStore(tmp_path).close()


def test_a_store_in_another_process_is_refused_with_its_pid_then_taken(tmp_path):
    ctx = forked.context()  # forked: a spawned child imports torch again (~5 CPU s each)
    ready, done, queue = ctx.Event(), ctx.Event(), ctx.Queue()
    holder = ctx.Process(target=_hold, args=(str(tmp_path), ready, done))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(
            ConfigError,
            match=rf"in use by another NvmeStore, in process {holder.pid}: stop that "
            rf"run first",
        ):
            NvmeStore(tmp_path)
        prober = ctx.Process(target=_try, args=(str(tmp_path), queue))  # a third process is refused alike
        prober.start()
        said = queue.get(timeout=60)
        prober.join(60)
        assert said and re.search(rf"in process {holder.pid}: stop that run first", said), said
    finally:
        done.set()
        holder.join(60)
    assert holder.exitcode == 0
    NvmeStore(tmp_path).close()  # free again


def test_a_lock_file_left_by_a_killed_run_is_taken_over_and_a_symlinked_one_refused(tmp_path):
    (tmp_path / LOCK_NAME).write_text("999999\n")  # the kernel dropped its flock when it died
    NvmeStore(tmp_path).close()
    (tmp_path / "target").write_text("precious")
    os.symlink(tmp_path / "target", tmp_path / LOCK_NAME)
    with pytest.raises(ConfigError, match=r"lock file .*tiermem.lock is a symbolic link, which tiermem never follows"):
        NvmeStore(tmp_path)
    assert (tmp_path / "target").read_text() == "precious"
