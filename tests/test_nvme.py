"""NvmeStore: bit-exact round trips (odd sizes, every dtype, 0-d, empty, aligned or not), per-key
order, concurrency, overwrites in place through two slots (growth, shrink, the budget), the
buffered fallback, bad input, injected disk failures mid-overwrite, crashes and corrupt files."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tiermem import OutOfTierMemory, StoreError, TierMemError
from tiermem.errors import ConfigError
from tiermem.memory import nvme_layout as layout
from tiermem.memory.aligned import ALIGN, aligned_empty, round_up
from tiermem.memory.nvme import NvmeStore
from tiermem.memory.nvme_dir import LOCK_NAME, probe_direct

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
]
SMALL_BLOCK = 4 * ALIGN  # many chunks per request with little data


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (torch.equal says NaN != NaN; random bit patterns hold NaNs)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _random(
    shape: tuple[int, ...], dtype: torch.dtype, *, aligned: bool = False, gen: torch.Generator | None = None
) -> torch.Tensor:
    """Random bit patterns (NaNs, denormals, any bool byte) of ``dtype``; page-aligned or 64 bytes
    off a page boundary (like a plain torch allocation), so both the in-place and the staged
    paths run."""
    nbytes = dtype.itemsize * max(1, int(torch.Size(shape).numel()))
    buf = aligned_empty(nbytes + 64, pin=False)
    start = 0 if aligned else 64
    raw = buf[start : start + dtype.itemsize * int(torch.Size(shape).numel())]
    raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=gen))
    if dtype == torch.bool:
        raw.clamp_(max=1)
    return raw.view(dtype).view(shape)


def _empty_like(x: torch.Tensor, *, aligned: bool) -> torch.Tensor:
    out = _random(tuple(x.shape), x.dtype, aligned=aligned)
    return out.zero_() if x.numel() else out


def _round_trip(store: NvmeStore, key: str, x: torch.Tensor, *, aligned_out: bool = True) -> torch.Tensor:
    store.write(key, x).wait()
    out = _empty_like(x, aligned=aligned_out)
    store.read(key, out).wait()
    return out


def _files(directory) -> list[str]:
    """The files a store keeps in ``directory``, less the lock file of a store still open there."""
    return sorted(name for name in os.listdir(directory) if name != LOCK_NAME)


def _slots(key: str) -> list[str]:
    return [layout.file_name(key, 0), layout.file_name(key, 1)]


@pytest.fixture
def store(tmp_path):
    with NvmeStore(tmp_path, block_size=SMALL_BLOCK) as s:
        yield s


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    with NvmeStore(tmp_path_factory.mktemp("nvme"), block_size=SMALL_BLOCK, io_threads=4) as s:
        yield s


# -- round trips ------------------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [1, 7, 4095, 4096, 4097, 3 * SMALL_BLOCK + 1, 3 * 2**20 + 4099])
@pytest.mark.parametrize("aligned", [True, False])
def test_odd_sizes_round_trip(shared_store, nbytes, aligned):
    x = _random((nbytes,), torch.uint8, aligned=aligned)
    out = _round_trip(shared_store, f"odd.{nbytes}.{aligned}", x, aligned_out=aligned)
    assert _same(out, x)


def test_large_blocks_round_trip(tmp_path):
    with NvmeStore(tmp_path) as s:  # default 8 MiB blocks: a several-MiB value is 2 chunks
        for aligned in (True, False):
            x = _random((9 * 2**20 + 4097,), torch.uint8, aligned=aligned)
            assert _same(_round_trip(s, "big", x, aligned_out=not aligned), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips(shared_store, dtype):
    for shape in [(), (0,), (3, 0, 2), (5, 333)]:
        x = _random(shape, dtype)
        out = _round_trip(shared_store, f"dtype.{dtype}.{shape}", x)
        assert out.shape == x.shape and out.dtype == x.dtype
        assert _same(out, x)
        assert shared_store.meta(f"dtype.{dtype}.{shape}") == (shape, dtype)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.one_of(
        st.just(()), st.tuples(st.integers(0, 3 * SMALL_BLOCK + 5)), st.tuples(st.integers(0, 40), st.integers(0, 300))
    ),
    dtype=st.sampled_from(DTYPES),
    aligned_src=st.booleans(),
    aligned_out=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_any_shape_dtype_alignment_round_trips(shared_store, shape, dtype, aligned_src, aligned_out, seed):
    x = _random(shape, dtype, aligned=aligned_src, gen=torch.Generator().manual_seed(seed))
    expected = x.clone()
    out = _round_trip(shared_store, "prop", x, aligned_out=aligned_out)
    assert _same(out, expected)
    assert shared_store.nbytes("prop") == expected.numel() * dtype.itemsize


def test_non_contiguous_source_and_keys_that_are_not_file_names(store, tmp_path):
    x = torch.arange(600, dtype=torch.float32).view(20, 30).t()  # not contiguous
    z = torch.randn(5, dtype=torch.complex64, generator=torch.Generator().manual_seed(1)).conj()
    assert _same(_round_trip(store, "lazy conj", z), z.resolve_conj())
    keys = [
        "blocks.0.attn/qkv.weight:exp_avg",
        "../escape",
        "..",
        ".hidden",
        "a b\\c*?<>|",
        "ünïcödé:κλειδί",
        "x" * 300,
    ]
    for key in keys:
        assert _same(_round_trip(store, key, x), x)
    assert sorted(store.keys()) == sorted(keys + ["lazy conj"])
    names = _files(tmp_path)
    assert len(names) == len(keys) + 1 and all(n.endswith(".tmn") and not n.startswith(".") for n in names)
    assert not any(os.path.exists(tmp_path.parent / n) for n in names)  # nothing escaped the directory


# -- order and concurrency ------------------------------------------------------------------------
def test_concurrent_writes_and_reads_of_many_keys(store):
    gen = torch.Generator().manual_seed(0)
    values = {
        f"layer.{i}:exp_avg": _random(
            (int(torch.randint(0, 5 * SMALL_BLOCK, (1,), generator=gen)),),
            DTYPES[i % len(DTYPES)],
            aligned=i % 2 == 0,
            gen=gen,
        )
        for i in range(48)
    }
    keys = list(values)

    def writer(part):
        for h in [store.write(k, values[k]) for k in part]:
            h.wait()

    threads = [threading.Thread(target=writer, args=(keys[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(v.numel() * v.dtype.itemsize for v in values.values())
    assert store.used == total and store.bytes_written == total
    outs = {k: _empty_like(v, aligned=False) for k, v in values.items()}
    for h in [store.read(k, outs[k]) for k in keys]:  # all in flight together
        h.wait()
    for k in keys:
        assert _same(outs[k], values[k]), k
    assert store.bytes_read == total
    assert store._staging.allocated <= 8  # the staging pool stays bounded by the I/O threads


OPS = st.lists(
    st.tuples(
        st.sampled_from(["write", "read", "delete"]), st.sampled_from("abc"), st.integers(0, 3 * SMALL_BLOCK // 4 + 3)
    ),
    max_size=25,
)


@settings(max_examples=30, deadline=None)
@given(ops=OPS)
def test_requests_issued_without_waiting_see_every_earlier_request(shared_store, ops):
    """Oracle: a dict updated in issue order. Each read must return what the dict held when the
    read was issued, however the I/O threads interleave."""
    for key in list(shared_store.keys()):
        shared_store.delete(key)
    model: dict[str, torch.Tensor] = {}
    on_disk: dict[str, list[int]] = {}  # sizes of each key's writes since it was last deleted
    handles, checks = [], []
    for i, (op, key, numel) in enumerate(ops):
        if op == "write":
            model[key] = _random((numel,), torch.float32, aligned=i % 2 == 0)
            on_disk.setdefault(key, []).append(numel * 4)
            handles.append(shared_store.write(key, model[key]))
        elif op == "read" and key in model:
            out = _empty_like(model[key], aligned=i % 3 == 0)
            handles.append(shared_store.read(key, out))
            checks.append((out, model[key]))
        elif op == "read":
            with pytest.raises(StoreError, match=f"no tensor '{key}'"):
                shared_store.read(key, torch.empty(1))
        else:
            shared_store.delete(key)
            model.pop(key, None)
            on_disk.pop(key, None)
    for h in handles:
        h.wait()
    assert all(_same(out, expected) for out, expected in checks)
    assert sorted(shared_store.keys()) == sorted(model)
    # the budget counts a key's two slots: its latest value and the one before it
    assert shared_store.used == sum(sum(sizes[-2:]) for sizes in on_disk.values())


def _gate(store: NvmeStore, monkeypatch) -> threading.Event:
    """Hold every write of ``store`` until the returned event is set."""
    gate, real = threading.Event(), store._pwritev

    def held(fd, bufs, offset):
        assert gate.wait(10)
        return real(fd, bufs, offset)

    monkeypatch.setattr(store, "_pwritev", held)
    return gate


def test_read_waits_for_pending_writes_of_the_same_key(store, monkeypatch):
    old, new = _random((5000,), torch.float32), _random((5000,), torch.float32)
    store.write("w", old).wait()
    other = _random((100,), torch.float32)
    store.write("other", other).wait()
    gate = _gate(store, monkeypatch)
    h1, h2 = store.write("w", _random((5000,), torch.float32)), store.write("w", new)
    out = torch.empty(5000)
    r = store.read("w", out)
    out_other = torch.empty(100)
    store.read("other", out_other).wait()  # another key is not held up
    assert _same(out_other, other)
    time.sleep(0.05)
    assert not (h1.done() or h2.done() or r.done())
    gate.set()
    r.wait()
    assert h1.done() and h2.done() and _same(out, new)


def test_overwrite_with_a_different_size_and_dtype(store, tmp_path):
    store.write("k", _random((100_000,), torch.float32)).wait()
    y = _random((3, 7), torch.bfloat16)
    assert _same(_round_trip(store, "k", y), y)
    assert store.meta("k") == ((3, 7), torch.bfloat16) and store.used == 42 + 400_000  # both slots
    with pytest.raises(StoreError, match=r"cannot read 'k' .* it holds 21 x torch.bfloat16"):
        store.read("k", torch.empty(100_000))
    assert _files(tmp_path) == sorted(_slots("k"))


def test_delete_waits_frees_and_forgets(store, tmp_path, monkeypatch):
    store.write("keep", torch.ones(10)).wait()
    gate = _gate(store, monkeypatch)
    h = store.write("gone", torch.ones(5000))
    threading.Timer(0.05, gate.set).start()
    store.delete("gone")  # waits for the pending write, then removes the file
    assert h.done() and "gone" not in store and store.used == 40
    store.delete("never-written")
    assert _files(tmp_path) == [layout.file_name("keep", 0)]
    with pytest.raises(StoreError, match="no tensor 'gone'"):
        store.read("gone", torch.empty(5000))


def test_close_drains_pending_work_then_refuses(tmp_path, monkeypatch):
    s = NvmeStore(tmp_path)
    gate = _gate(s, monkeypatch)
    h = s.write("k", torch.ones(1000))
    threading.Timer(0.05, gate.set).start()
    s.close()
    assert h.done()
    h.wait()
    with pytest.raises(StoreError, match="is closed"):
        s.write("k", torch.ones(1))
    with NvmeStore(tmp_path) as again:  # the file outlives the store; a new store starts empty
        assert list(again.keys()) == [] and _files(tmp_path) == [layout.file_name("k", 0)]


def test_stall_seconds_counts_time_blocked_in_wait(store, monkeypatch):
    gate = _gate(store, monkeypatch)
    h = store.write("k", torch.ones(10))
    threading.Timer(0.05, gate.set).start()
    h.wait()
    assert store.stall_seconds >= 0.03


# -- direct and buffered I/O ----------------------------------------------------------------------
def test_direct_path_pads_files_to_whole_blocks(tmp_path):
    supported, refused = probe_direct(str(tmp_path), None)
    if not supported:
        pytest.skip(f"{tmp_path} refuses O_DIRECT ({refused}); the fallback is tested below")
    with NvmeStore(tmp_path, direct=True) as s:
        assert s.direct
        x = _random((4097,), torch.uint8)
        assert _same(_round_trip(s, "k", x), x)
        assert os.path.getsize(tmp_path / layout.file_name("k", 0)) == layout.HEADER + round_up(4097)


def test_buffered_path_when_direct_is_off(tmp_path):
    with NvmeStore(tmp_path, direct=False, block_size=SMALL_BLOCK) as s:
        assert not s.direct
        for aligned in (True, False):  # the second write goes to the other slot
            x = _random((3 * SMALL_BLOCK + 5,), torch.int16, aligned=aligned)
            assert _same(_round_trip(s, "k", x, aligned_out=not aligned), x)
        assert [os.path.getsize(tmp_path / n) for n in _slots("k")] == [layout.HEADER + x.numel() * 2] * 2


def _refuse_o_direct(monkeypatch):
    real = os.open

    def fake(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake)


def test_filesystem_refusing_o_direct_falls_back_with_one_warning(tmp_path, monkeypatch, caplog):
    _refuse_o_direct(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="tiermem.memory.nvme"):
        s = NvmeStore(tmp_path)
    try:
        warnings = [r for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]
        assert len(warnings) == 1 and "buffered I/O" in warnings[0].getMessage()
        assert not s.direct
        x = _random((5000,), torch.float16)
        assert _same(_round_trip(s, "k", x), x)
        assert _files(tmp_path) == [layout.file_name("k", 0)]  # the probe file is gone
    finally:
        s.close()
    with pytest.raises(ConfigError, match=r"direct=True.* refuses O_DIRECT .*pass direct=None"):
        NvmeStore(tmp_path, direct=True)


# -- bad input: a clear error each, and what was stored stays readable --------------------------
BAD_INPUT = [
    (lambda s, d: NvmeStore(d / "missing"), ConfigError, r"does not exist; create it first \(mkdir -p "),
    (lambda s, d: NvmeStore(d / "a-file"), ConfigError, r"is not a directory; pass a directory"),
    (lambda s, d: NvmeStore("/sys"), ConfigError, r"cannot create files in /sys .*make it writable"),
    (lambda s, d: NvmeStore(d, budget="lots"), ConfigError, r"NvmeStore.budget='lots' does not parse"),
    (lambda s, d: NvmeStore(d, budget=-1), ConfigError, r"NvmeStore.budget=-1 is negative"),
    (lambda s, d: NvmeStore(d, io_threads=0), ConfigError, r"io_threads=0 must be an int >= 1"),
    (lambda s, d: NvmeStore(d, block_size=1000), ConfigError, r"block_size=1000 must be a positive multiple of 4096"),
    (
        lambda s, d: s.write("big", torch.ones(2000)),
        OutOfTierMemory,
        r"'big': asked 7.81 KiB, 40 B in use of 4.00 KiB allowed; pass a budget of at least 7.85 KiB",
    ),
    (
        lambda s, d: s.write("kept", torch.ones(1020)),
        OutOfTierMemory,  # fits alone, not beside the old value
        r"'kept': asked 4.02 KiB, 0 B in use of 4.00 KiB allowed; 'kept' keeps its previous value \(40 B\) "
        r"on disk beside the new one, .*pass a budget of at least 4.02 KiB",
    ),
    (lambda s, d: s.read("ghost", torch.empty(1)), StoreError, r"no tensor 'ghost' on the nvme tier"),
    (
        lambda s, d: s.read("kept", torch.empty(11)),
        StoreError,
        r"into a tensor of 11 x torch.float32: it holds 10 x torch.float32",
    ),
    (lambda s, d: s.read("kept", torch.empty(10, dtype=torch.int32)), StoreError, r"holds 10 x torch.float32"),
    (lambda s, d: s.read("kept", torch.empty(20)[::2]), StoreError, r"non-contiguous"),
    (lambda s, d: s.read("kept", torch._neg_view(torch.empty(10))), StoreError, r"lazily conjugated or negated"),
    (lambda s, d: s.write("k", [1.0, 2.0]), StoreError, r"needs a torch.Tensor as src for 'k', got list"),
    (lambda s, d: s.write("k", torch.empty(3, device="meta")), StoreError, r"dense CPU tensors only"),
    (lambda s, d: s.write(7, torch.ones(1)), StoreError, r"keys are non-empty strings, got 7"),
    (lambda s, d: s.write("k" * 5000, torch.ones(1)), StoreError, r"does not fit the 4096-byte NVMe file header"),
]


@pytest.mark.parametrize("make_error, kind, message", BAD_INPUT)
def test_bad_input_is_a_clear_error_and_stored_keys_survive(tmp_path, make_error, kind, message):
    (tmp_path / "a-file").write_text("not a directory")
    with NvmeStore(tmp_path, budget="4KiB") as s:
        kept = _random((10,), torch.float32)
        s.write("kept", kept).wait()
        with pytest.raises(kind, match=message) as info:
            make_error(s, tmp_path)
        assert isinstance(info.value, TierMemError) and str(info.value).startswith("tiermem:")
        out = torch.empty(10)
        s.read("kept", out).wait()
        assert _same(out, kept) and s.used == 40 and list(s.keys()) == ["kept"]
    assert sorted(_files(tmp_path)) == sorted(["a-file", layout.file_name("kept", 0)])  # nothing else made


def test_default_budget_is_the_free_space(tmp_path):
    import shutil

    with NvmeStore(tmp_path) as s:
        assert abs(s.allowed - shutil.disk_usage(tmp_path).free) < 2**30
        s.write("k", torch.ones(4)).wait()
        assert s.used == 16 and s.ledger.held("k") == 16


# -- disk failures and corrupt files --------------------------------------------------------------
@pytest.mark.parametrize(
    "seam, code", [("_pwritev", errno.ENOSPC), ("_fallocate", errno.ENOSPC), ("_pwritev", errno.EIO)]
)
def test_failed_write_keeps_the_previous_value(store, tmp_path, monkeypatch, seam, code):
    old = _random((3 * SMALL_BLOCK + 3,), torch.bfloat16)
    store.write("k", old).wait()
    calls = []

    def fail(*args):
        calls.append(args)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(store, seam, fail)
    fix = "free space on that filesystem, pass a different nvme_dir" if code == errno.ENOSPC else "check the disk"
    h = store.write("k", _random((10 * SMALL_BLOCK,), torch.float32))
    with pytest.raises(
        TierMemError,
        match=rf"write of 'k' .* in {tmp_path} failed: {os.strerror(code)}; "
        rf"'k' keeps its previous value; {fix}",
    ):
        h.wait()
    h2 = store.write("fresh", torch.ones(3))
    with pytest.raises(StoreError, match="'fresh' holds no value"):
        h2.wait()
    assert calls and "fresh" not in store and store.meta("k") == (tuple(old.shape), torch.bfloat16)
    assert store.used == old.numel() * 2 and _files(tmp_path) == [layout.file_name("k", 0)]
    monkeypatch.undo()
    out = torch.empty_like(old)
    store.read("k", out).wait()
    assert _same(out, old)
    y = torch.arange(7.0)
    assert _same(_round_trip(store, "k", y), y)  # the store works after the failure


def _truncate(path):
    os.truncate(path, layout.HEADER + 100)


def _damage_header(path):
    with open(path, "r+b") as f:
        f.write(b"garbage!")


def _restamp_header(path):  # a well-formed header that describes another tensor
    with open(path, "r+b") as f:
        f.write(layout.encode_header("k", torch.int32, (2500,), 10_000, gen=0))


def _blank_header(path):  # what a write that died before its switch leaves
    with open(path, "r+b") as f:
        f.write(bytes(layout.HEADER))


SPOILS = [
    (_truncate, r"is truncated \(.*\)"),
    (_damage_header, r"is corrupt: its header is damaged"),
    (_restamp_header, r"is corrupt: its header describes .*'int32'.*, not the value the store wrote"),
    (_blank_header, r"is corrupt: its header is blank \(a write to it did not finish\)"),
    (os.unlink, r"is missing \(removed outside tiermem\)"),
]


@pytest.mark.parametrize("spoil, message", SPOILS)
def test_spoiled_file_is_a_clear_error(store, tmp_path, spoil, message):
    x, other = _random((2500,), torch.float32), _random((3,), torch.float32)
    store.write("k", x).wait()
    store.write("other", other).wait()
    spoil(tmp_path / layout.file_name("k", 0))
    with pytest.raises(StoreError, match=message + r"; the stored value is lost: write 'k' again"):
        store.read("k", torch.empty(2500)).wait()
    assert _same(_round_trip(store, "other", other), other)
    assert _same(_round_trip(store, "k", x), x)  # writing it again repairs it


# -- overwrites: two slots, reused in place ----------------------------------------------------------
def test_overwrites_reuse_the_two_slot_files_in_place(store, tmp_path):
    n = 3 * SMALL_BLOCK + 3
    values = [_random((n,), torch.uint8, aligned=i % 2 == 0, gen=torch.Generator().manual_seed(i)) for i in range(12)]
    other = _random((5,), torch.int64)
    store.write("other", other).wait()
    inodes = None
    for i, x in enumerate(values):
        assert _same(_round_trip(store, "k", x, aligned_out=i % 3 == 0), x)
        if i == 1:
            inodes = [os.stat(tmp_path / name).st_ino for name in _slots("k")]
    # the same two files all along (no new file per write), holding the latest and the one before
    assert [os.stat(tmp_path / name).st_ino for name in _slots("k")] == inodes
    assert _files(tmp_path) == sorted(_slots("k") + [layout.file_name("other", 0)])
    assert store.used == 2 * n + 40 and store.bytes_written == 12 * n + 40
    out = torch.empty_like(other)
    store.read("other", out).wait()
    assert _same(out, other)
    store.delete("k")  # removes both slots
    assert _files(tmp_path) == [layout.file_name("other", 0)] and store.used == 40


@pytest.mark.parametrize("direct", [None, False])
def test_values_that_grow_and_shrink(tmp_path, direct):
    sizes = [5000, 20 * SMALL_BLOCK + 1, 300, 20 * SMALL_BLOCK + 1, 7, 0, 9000, 2 * SMALL_BLOCK]
    dtypes = [torch.float32, torch.uint8, torch.bfloat16, torch.int8, torch.float64, torch.float16]
    written = []
    with NvmeStore(tmp_path, block_size=SMALL_BLOCK, direct=direct) as store:
        for i, numel in enumerate(sizes):
            x = _random((numel,), dtypes[i % len(dtypes)], aligned=i % 2 == 1)
            written.append(x)
            assert _same(_round_trip(store, "k", x), x), i
            assert store.used == sum(v.nbytes for v in written[-2:])
            for j in range(max(0, i - 1), i + 1):  # write j went to slot j % 2, sized to fit it
                size, nbytes = os.path.getsize(tmp_path / layout.file_name("k", j % 2)), written[j].nbytes
                assert size == layout.HEADER + (round_up(nbytes) if store.direct else nbytes)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("where", ["blanking the header", "a middle chunk", "the switch"])
def test_failure_in_the_middle_of_an_overwrite_keeps_the_previous_value(store, tmp_path, monkeypatch, where, code):
    old = [_random((3 * SMALL_BLOCK + 3,), torch.float32) for _ in range(2)]
    for x in old:  # both slots exist: the overwrite goes over the older one, in place
        store.write("k", x).wait()
    real, hit = store._pwritev, []

    def failing(fd, bufs, offset):
        head = bytes(memoryview(bufs[0])[: len(layout.MAGIC)])
        if {
            "blanking the header": offset == 0 and head == bytes(len(layout.MAGIC)),
            "a middle chunk": offset == layout.HEADER + 2 * SMALL_BLOCK,
            "the switch": offset == 0 and head == layout.MAGIC,
        }[where]:
            hit.append(offset)
            raise OSError(code, os.strerror(code))
        return real(fd, bufs, offset)

    monkeypatch.setattr(store, "_pwritev", failing)
    h = store.write("k", _random((3 * SMALL_BLOCK + 3,), torch.float32))
    with pytest.raises(StoreError, match=rf"write of 'k' .* failed: {os.strerror(code)}; 'k' keeps its previous value"):
        h.wait()
    assert hit
    out = torch.empty_like(old[1])
    store.read("k", out).wait()
    assert _same(out, old[1])
    # the slot it spoilt is gone (blocks given back), the budget counts what is left
    assert _files(tmp_path) == [layout.file_name("k", 1)] and store.used == old[1].numel() * 4
    monkeypatch.undo()
    y = _random((1000,), torch.float32)
    assert _same(_round_trip(store, "k", y), y)  # the next write succeeds


def _hold_body_writes(store: NvmeStore, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Hold every write past the header until ``release`` is set; ``held`` is set once one waits."""
    held, release, real = threading.Event(), threading.Event(), store._pwritev

    def slow(fd, bufs, offset):
        if offset >= layout.HEADER:
            held.set()
            assert release.wait(10)
        return real(fd, bufs, offset)

    monkeypatch.setattr(store, "_pwritev", slow)
    return held, release


def test_a_crash_mid_overwrite_leaves_the_previous_value_and_never_a_torn_one(store, tmp_path, monkeypatch):
    """Freeze an overwrite half way, copy the disk as a crash would leave it, let the write finish,
    then put the crashed disk back: the store reads the previous value, never the torn slot."""
    v0, v1 = _random((3, 2000), torch.float32), _random((4, 1000), torch.bfloat16)
    store.write("k", v0).wait()
    store.write("k", v1).wait()
    held, release = _hold_body_writes(store, monkeypatch)
    h = store.write("k", _random((3, 2000), torch.float32))  # over slot 0, which holds v0
    assert held.wait(10)
    crashed = {name: (tmp_path / name).read_bytes() for name in _slots("k")}
    assert crashed[_slots("k")[0]][: layout.HEADER] == bytes(layout.HEADER)  # blanked before any data moved
    release.set()
    h.wait()
    monkeypatch.undo()
    for name, raw in crashed.items():
        (tmp_path / name).write_bytes(raw)
    with pytest.raises(
        StoreError,
        match=r"its header is blank \(a write to it did not finish\); 'k' falls "
        r"back to its previous value \(4000 x torch.bfloat16",
    ):
        store.read("k", torch.empty(3, 2000)).wait()
    out = torch.empty(4, 1000, dtype=torch.bfloat16)
    store.read("k", out).wait()
    assert _same(out, v1) and store.meta("k") == ((4, 1000), torch.bfloat16)
    assert _files(tmp_path) == [layout.file_name("k", 1)] and store.used == v1.numel() * 2


@pytest.mark.parametrize(
    "spoil, message",
    SPOILS
    + [(lambda path: _restamp(path, gen=0), r"its header describes .*'gen': 0.*, not the value the store wrote")],
)
def test_spoiled_latest_slot_falls_back_to_the_previous_value(store, tmp_path, spoil, message):
    v0, v1, v2 = _random((2500,), torch.float32), _random((50, 50), torch.float32), _random((700,), torch.int16)
    for x in (v0, v1, v2):  # slot 0: v2 (gen 2), slot 1: v1 (gen 1)
        store.write("k", x).wait()
    spoil(tmp_path / layout.file_name("k", 0))
    with pytest.raises(
        StoreError,
        match=message + r"; 'k' falls back to its previous value \(2500 x "
        r"torch.float32, .*read 'k' again to get that value",
    ):
        store.read("k", torch.empty(700, dtype=torch.int16)).wait()
    assert store.meta("k") == ((50, 50), torch.float32) and store.used == 2500 * 4
    assert _same(_round_trip(store, "other", v2), v2)  # other keys are not involved
    out = torch.empty(50, 50)
    store.read("k", out).wait()
    assert _same(out, v1)
    v3 = _random((9000,), torch.uint8)
    assert _same(_round_trip(store, "k", v3), v3)  # goes over the spoilt slot, repairing it
    store.read("k", torch.empty(9000, dtype=torch.uint8)).wait()


def _restamp(path, *, gen):  # the right key and shape, an older generation
    with open(path, "r+b") as f:
        f.write(layout.encode_header("k", torch.int16, (700,), 1400, gen=gen))


def test_both_slots_spoiled_is_a_clear_error_and_an_older_slot_does_not_matter(store, tmp_path):
    v0, v1 = _random((2500,), torch.float32), _random((2500,), torch.float32)
    store.write("k", v0).wait()
    store.write("k", v1).wait()
    _truncate(tmp_path / layout.file_name("k", 0))  # the older slot: reads of the latest do not look at it
    assert _same(_round_trip(store, "other", v0), v0)
    out = torch.empty(2500)
    store.read("k", out).wait()
    assert _same(out, v1)
    _damage_header(tmp_path / layout.file_name("k", 1))
    with pytest.raises(
        StoreError,
        match=r"\.1\.tmn holding 'k' is corrupt: its header is damaged; so is the "
        r"previous value's: .*\.0\.tmn holding 'k' is truncated .*; the stored "
        r"value is lost: write 'k' again",
    ):
        store.read("k", out).wait()
    assert "k" in store
    assert _same(_round_trip(store, "k", v0), v0)


def test_files_left_by_an_earlier_store_are_reused_not_counted(tmp_path):
    with NvmeStore(tmp_path, block_size=SMALL_BLOCK) as first:
        for n in (9000, 8000):
            first.write("k", torch.ones(n)).wait()
    assert _files(tmp_path) == sorted(_slots("k"))
    with NvmeStore(tmp_path, block_size=SMALL_BLOCK) as again:  # starts empty, as before slots
        assert list(again.keys()) == []
        x = _random((100,), torch.float32)
        assert _same(_round_trip(again, "k", x), x)
        assert again.used == 400 and _files(tmp_path) == [layout.file_name("k", 0)]


def test_revert_undoes_the_latest_write_once(store, tmp_path):
    v0, v1 = _random((3000,), torch.float32), _random((10,), torch.int64)
    store.write("k", v0).wait()
    with pytest.raises(StoreError, match=r"cannot revert 'k': it holds no value from before its latest write"):
        store.revert("k")  # written once: nothing to go back to
    h = store.write("k", v1)
    store.revert("k")  # waits for the write, then undoes it
    assert h.done() and store.meta("k") == ((3000,), torch.float32) and store.used == 12_000
    out = torch.empty(3000)
    store.read("k", out).wait()
    assert _same(out, v0) and _files(tmp_path) == [layout.file_name("k", 0)]
    with pytest.raises(StoreError, match=r"or it was reverted already"):
        store.revert("k")
    with pytest.raises(StoreError, match=r"no tensor 'ghost'"):
        store.revert("ghost")
    assert _same(_round_trip(store, "k", v1), v1)  # writing goes on from the reverted value


def test_requests_still_finish_when_the_pool_takes_no_more_work():
    """At the interpreter's exit concurrent.futures refuses new work (as a pool shut down does). A
    request queued behind another of its key, and the chunks of a request already started, then run
    on the thread that would have submitted them: whoever waits for them (a prefetch's lane thread,
    which the exit joins) is not left waiting forever. A request with nothing ahead is refused to
    its caller, as before."""
    from concurrent.futures import Future
    from functools import partial

    from tiermem.memory.nvme_keys import KeyState
    from tiermem.memory.nvme_requests import Requests

    requests = Requests(threading.Lock(), 2, hashing=False)
    state = KeyState()
    first_may_end = threading.Event()
    ran: list[str] = []

    def first(future: Future) -> None:
        first_may_end.wait(timeout=10)
        ran.append("first")
        future.set_result(None)

    def second(future: Future) -> None:  # a request that fans out into three chunks
        def chunk(i: int) -> None:
            ran.append(f"chunk {i}")

        requests.fan_out([partial(chunk, i) for i in range(3)], lambda err, _: future.set_result(err))

    one = requests.enqueue(state, first)
    two = requests.enqueue(state, second)  # behind `first`, submitted when it ends
    requests.pool.shutdown(wait=False)  # from now on submit() raises, as at the interpreter's exit
    first_may_end.set()
    assert one.result(timeout=10) is None and two.result(timeout=10) is None
    assert ran[0] == "first" and sorted(ran[1:]) == ["chunk 0", "chunk 1", "chunk 2"]
    with pytest.raises(RuntimeError):
        requests.enqueue(KeyState(), first)
