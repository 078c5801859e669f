"""Checkpoints a load can trust (issue 35): a DCP load reads exactly the files it checked (a
concurrent save never mixes in), nothing of a checkpoint runs in the loading process (NOTE
[Nothing in a checkpoint runs]), the ranks agree before anything is read, every failure of DCP is
a ``tiermem:`` error, a load that fails part way leaves a model that refuses to compute (NOTE [A
failed load is guarded]), a record that claims gigabytes is refused before it is read, and
``tm.save`` returns on every rank only once the checkpoint is published. In one process and on 2
gloo ranks (tests/ranks.py)."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import time
import tracemalloc

import pytest
import torch
import xxhash
from models import TinyGPT, gpt_batch, gpt_loss, same_state, train_steps
from ranks import forkserver, run_ranks
from torch.distributed.checkpoint.metadata import MetadataIndex

from tiermem import AdamW, StoreError, TieredModel, TierMemError
from tiermem.checkpoint import dcp as checkpoint_dcp, directory as checkpoint_dir
from tiermem.checkpoint.footer import MAGIC
from tiermem.policies import ZeroOffload

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _model(steps: int = 2, *, bucket: int = 900, seed: int = 0, policy=None) -> TieredModel:
    torch.manual_seed(seed)
    tm = TieredModel(TinyGPT(), policy, optimizer=AdamW(lr=1e-2, weight_decay=0.1), bucket_size=bucket)
    train_steps(tm, steps)
    return tm


def _filled(tm: TieredModel, value: float) -> None:
    with torch.no_grad(), tm.resident(tm.module):
        for p in tm.module.parameters():
            p.fill_(value)


def _snapshot(tm: TieredModel):
    return tm.state_dict(), tm.stepper.steps, tm.stepper.param_steps()


def _unchanged(tm: TieredModel, before) -> bool:
    return same_state(tm.state_dict(), before[0]) and (tm.stepper.steps, tm.stepper.param_steps()) == before[1:]


# -- editing a checkpoint as an attacker would ---------------------------------------------------
def _payload_then(marker: str, value):
    """What a crafted pickle calls: it leaves ``marker`` behind, then hands back the real value."""
    with open(marker, "w") as f:
        f.write("ran")
    return value


class _Payload:
    def __init__(self, marker: str, value):
        self.marker, self.value = marker, value

    def __reduce__(self):
        return (_payload_then, (self.marker, self.value))


def _metadata(path):
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own, of a checkpoint it wrote


def _remanifest(path) -> None:
    """Every manifest rewritten to list each file's current size and hash (the hash has no key:
    anyone can recompute it)."""
    for name in sorted(n for n in os.listdir(path) if n.startswith("tiermem-rank")):
        raw = (path / name).read_bytes()
        doc = json.loads(raw.rsplit(b"\n", 2)[0])
        for file in doc["files"]:
            data = (path / file).read_bytes()
            doc["files"][file] = {"nbytes": len(data), "xxh3": xxhash.xxh3_64_hexdigest(data)}
        body = json.dumps(doc, indent=1, sort_keys=True).encode()
        (path / name).write_bytes(body + b"\n" + xxhash.xxh3_64_hexdigest(body).encode() + b"\n")


def _no_manifests(path) -> None:
    for name in os.listdir(path):
        if name.startswith("tiermem-rank"):
            os.unlink(path / name)


def _payload_in_metadata(path, marker) -> None:
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker), _metadata(path))))


def _payload_in_record(path, marker, data_file: str = "__0_0.distcp") -> None:
    """The ``tiermem`` record replaced by a payload appended to ``data_file``; the metadata points at it."""
    md = _metadata(path)
    info = md.storage_data[MetadataIndex("tiermem")]
    with open(path / info.relative_path, "rb") as f:
        f.seek(info.offset)
        text = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
    blob = io.BytesIO()
    torch.save(_Payload(str(marker), text), blob)
    at = os.path.getsize(path / data_file)
    with open(path / data_file, "ab") as f:
        f.write(blob.getvalue())
    md.storage_data[MetadataIndex("tiermem")] = type(info)(data_file, at, len(blob.getvalue()))
    (path / ".metadata").write_bytes(pickle.dumps(md))


def _pointing_outside(path) -> None:
    """Every storage item moved to ``../outside.distcp``, a copy of the data beside the checkpoint."""
    (path.parent / "outside.distcp").write_bytes((path / "__0_0.distcp").read_bytes())
    md = _metadata(path)
    for index, info in md.storage_data.items():
        md.storage_data[index] = type(info)("../outside.distcp", info.offset, info.length)
    (path / ".metadata").write_bytes(pickle.dumps(md))


def _symlinked_data(path) -> None:
    """The data file replaced by a symlink to a copy outside the checkpoint."""
    os.replace(path / "__0_0.distcp", path.parent / "outside.distcp")
    os.symlink(path.parent / "outside.distcp", path / "__0_0.distcp")


CRAFTED = {
    "data file a symlink out, manifests recomputed": (
        lambda p, m: (_symlinked_data(p), _remanifest(p)),
        r"'__0_0\.distcp' is a symlink, which tm\.save never writes",
    ),
    "payload in .metadata, manifests recomputed": (
        lambda p, m: (_payload_in_metadata(p, m), _remanifest(p)),
        r"is refused: its '\.metadata' would run [\w.]*_payload_then when loaded",
    ),
    "payload in .metadata, no manifests": (
        lambda p, m: (_payload_in_metadata(p, m), _no_manifests(p)),
        r"has no tiermem manifest",
    ),
    "payload in the meta record, manifests recomputed": (
        lambda p, m: (_payload_in_record(p, m), _remanifest(p)),
        r"is refused: its '__0_0\.distcp' would run what its 'tiermem' record holds",
    ),
    "metadata pointing outside, manifests recomputed": (
        lambda p, m: (_pointing_outside(p), _remanifest(p)),
        r"its '\.metadata' points to '\.\./outside\.distcp', outside the checkpoint directory",
    ),
    "metadata pointing outside, no manifests": (
        lambda p, m: (_pointing_outside(p), _no_manifests(p)),
        r"has no tiermem manifest",
    ),
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_a_crafted_directory_runs_nothing_and_is_refused(tmp_path, name):
    craft, message = CRAFTED[name]
    path, marker = tmp_path / "ck", tmp_path / "pwned"
    _model().save(str(path), format="dcp")
    craft(path, marker)
    tm = _model(1, seed=4)
    before = _snapshot(tm)
    with pytest.raises(StoreError, match=message) as info:
        tm.load(str(path))
    assert str(info.value).startswith("tiermem:") and "nothing was loaded" in str(info.value)
    assert not marker.exists()  # the payload never ran
    assert _unchanged(tm, before)


# -- 1. a load racing a save ------------------------------------------------------------------------
def _saver(path: str, stop: str, states: str) -> None:
    """Train a step and save over ``path``, again and again until ``stop`` exists; each saved
    state goes to ``states/<k>.pt`` once its save returned."""
    tm = _model(0)
    k = 0
    while not os.path.exists(stop) and k < 400:
        train_steps(tm, 1, offset=k)
        k += 1
        tm.save(path, format="dcp")
        torch.save(tm.state_dict(), os.path.join(states, f"{k}.pt"))


def test_a_load_racing_saves_reads_one_checkpoint_whole(tmp_path):
    path, stop, states = str(tmp_path / "ck"), str(tmp_path / "stop"), tmp_path / "states"
    states.mkdir()
    saver = forkserver().Process(target=_saver, args=(path, stop, str(states)))
    saver.start()
    loaded, refused = [], 0
    try:
        deadline = time.monotonic() + 60
        while not os.listdir(states) and time.monotonic() < deadline:
            time.sleep(0.05)
        tm = _model(0, bucket=1300, seed=7)
        for _ in range(20):
            try:
                tm.load(path)
            except TierMemError:
                refused += 1  # the directory it opened was emptied before it opened a file
                continue
            loaded.append(tm.state_dict())
    finally:
        open(stop, "w").close()
        saver.join(timeout=60)
        if saver.is_alive():
            saver.kill()
    assert saver.exitcode == 0
    saved = [torch.load(states / n, weights_only=True) for n in sorted(os.listdir(states))]
    matches = [sum(same_state(got, s) for s in saved) for got in loaded]
    assert matches == [1] * len(loaded)  # each load is one saved state, never buckets of two
    assert len(loaded) >= 5, (len(loaded), refused)


# -- 4. DCP's own failures -------------------------------------------------------------------------
def _fail_writes_after(limit: int, monkeypatch) -> None:
    """DCP's writer fails with a full disk once ``limit`` bytes went to a file."""
    original = checkpoint_dir.HashedFile.write

    def write(self, data):
        if self.nbytes > limit:
            raise OSError(28, "No space left on device")
        return original(self, data)

    monkeypatch.setattr(checkpoint_dir.HashedFile, "write", write)


def _listing(tmp_path) -> list[str]:
    return sorted(n for n in os.listdir(tmp_path) if n != "nvme")


def test_a_full_disk_inside_dcps_writer_is_a_tiermem_error_with_nothing_left(tmp_path, monkeypatch):
    tm = _model()
    path = tmp_path / "ck"
    tm.save(str(path), format="dcp")
    before = tm.state_dict()
    train_steps(tm, 1, offset=2)
    _fail_writes_after(1000, monkeypatch)
    with pytest.raises(StoreError, match=r"^tiermem: .*No space left on device.*; free space or choose another path"):
        tm.save(str(path), format="dcp")  # a StoreError is an Exception: user code's except Exception catches it
    monkeypatch.undo()
    assert _listing(tmp_path) == ["ck"]  # the temporary removed
    fresh = _model(0, seed=3)
    fresh.load(str(path))  # the previous checkpoint, whole
    assert same_state(fresh.state_dict(), before)


def _rank_full_disk(rank, world, tmp):
    tm = _make_dp()
    _train_dp(tm, rank, 2)
    path = os.path.join(tmp, "ck")
    tm.save(path)
    before = tm.state_dict()
    _train_dp(tm, rank, 1, offset=2)
    original = checkpoint_dir.HashedFile.write

    def write(self, data):
        if self.nbytes > 1000:
            raise OSError(28, "No space left on device")
        return original(self, data)

    if rank == 1:
        checkpoint_dir.HashedFile.write = write  # type: ignore[method-assign]
    try:
        tm.save(path)
    except Exception as e:  # noqa: BLE001 - what user code catches
        error: tuple[str, str] | None = (type(e).__name__, str(e))
    else:
        error = None
    checkpoint_dir.HashedFile.write = original  # type: ignore[method-assign]
    fresh = _make_dp(seed=5)
    fresh.load(path)
    return error, same_state(fresh.state_dict(), before), sorted(os.listdir(tmp))


def test_a_full_disk_on_one_rank_inside_dcp_is_a_tiermem_error_on_every_rank(tmp_path):
    results = run_ranks(_rank_full_disk, str(tmp_path), deadline=90)
    for rank, (error, previous_kept, listing) in enumerate(results):
        assert error is not None and error[0] == "StoreError", (rank, error)
        assert error[1].startswith("tiermem: ") and "No space left on device" in error[1]
        assert previous_kept and listing == ["ck"]


# -- 2 ranks: the ranks agree before anything is read ---------------------------------------------
def _make_dp(seed: int = 0, bucket: int = 900) -> TieredModel:
    torch.manual_seed(seed)
    return TieredModel(TinyGPT(), ZeroOffload(), optimizer=AdamW(lr=1e-2, weight_decay=0.1), bucket_size=bucket)


def _train_dp(tm: TieredModel, rank: int, steps: int, offset: int = 0) -> None:
    for i in range(offset, offset + steps):
        x, y = gpt_batch(10 * i + rank)
        tm.backward(gpt_loss(tm(x), y))
        tm.step()


def _rank_save(rank, world, tmp):
    tm = _make_dp()
    _train_dp(tm, rank, 2)
    tm.save(os.path.join(tmp, "good"))
    tm.save(os.path.join(tmp, "bad"))
    return tm.state_dict()


def _rank_load_crafted(rank, world, tmp):
    tm = _make_dp(seed=3, bucket=1300)
    before = tm.state_dict()
    try:
        tm.load(os.path.join(tmp, "bad"))
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = (type(e).__name__, str(e))
    else:
        error = None
    unchanged = same_state(tm.state_dict(), before)
    tm.load(os.path.join(tmp, "good"))  # the collectives are still in step
    return error, unchanged, tm.state_dict()


def test_a_record_is_read_only_after_every_rank_checked_its_bytes(tmp_path):
    saved = run_ranks(_rank_save, str(tmp_path), deadline=90)[0]
    bad, marker = tmp_path / "bad", tmp_path / "pwned"
    data = sorted(n for n in os.listdir(bad) if n.endswith(".distcp"))
    smaller = min(data, key=lambda n: os.path.getsize(bad / n))
    _payload_in_record(bad, marker, smaller)
    share = checkpoint_dir.share({n: (os.path.getsize(bad / n), "") for n in data}, 2, 1)
    assert share == [smaller]  # hashed by rank 1 alone (the largest file goes to rank 0), read by rank 0
    doc_files = {".metadata"}  # only the metadata's manifest entry is recomputed: the data file's fails
    for name in sorted(n for n in os.listdir(bad) if n.startswith("tiermem-rank")):
        raw = (bad / name).read_bytes()
        doc = json.loads(raw.rsplit(b"\n", 2)[0])
        for file in doc_files & set(doc["files"]):
            data = (bad / file).read_bytes()
            doc["files"][file] = {"nbytes": len(data), "xxh3": xxhash.xxh3_64_hexdigest(data)}
        body = json.dumps(doc, indent=1, sort_keys=True).encode()
        (bad / name).write_bytes(body + b"\n" + xxhash.xxh3_64_hexdigest(body).encode() + b"\n")
    results = run_ranks(_rank_load_crafted, str(tmp_path), deadline=90)
    assert not marker.exists()  # no rank read the record before every rank's checks passed
    errors = [r[0] for r in results]
    assert errors[0] is not None and errors[0] == errors[1]  # the same error on every rank
    assert errors[0][0] == "StoreError" and f"{smaller!r} fails its checksum" in errors[0][1]
    for _, unchanged, loaded in results:
        assert unchanged and same_state(loaded, saved)


# -- 5. a load that fails part way -----------------------------------------------------------------
def _failing_second_read(monkeypatch) -> None:
    original, calls = checkpoint_dcp._read_pieces, []

    def read(*args):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        return original(*args)

    monkeypatch.setattr(checkpoint_dcp, "_read_pieces", read)


def test_a_load_that_fails_part_way_leaves_a_model_that_refuses_to_compute(tmp_path, monkeypatch):
    src = _model()
    src.save(str(tmp_path / "ck"), format="dcp")
    tm = _model(1, seed=4)
    x, y = gpt_batch(9)
    tm.backward(gpt_loss(tm(x), y))  # gradients waiting for a step
    _failing_second_read(monkeypatch)
    with pytest.raises(TierMemError, match=r"^tiermem: .*Input/output error"):
        tm.load(str(tmp_path / "ck"))
    monkeypatch.undo()
    for call, name in [
        (lambda: tm(x), r"tm\(\.\.\.\)"),
        (tm.step, r"tm\.step\(\)"),
        (lambda: tm.save(str(tmp_path / "half")), r"tm\.save\(\)"),
        (tm.sharded_state_dict, r"tm\.sharded_state_dict\(\)"),
    ]:
        with pytest.raises(TierMemError, match=rf"^tiermem: {name} would use a half-loaded model: .*Input/output"):
            call()
    assert not (tmp_path / "half").exists()
    tm.load(str(tmp_path / "ck"))  # a load that succeeds lifts it
    assert same_state(tm.state_dict(), src.state_dict())
    train_steps(tm, 1, offset=2)
    train_steps(src, 1, offset=2)
    assert same_state(tm.state_dict(), src.state_dict())


def test_a_read_failing_inside_dcp_is_a_tiermem_error_and_guards_the_model(tmp_path, monkeypatch):
    """DCP wraps a reader's failure in its CheckpointException, a BaseException: it leaves as a
    tiermem error (an Exception), and the half-loaded model refuses to compute."""
    src = _model()
    src.save(str(tmp_path / "ck"), format="dcp")
    tm = _model(1, seed=4)
    original, calls = torch.load, []

    def load(*args, **kwargs):
        calls.append(1)
        if len(calls) == 6:  # a tensor of a later bucket, read inside dcp.load
            raise OSError(5, "Input/output error")
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    with pytest.raises(StoreError, match=r"^tiermem: .*Input/output error.*; check the disk"):
        tm.load(str(tmp_path / "ck"))
    monkeypatch.undo()
    with pytest.raises(TierMemError, match=r"^tiermem: tm\(\.\.\.\) would use a half-loaded model"):
        tm(gpt_batch(0)[0])
    tm.load(str(tmp_path / "ck"))
    assert same_state(tm.state_dict(), src.state_dict())


def _rank_half_load(rank, world, tmp):
    tm = _make_dp()
    _train_dp(tm, rank, 2)
    path = os.path.join(tmp, "ck")
    tm.save(path)
    saved = tm.state_dict()
    dst = _make_dp(seed=3)
    original, calls = checkpoint_dcp._read_pieces, []
    if rank == 0:

        def read(*args):
            calls.append(1)
            if len(calls) == 2:
                raise OSError(5, "Input/output error")
            return original(*args)

        checkpoint_dcp._read_pieces = read  # type: ignore[assignment]
    try:
        dst.load(path)
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = (type(e).__name__, str(e))
    else:
        error = None
    checkpoint_dcp._read_pieces = original
    x, _ = gpt_batch(rank)
    try:
        dst(x)
    except TierMemError as e:
        refused = str(e)
    else:
        refused = None
    dst.load(path)
    loaded = same_state(dst.state_dict(), saved)
    _train_dp(dst, rank, 1, offset=2)
    _train_dp(tm, rank, 1, offset=2)
    return error, refused, loaded and same_state(dst.state_dict(), tm.state_dict())


def test_a_load_that_fails_part_way_on_one_rank_is_refused_on_every_rank(tmp_path):
    results = run_ranks(_rank_half_load, str(tmp_path), deadline=90)
    assert results[0][0] == results[1][0] and results[0][0][0] == "StoreError"
    assert "Input/output error" in results[0][0][1]
    for _, refused, same in results:
        assert refused is not None and "would use a half-loaded model" in refused
        assert same  # the next load succeeded on both, and training went on as from the checkpoint


# -- 6. a record that claims gigabytes -------------------------------------------------------------
def _cheaply(load) -> tuple[float, int]:
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        load()
    finally:
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return seconds, peak


def test_a_footer_claiming_a_gigabyte_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "ck"
    claim = 1 << 30
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.truncate(len(MAGIC) + claim)  # sparse: the footer's claimed bytes, all holes
        f.seek(0, os.SEEK_END)
        f.write(struct.pack("<QQ", claim, 12345) + MAGIC)
    tm = _model(0)
    before = _snapshot(tm)

    def load():
        with pytest.raises(StoreError, match=r"^tiermem: .* \(corrupt footer length: 1073741824 bytes, more than"):
            tm.load(str(path))

    seconds, peak = _cheaply(load)
    assert seconds < 1.0 and peak < 32 << 20, (seconds, peak)
    assert _unchanged(tm, before)


@pytest.mark.parametrize("what", ["manifest", "metadata"])
def test_a_directory_claiming_a_gigabyte_is_refused_before_it_is_read(tmp_path, what):
    path = tmp_path / "ck"
    _model().save(str(path), format="dcp")
    if what == "manifest":
        os.truncate(path / "tiermem-rank0.json", 1 << 30)
        message = r"a manifest 'tiermem-rank0\.json' of 1073741824 bytes, more than a manifest may hold"
    else:
        os.truncate(path / ".metadata", 1 << 30)
        _remanifest_sizes_only(path, ".metadata", 1 << 30)
        message = r"its manifests give \.metadata 1073741824 bytes, more than it may hold"
    tm = _model(0)
    before = _snapshot(tm)

    def load():
        with pytest.raises(StoreError, match=message):
            tm.load(str(path))

    seconds, peak = _cheaply(load)
    assert seconds < 1.0 and peak < 32 << 20, (seconds, peak)
    assert _unchanged(tm, before)


def _remanifest_sizes_only(path, file: str, nbytes: int) -> None:
    raw = (path / "tiermem-rank0.json").read_bytes()
    doc = json.loads(raw.rsplit(b"\n", 2)[0])
    doc["files"][file]["nbytes"] = nbytes  # its hash is not computed: it is never read that far
    body = json.dumps(doc, indent=1, sort_keys=True).encode()
    (path / "tiermem-rank0.json").write_bytes(body + b"\n" + xxhash.xxh3_64_hexdigest(body).encode() + b"\n")


# -- 7. tm.save returns once the checkpoint is published ------------------------------------------
def _rank_publish(rank, world, tmp, fail):
    tm = _make_dp()
    _train_dp(tm, rank, 1)
    path = os.path.join(tmp, "ck")
    if rank == 0:
        original = checkpoint_dir.publish

        def slow(a, b):
            time.sleep(1.0)
            if fail:
                raise OSError(5, "Input/output error")
            original(a, b)

        checkpoint_dir.publish = slow
    try:
        tm.save(path)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e), os.path.isdir(path)
    return None, None, os.path.isdir(path) and "tiermem-rank1.json" in os.listdir(path)


@pytest.mark.parametrize("fail", [False, True], ids=["published", "publish fails"])
def test_save_returns_on_every_rank_only_once_published(tmp_path, fail):
    results = run_ranks(_rank_publish, str(tmp_path), fail, deadline=90)
    for rank, (kind, message, there) in enumerate(results):
        if fail:
            assert kind == "StoreError" and message is not None and message.startswith("tiermem: ") and not there, (
                rank,
                message,
            )
        else:
            assert kind is None and there, rank  # the checkpoint is there when save returns
