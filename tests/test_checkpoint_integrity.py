"""A real checkpoint against hand edits and a hostile directory: every edit to the footer is
refused before anything changes (by its checksum, or, re-signed, by the field it breaks), stale
temporaries of dead processes go, symlinks are never written through, files are 0600."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import time
import zlib

import forked
import pytest
import torch
import xxhash
from models import Quirky, TinyGPT, gpt_batch, gpt_loss, same_state

from tiermem import AdamW, StoreError, TieredModel, TierMemError
from tiermem.checkpoint import file as checkpoint

_TAIL = struct.Struct("<QQ")  # NOTE [Checkpoint format]: footer length, footer xxh3_64, then MAGIC


def _model(precision: str = "fp32", steps: int = 2) -> TieredModel:
    torch.manual_seed(0)
    tm = TieredModel(TinyGPT(), optimizer=AdamW(lr=1e-2, weight_decay=0.1), precision=precision, bucket_size=2000)
    for i in range(steps):
        x, y = gpt_batch(i)
        tm.backward(gpt_loss(tm(x), y))
        tm.step()
    return tm


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("ck") / "c.tm"
    _model().save(str(path))
    return path.read_bytes()


def _split(data: bytes) -> tuple[bytes, dict, int]:
    """(everything before the footer, the footer, its checksum as written)."""
    n, crc = _TAIL.unpack(data[-len(checkpoint.MAGIC) - _TAIL.size : -len(checkpoint.MAGIC)])
    start = len(data) - len(checkpoint.MAGIC) - _TAIL.size - n
    return data[:start], json.loads(data[start : start + n]), crc


def _join(body: bytes, footer: bytes, crc: int | None = None) -> bytes:
    """A v3 file; ``crc=None`` signs the footer anew, as an editor who knows the format would."""
    checksum = xxhash.xxh3_64_intdigest(footer) if crc is None else crc
    return body + footer + _TAIL.pack(len(footer), checksum) + checkpoint.MAGIC


def _as_old(data: bytes, magic: bytes) -> bytes:
    """The same checkpoint in an older format: CRC-32s of the tensors, and (v2) of the footer."""
    body, doc, _ = _split(data)
    for e in doc["tensors"]:
        del e["xxh3"]
        e["crc32"] = zlib.crc32(body[e["offset"] : e["offset"] + e["nbytes"]])
    footer = json.dumps(doc).encode()
    trailer = (
        struct.pack("<QI", len(footer), zlib.crc32(footer))
        if magic == checkpoint.MAGIC_V2
        else struct.pack("<Q", len(footer))
    )
    return magic + body[len(checkpoint.MAGIC) :] + footer + trailer + magic


def _entry(doc: dict, name: str) -> dict:
    return next(e for e in doc["tensors"] if e["name"] == name)


def _set(*keys):
    """An edit that sets doc[keys[0]][keys[1]]... to a value."""

    def edit(value):
        def apply(doc):
            d = doc
            for k in keys[:-1]:
                d = d[k]
            d[keys[-1]] = value

        return apply

    return edit


step, lr, scaler = _set("meta", "step"), _set("meta", "groups", 0, "lr"), _set("meta", "scaler")


def _group(key):
    return _set("meta", "groups", 0, key)


def _tensor(name, key):
    def edit(value):
        return lambda doc: _entry(doc, name).update({key: value})

    return edit


def _param_step(value):
    def apply(doc):
        name = next(iter(doc["meta"]["param_step"]))
        doc["meta"]["param_step"][name] = value

    return apply


def _dtype_float64(doc):
    _entry(doc, "master/wte.weight")["dtype"] = "float64"


_W = "master/wte.weight"
CORRUPT = (StoreError, r"not a readable tiermem checkpoint \(corrupt footer")
OTHER = (TierMemError, "does not match this model")

# Edits a user could make with a text editor, the footer still valid JSON but its checksum not updated.
UNSIGNED = [
    ("dtype float32 -> float64", _dtype_float64),
    ("step", step(100)),
    ("lr", lr(0.5)),
    ("a parameter's step count", _param_step(1)),
]

# The same and worse, re-signed: each field's own check finds it. (edit, error type, message)
SIGNED = {
    "step a string": (step("x"), *CORRUPT, r"meta\.step='x' is invalid: it must be an int >= 0"),
    "step negative": (step(-1), *CORRUPT, r"meta\.step=-1"),
    "step a boolean": (step(True), *CORRUPT, r"meta\.step=True"),
    "step a float": (step(2.0), *CORRUPT, r"meta\.step=2\.0"),
    "step below a parameter's count": (
        step(0),
        *CORRUPT,
        r"meta\.param_step\[.*\]=2 is invalid: it must be an int in \[0, step=0\]",
    ),
    "param_step a list": (
        _set("meta", "param_step")([]),
        *CORRUPT,
        r"meta\.param_step=\[\] is invalid: it must be an object",
    ),
    "param_step negative": (_param_step(-1), *CORRUPT, r"meta\.param_step\['.*'\]=-1"),
    "param_step a string": (_param_step("2"), *CORRUPT, r"meta\.param_step\['.*'\]='2'"),
    "param_step of a stranger": (
        _set("meta", "param_step", "nope.weight")(1),
        *OTHER,
        r"param_step counts steps of \['nope.weight'\], not trainable parameters",
    ),
    "scaler a string": (scaler("big"), *CORRUPT, r"meta\.scaler='big' is invalid: it must be an object"),
    "scaler without good_steps": (scaler({"scale": 1.0}), *CORRUPT, r"meta\.scaler keys=\['scale'\]"),
    "scale zero": (scaler({"scale": 0.0, "good_steps": 0}), *CORRUPT, r"meta\.scaler\.scale=0\.0 is invalid"),
    "scale infinite": (scaler({"scale": math.inf, "good_steps": 0}), *CORRUPT, r"meta\.scaler\.scale=inf"),
    "scale a string": (scaler({"scale": "1", "good_steps": 0}), *CORRUPT, r"meta\.scaler\.scale='1'"),
    "good_steps negative": (scaler({"scale": 1.0, "good_steps": -3}), *CORRUPT, r"meta\.scaler\.good_steps=-3"),
    "a loss scale at fp32": (
        scaler({"scale": 1024.0, "good_steps": 0}),
        *CORRUPT,
        r"meta\.scaler=.* it must be \{'scale': 1\.0, 'good_steps': 0\} at precision 'fp32'",
    ),
    "precision unknown": (
        _set("meta", "precision")("fp8"),
        *CORRUPT,
        r"meta\.precision='fp8' is invalid: it must be one of",
    ),
    "precision a number": (_set("meta", "precision")(16), *CORRUPT, r"meta\.precision=16"),
    "lr a string": (lr("evil"), *CORRUPT, r"meta\.groups\[0\]\.lr='evil' is invalid: it must be a finite number >= 0"),
    "lr negative": (lr(-1e-3), *CORRUPT, r"meta\.groups\[0\]\.lr=-0\.001"),
    "lr NaN": (lr(math.nan), *CORRUPT, r"meta\.groups\[0\]\.lr=nan"),
    "lr a boolean": (lr(True), *CORRUPT, r"meta\.groups\[0\]\.lr=True is invalid: it must be a finite number >= 0"),
    "betas null": (
        _group("betas")(None),
        *CORRUPT,
        r"meta\.groups\[0\]\.betas=None is invalid: it must be two numbers",
    ),
    "betas of one": (_group("betas")([0.9]), *CORRUPT, r"meta\.groups\[0\]\.betas=\[0\.9\]"),
    "beta2 of 1": (_group("betas")([0.9, 1.0]), *CORRUPT, r"meta\.groups\[0\]\.betas=\[0\.9, 1\.0\]"),
    "eps negative": (_group("eps")(-1.0), *CORRUPT, r"meta\.groups\[0\]\.eps=-1\.0"),
    "weight_decay a string": (_group("weight_decay")("0.1"), *CORRUPT, r"meta\.groups\[0\]\.weight_decay='0\.1'"),
    "initial_lr negative": (_group("initial_lr")(-1.0), *CORRUPT, r"meta\.groups\[0\]\.initial_lr=-1\.0"),
    "a key no group has": (_group("amsgrad")(True), *CORRUPT, r"meta\.groups\[0\] keys="),
    "groups a dict": (_set("meta", "groups")({}), *CORRUPT, r"meta\.groups=\{\} is invalid: it must be a list"),
    "a group a string": (
        _set("meta", "groups")(["x"]),
        *CORRUPT,
        r"meta\.groups\[0\]='x' is invalid: it must be an object",
    ),
    "one group more": (
        lambda d: d["meta"]["groups"].append(dict(d["meta"]["groups"][0])),
        TierMemError,
        r"has 2 param groups, this model 1",
    ),
    "a group renamed": (
        _group("name")("other"),
        TierMemError,
        r"has other param groups than this model: group 0 is 'other' there, 'decay' here",
    ),
    "a group's parameter moved out": (
        lambda d: d["meta"]["groups"][0]["params"].pop(),
        TierMemError,
        r"group 0 is 'decay' there, 'decay' here \(only there: \[\], only here: \['",
    ),
    "a group name not a str": (_group("name")(3), *CORRUPT, r"meta\.groups\[0\]\.name=3 is invalid: it must be a str"),
    "group params not names": (
        _group("params")([1]),
        *CORRUPT,
        r"meta\.groups\[0\]\.params=\[1\] is invalid: it must be a list of parameter names",
    ),
    "meta without step": (lambda d: d["meta"].pop("step"), *CORRUPT, r"meta keys="),
    "meta with more": (_set("meta", "epoch")(3), *CORRUPT, r"meta keys="),
    "footer with more": (_set("extra")(1), *CORRUPT, r"footer keys="),
    "footer a list": (lambda d: d.clear(), *CORRUPT, r"footer keys=\[\]"),
    "tensors a dict": (_set("tensors")({}), *CORRUPT, r"tensors=\{\} is invalid: it must be a list"),
    "dtype unknown": (
        _tensor(_W, "dtype")("floatXX"),
        *CORRUPT,
        r"\.dtype='floatXX' is invalid: it must be a torch dtype",
    ),
    "dtype an alias": (_tensor(_W, "dtype")("float"), *CORRUPT, r"\.dtype='float'"),
    "dtype not a dtype": (_tensor(_W, "dtype")("nn"), *CORRUPT, r"\.dtype='nn'"),
    "dtype float64, same nbytes": (
        _dtype_float64,
        *CORRUPT,
        r"'master/wte\.weight'\)\.nbytes=3552 is invalid: it must be 7104",
    ),
    "dtype of the same size": (
        _tensor(_W, "dtype")("int32"),
        *OTHER,
        r"'master/wte\.weight' is int32, the model holds it as float32",
    ),
    "shape of the same size": (_tensor(_W, "shape")([24, 37]), *OTHER, r"'master/wte\.weight' has shape \(24, 37\)"),
    "shape negative": (_tensor(_W, "shape")([-37, -24]), *CORRUPT, r"\.shape=\[-37, -24\]"),
    "nbytes short": (
        _tensor(_W, "nbytes")(8),
        *CORRUPT,
        r"\.nbytes=8 is invalid: it must be 3552 \(float32 x \[37, 24\]\)",
    ),
    "offset negative": (_tensor(_W, "offset")(-64), *CORRUPT, r"\.offset=-64 is invalid: it must be an int >= 16"),
    "offset in the header": (_tensor(_W, "offset")(0), *CORRUPT, r"\.offset=0"),
    "offset a string": (_tensor(_W, "offset")("64"), *CORRUPT, r"\.offset='64'"),
    "offset past the data": (
        _tensor(_W, "offset")(10**9),
        *CORRUPT,
        r"\.offset=1000000000 is invalid: it must be such that",
    ),
    "xxh3 negative": (_tensor(_W, "xxh3")("-1"), *CORRUPT, r"\.xxh3='-1' is invalid: it must be 16 lowercase hex"),
    "xxh3 an int": (_tensor(_W, "xxh3")(12345), *CORRUPT, r"\.xxh3=12345"),
    "an entry without xxh3": (lambda d: _entry(d, _W).pop("xxh3"), *CORRUPT, r"keys="),
    "crc32 in place of xxh3": (lambda d: _entry(d, _W).update(crc32=_entry(d, _W).pop("xxh3")), *CORRUPT, r"keys="),
    "a name twice": (
        lambda d: d["tensors"].append(dict(_entry(d, _W))),
        *CORRUPT,
        r"\.name='master/wte\.weight' is invalid",
    ),
    "a tensor missing": (lambda d: d["tensors"].remove(_entry(d, _W)), *OTHER, r"missing \['master/wte\.weight'\]"),
    "xxh3 of other bytes": (
        _tensor(_W, "xxh3")(f"{12345:016x}"),
        StoreError,
        r"'master/wte\.weight' fails its checksum",
    ),
}


def _before(tm: TieredModel) -> tuple:
    return (
        tm.state_dict(),
        tm.stepper.steps,
        tm.stepper.param_steps(),
        tm.scaler.state_dict(),
        [dict(g) for g in tm.optimizer.param_groups],
    )


def _unchanged(tm: TieredModel, before: tuple) -> bool:
    after = _before(tm)
    return same_state(before[0], after[0]) and after[1:] == before[1:]


@pytest.fixture(scope="module")
def target() -> TieredModel:
    """One model every refused load goes into (it must come out of each unchanged)."""
    return _model(steps=1)


def _refused(target, path, error, message):
    before = _before(target)
    with pytest.raises(error, match=message) as info:
        target.load(str(path))
    assert str(info.value).startswith("tiermem:")
    assert _unchanged(target, before)
    return str(info.value)


@pytest.mark.parametrize("edit", [e for _, e in UNSIGNED], ids=[n for n, _ in UNSIGNED])
def test_a_hand_edit_fails_the_footer_checksum(saved, target, tmp_path, edit):
    body, doc, crc = _split(saved)
    edit(doc)
    (tmp_path / "edited.tm").write_bytes(_join(body, json.dumps(doc).encode(), crc))
    message = _refused(target, tmp_path / "edited.tm", StoreError, r"corrupt footer: it fails its checksum")
    assert message.endswith("Pass a file written by tm.save(), unedited")


@pytest.mark.parametrize("name", list(SIGNED))
def test_a_re_signed_edit_is_refused_by_the_field_it_breaks(saved, target, tmp_path, name):
    edit, error, *messages = SIGNED[name]
    body, doc, _ = _split(saved)
    edit(doc)
    (tmp_path / "edited.tm").write_bytes(_join(body, json.dumps(doc).encode()))
    message = _refused(target, tmp_path / "edited.tm", error, ".*".join(messages))
    assert message.endswith(
        (
            "Pass a file written by tm.save(), unedited",
            "Load it into the model it was saved from",
            "tm.optimizer.add_param_group) before loading",
            "Use another checkpoint",
        )
    )


@pytest.mark.parametrize(
    "footer, message",
    [
        (b"{not json", "corrupt footer: not JSON"),
        (b"[1, 2]", r"corrupt footer: footer=\[1, 2\] is invalid: it must be an object"),
        (b"\xff\xfe", "corrupt footer: not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "corrupt footer: not JSON"),
    ],
)
def test_a_re_signed_footer_that_is_not_ours(saved, target, tmp_path, footer, message):
    body, _, _ = _split(saved)
    (tmp_path / "edited.tm").write_bytes(_join(body, footer))
    _refused(target, tmp_path / "edited.tm", StoreError, message)


def test_a_footer_length_past_the_file(saved, target, tmp_path):
    data = bytearray(saved)
    data[-len(checkpoint.MAGIC) - _TAIL.size : -len(checkpoint.MAGIC) - 8] = struct.pack("<Q", 2**63)
    (tmp_path / "edited.tm").write_bytes(bytes(data))
    _refused(target, tmp_path / "edited.tm", StoreError, "corrupt footer length")


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_an_older_format_still_loads_and_is_still_checked(saved, tmp_path, version):
    magic = {"v1": checkpoint.MAGIC_V1, "v2": checkpoint.MAGIC_V2}[version]
    (tmp_path / "old.tm").write_bytes(_as_old(saved, magic))
    (tmp_path / "v3.tm").write_bytes(saved)
    a, b = _model(steps=0), _model(steps=0)
    a.load(str(tmp_path / "old.tm"))
    b.load(str(tmp_path / "v3.tm"))
    assert same_state(a.state_dict(), b.state_dict()) and a.stepper.steps == b.stepper.steps == 2
    assert a.stepper.param_steps() == b.stepper.param_steps() and a.optimizer.param_groups[0]["lr"] == 1e-2
    old = bytearray(_as_old(saved, magic))  # a flipped data byte fails the tensor's CRC-32
    body, doc, _ = _split(saved)
    e = _entry(doc, _W)
    old[e["offset"] + 5] ^= 0x10
    (tmp_path / "old-flipped.tm").write_bytes(bytes(old))
    _refused(a, tmp_path / "old-flipped.tm", StoreError, r"'master/wte\.weight' fails its checksum")
    if version == "v1":  # no footer checksum: the size check finds this edit
        _dtype_float64(doc)
        (tmp_path / "v1-edited.tm").write_bytes(_as_old(_join(body, json.dumps(doc).encode()), magic))
        _refused(a, tmp_path / "v1-edited.tm", *CORRUPT[:1], r"\.nbytes=3552 is invalid: it must be 7104")


# -- precision ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "saved_at, loaded_at, scale",
    [
        ("fp32", "fp16", 2.0**16),  # the run's scale, not fp32's 1.0
        ("bf16", "fp16", 2.0**16),
        ("fp16", "fp32", 1.0),  # no loss scaling at fp32, whatever fp16 had reached
        ("fp16", "fp16", 2.0**15),  # the checkpoint's own
    ],
)
def test_the_loss_scale_is_taken_only_from_a_checkpoint_of_the_same_precision(tmp_path, saved_at, loaded_at, scale):
    src = _model(saved_at)
    src.scaler.scale = 2.0**15 if saved_at == "fp16" else 1.0
    src.save(str(tmp_path / "c.tm"))
    dst = _model(loaded_at, steps=0)
    dst.load(str(tmp_path / "c.tm"))
    assert dst.scaler.scale == scale and dst.stepper.steps == src.stepper.steps
    assert same_state(dst.state_dict(), src.state_dict())  # master weights are fp32 at every precision
    x, y = gpt_batch(9)
    dst.backward(gpt_loss(dst(x), y))
    result = dst.step()  # trains on: skipped if fp16's scale overflowed, as with GradScaler
    assert result.step == src.stepper.steps + (not result.skipped)


@pytest.mark.parametrize("saved_at, loaded_at", [("bf16", "fp32"), ("fp32", "bf16"), ("fp16", "bf16")])
def test_buffers_of_another_precision_load(tmp_path, saved_at, loaded_at):
    torch.manual_seed(1)
    src = TieredModel(Quirky(), precision=saved_at)
    src.save(str(tmp_path / "c.tm"))
    torch.manual_seed(2)
    dst = TieredModel(Quirky(), precision=loaded_at)
    dst.load(str(tmp_path / "c.tm"))  # BatchNorm's statistics, saved at one precision, loaded at another
    assert torch.equal(dst.state_dict()["bn.running_var"], src.state_dict()["bn.running_var"])


@pytest.mark.parametrize(
    "buffer, dtype, held",
    [
        ("buffers/bn.running_var", "int16", "float32 or bfloat16"),
        ("buffers/bn.num_batches_tracked", "float64", "int64"),
        ("frozen/frozen.weight", "int32", "float32"),
    ],
)
def test_a_buffer_or_frozen_weight_of_another_dtype_is_refused(tmp_path, buffer, dtype, held):
    torch.manual_seed(1)
    TieredModel(Quirky(), precision="bf16").save(str(tmp_path / "c.tm"))
    body, doc, _ = _split((tmp_path / "c.tm").read_bytes())
    _entry(doc, buffer)["dtype"] = dtype  # the same size: only the model can tell
    (tmp_path / "c.tm").write_bytes(_join(body, json.dumps(doc).encode()))
    torch.manual_seed(2)
    dst = TieredModel(Quirky(), precision="bf16")
    _refused(dst, tmp_path / "c.tm", TierMemError, f"'{buffer}' is {dtype}, the model holds it as {held}")


# -- the file system ------------------------------------------------------------------------------
def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # exited and reaped: no process has this pid (until one is given it again)
    with pytest.raises(ProcessLookupError):
        os.kill(child.pid, 0)
    return child.pid


def test_a_killed_saves_temporaries_are_removed_by_the_next_save(tmp_path):
    path, victim = tmp_path / "c.tm", tmp_path / "victim"
    dead, dead_too, alive = _dead_pid(), _dead_pid(), os.getppid()
    victim.write_bytes(b"precious")
    (tmp_path / f"c.tm.tmp-{dead}").write_bytes(b"half a checkpoint")
    os.symlink(victim, tmp_path / f"c.tm.tmp-{dead_too}")  # the link goes, never its target
    kept = [
        f"c.tm.tmp-{alive}",
        f"other.tm.tmp-{dead}",
        f"xc.tm.tmp-{dead}",
        f"c.tm.tmp-{dead}.bak",
        f"c.tm.tmp-0{dead}",
        "c.tm.tmp-x",
        "c.tm.tmp-0",
        "c.tm.tmp-99999999999",
    ]
    for name in kept:
        (tmp_path / name).write_bytes(b"not ours to remove")
    _model(steps=0).save(str(path))
    assert set(os.listdir(tmp_path)) == {"c.tm", "victim", *kept}
    assert victim.read_bytes() == b"precious"
    _model(steps=0).load(str(path))


def _save_stalled_before_its_fsync(path: str, written) -> None:
    """In a child process: save a model, stopping once the checkpoint's bytes are in the temporary,
    before it is synced and renamed; ``written`` is set there."""

    def stall(fd):
        written.set()
        time.sleep(600)

    os.fsync = stall
    TieredModel(TinyGPT(), precision="fp32").save(path)


def test_a_save_killed_part_way_leaves_a_temporary_that_the_next_save_removes(tmp_path):
    path = tmp_path / "c.tm"
    ctx = forked.context()  # forked: a fresh process imports torch again (~5 CPU s)
    written = ctx.Event()
    child = ctx.Process(target=_save_stalled_before_its_fsync, args=(str(path), written))
    child.start()
    try:
        assert written.wait(120), "the child's save wrote nothing within 120 s"
    finally:
        child.kill()  # SIGKILL: no handler, no cleanup
        child.join()
    assert os.listdir(tmp_path) == [f"c.tm.tmp-{child.pid}"]
    tm = _model()
    tm.save(str(path))
    assert os.listdir(tmp_path) == ["c.tm"]
    fresh = _model(steps=0)
    fresh.load(str(path))
    assert same_state(fresh.state_dict(), tm.state_dict())


def test_a_dead_pids_directory_at_a_temporary_name_is_left(tmp_path):
    dead = _dead_pid()
    (tmp_path / f"c.tm.tmp-{dead}").mkdir()
    _model(steps=0).save(str(tmp_path / "c.tm"))
    assert sorted(os.listdir(tmp_path)) == ["c.tm", f"c.tm.tmp-{dead}"]


def test_a_symlink_at_the_temporary_name_is_refused_and_its_target_untouched(tmp_path):
    path, victim = tmp_path / "c.tm", tmp_path / "victim"
    tm = _model(steps=0)
    tm.save(str(path))
    before = path.read_bytes()
    victim.write_bytes(b"precious")
    os.symlink(victim, f"{path}.tmp-{os.getpid()}")  # this process's own name: never removed, never followed
    with pytest.raises(
        StoreError,
        match=r"^tiermem: cannot save .* its temporary .*tmp-\d+' already exists .*"
        r"remove it and save again$",
    ):
        tm.save(str(path))
    assert victim.read_bytes() == b"precious" and path.read_bytes() == before
    assert os.path.islink(f"{path}.tmp-{os.getpid()}")  # left for the user to look at
    os.symlink(tmp_path / "nowhere", tmp_path / f"d.tm.tmp-{os.getpid()}")  # a dangling link: refused alike
    with pytest.raises(StoreError, match="already exists"):
        tm.save(str(tmp_path / "d.tm"))
    assert not os.path.lexists(tmp_path / "nowhere") and not os.path.lexists(tmp_path / "d.tm")


def test_a_symlink_at_the_checkpoint_is_replaced_not_written_through(tmp_path):
    path, victim = tmp_path / "c.tm", tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, path)
    _model(steps=0).save(str(path))
    assert victim.read_bytes() == b"precious"
    assert not os.path.islink(path) and path.read_bytes().startswith(checkpoint.MAGIC)


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_the_checkpoint_is_private_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        _model(steps=0).save(str(tmp_path / "c.tm"))
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "c.tm").st_mode & 0o777 == 0o600


def test_loading_a_directory_or_a_fifo_is_a_tiermem_error(tmp_path, target):
    _refused(target, tmp_path, StoreError, r"^tiermem: .* is a directory, not a checkpoint; pass the file path")
    os.mkfifo(tmp_path / "fifo")
    _refused(target, tmp_path / "fifo", StoreError, r"is not a regular file, not a checkpoint")
