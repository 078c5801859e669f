"""torch.distributed.checkpoint directories in one process (``tm.save(path, format="dcp")``, what
data parallelism writes by default; the ranks themselves: test_data_parallel): loads bit-exact
into other bucket sizes and placements, plain torch reads them, every byte is checked before
anything changes, a save replaces the previous checkpoint whole, and a user's own dcp.save/load
of ``tm.sharded_state_dict()`` round-trips."""

from __future__ import annotations

import functools
import math
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings, strategies as st
from models import Quirky, TinyGPT, same_state, train_steps
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tiermem import AdamW, ConfigError, PerClass, StoreError, TensorClass, Tier, TieredModel, TierMemError
from tiermem.checkpoint import directory as checkpoint_dir
from tiermem.checkpoint.shards import ShardedValue, flat_boxes

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class StateOnNvme(PerClass):
    homes = {
        TensorClass.PARAM: Tier.DEVICE,
        TensorClass.ACTIVATION: Tier.DEVICE,
        TensorClass.GRAD: Tier.HOST,
        TensorClass.OPTIM_STATE: Tier.NVME,
    }


def _model(
    steps: int = 2,
    *,
    policy=None,
    nvme=None,
    bucket: int = 2000,
    seed: int = 0,
    module=TinyGPT,
    precision: str = "fp32",
) -> TieredModel:
    torch.manual_seed(seed)
    tm = TieredModel(
        module(),
        policy,
        optimizer=AdamW(lr=1e-2, weight_decay=0.1),
        precision=precision,
        bucket_size=bucket,
        nvme_dir=None if nvme is None else str(nvme),
    )
    if module is TinyGPT:
        train_steps(tm, steps)
    return tm


def _contents(path, tmp_path) -> dict:
    """Everything a DCP directory holds, read by torch alone."""
    out = tmp_path / f"contents-{len(os.listdir(tmp_path))}.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


def _same_tree(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


# -- the representation (NOTE [Sharded values for DCP]) ---------------------------------------------
@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5), max_size=4), st.data())
def test_a_flat_range_becomes_boxes_that_cover_it_exactly_in_order(shape, data):
    n = math.prod(shape)
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    full = torch.arange(n).view(shape)
    got = []
    boxes = flat_boxes(tuple(shape), lo, hi)
    for offsets, sizes, start in boxes:
        piece = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
        assert piece.tolist() == list(range(start, start + piece.numel()))  # contiguous: a view of the flat piece
        got += piece.tolist()
    assert got == list(range(lo, hi))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_a_sharded_value_runs_no_op_but_says_what_it_holds():
    v = ShardedValue("model.w", (3, 4), 2, 9, torch.arange(7.0))
    assert v.shape == (3, 4) and v.local_range == (2, 9) and torch.equal(v.local(), torch.arange(7.0))
    with pytest.raises(
        TierMemError,
        match=r"^tiermem: 'model\.w' is a ShardedValue .* elements \[2, 9\) of 12, "
        r"so .* cannot run on it; use \.local\(\)",
    ):
        v + 1
    assert "elements [2, 9)" in repr(v)


# -- round trips ------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, bucket", [(None, 1700), (StateOnNvme(), 900)], ids=["host", "nvme"])
def test_loads_bit_exact_into_another_bucket_size_and_placement(tmp_path, policy, bucket):
    src = _model()
    src.save(str(tmp_path / "ck"), format="dcp")
    assert sorted(os.listdir(tmp_path / "ck")) == [".metadata", "__0_0.distcp", "tiermem-rank0.json"]
    (tmp_path / "nvme").mkdir()
    dst = _model(0, policy=policy, nvme=tmp_path / "nvme", bucket=bucket, seed=5)
    dst.load(str(tmp_path / "ck"))
    assert same_state(dst.state_dict(), src.state_dict()) and dst.stepper.param_steps() == src.stepper.param_steps()
    dst.save(str(tmp_path / "again"), format="dcp")  # moments, step counts and all
    assert _same_tree(_contents(tmp_path / "again", tmp_path), _contents(tmp_path / "ck", tmp_path))
    train_steps(src, 1, offset=2)
    train_steps(dst, 1, offset=2)
    assert same_state(dst.state_dict(), src.state_dict())


def test_plain_torch_reads_the_weights_with_their_shapes(tmp_path):
    src = _model()
    src.save(str(tmp_path / "ck"), format="dcp")
    plain = TinyGPT()
    sd = plain.state_dict()
    dcp.load({"model": sd}, checkpoint_id=str(tmp_path / "ck"), planner=DefaultLoadPlanner(allow_partial_load=True))
    plain.load_state_dict(sd)  # the tied head is stored once, as wte.weight
    assert same_state(plain.state_dict(), src.state_dict())
    whole = _contents(tmp_path / "ck", tmp_path)
    assert whole["optim"]["state"]["wte.weight"]["exp_avg"].shape == (37, 24)
    assert whole["optim"]["state"]["wte.weight"]["exp_avg_sq"].min() > 0


def test_frozen_weights_and_buffers_come_back(tmp_path):
    torch.manual_seed(1)
    src = TieredModel(Quirky(), precision="bf16")
    x = torch.randn(8, 13)
    src.backward(src(x)[0].float().sum())
    src.step()
    src.save(str(tmp_path / "ck"), format="dcp")
    torch.manual_seed(2)
    dst = TieredModel(Quirky(), precision="bf16")
    dst.load(str(tmp_path / "ck"))
    assert same_state(dst.state_dict(), src.state_dict())  # BatchNorm's statistics and the frozen layer too


def test_state_on_nvme_is_read_once_per_save_and_no_bucket_more_held(tmp_path):
    (tmp_path / "nvme").mkdir()
    tm = _model(policy=StateOnNvme(), nvme=tmp_path / "nvme", bucket=900)
    state_bytes = 12 * tm.layout.n_params
    tm.save(str(tmp_path / "first"), format="dcp")  # the step's read-ahead of its next bucket lands first
    before = tm.report()
    tm.save(str(tmp_path / "ck"), format="dcp")
    after = tm.report()
    read = after.bytes_moved[(Tier.NVME, Tier.HOST)] - before.bytes_moved.get((Tier.NVME, Tier.HOST), 0)
    assert read == state_bytes  # bucket by bucket in order: each bucket's state read once
    key = (TensorClass.OPTIM_STATE, Tier.HOST)
    assert after.class_peak_bytes[key] == before.class_peak_bytes[key]  # through the home's own buffers
    tm.load(str(tmp_path / "ck"))
    assert tm.report().class_peak_bytes[key] == before.class_peak_bytes[key]


# -- a user's own dcp.save / dcp.load ------------------------------------------------------------
def test_a_users_dcp_save_is_refused_by_tm_load_and_read_by_the_users_dcp_load(tmp_path):
    src = _model()
    dcp.save(src.sharded_state_dict(), checkpoint_id=str(tmp_path / "user"))
    dst = _model(0, bucket=1300, seed=3)
    before = dst.state_dict()
    with pytest.raises(StoreError, match=r"has no tiermem manifest .* tm\.load\(\) refuses it; nothing was loaded"):
        dst.load(str(tmp_path / "user"))  # its bytes cannot be checked (NOTE [Nothing in a checkpoint runs])
    assert same_state(dst.state_dict(), before)
    sd = dst.sharded_state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "user"))
    dst.load_sharded_state_dict(sd)
    assert same_state(dst.state_dict(), src.state_dict()) and dst.stepper.steps == 2


@pytest.mark.parametrize("policy", [None, StateOnNvme()], ids=["host", "nvme"])
def test_a_users_dcp_load_into_the_sharded_state_dict_round_trips(tmp_path, policy):
    src = _model()
    src.save(str(tmp_path / "ck"), format="dcp")
    (tmp_path / "nvme").mkdir()
    dst = _model(0, policy=policy, nvme=tmp_path / "nvme", bucket=1300, seed=3)
    sd = dst.sharded_state_dict()
    local = sd["optim"]["state"]["wte.weight"]["exp_avg"].local()
    b, _ = dst.layout.slot_of[id(dst.module.wte.weight)]
    live = dst.layout.homes.state[b.index].read_local(b)[1]
    aliases = local.untyped_storage().data_ptr() == live.untyped_storage().data_ptr()
    assert aliases == (policy is None)  # in memory a view of the live state; from NVMe a copy
    dcp.load(sd, checkpoint_id=str(tmp_path / "ck"))
    dst.load_sharded_state_dict(sd)
    assert same_state(dst.state_dict(), src.state_dict()) and dst.stepper.steps == 2
    train_steps(src, 1, offset=2)
    train_steps(dst, 1, offset=2)
    assert same_state(dst.state_dict(), src.state_dict())


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda sd: sd.pop("tiermem"), r"with keys \['model', 'optim'\]"),
        (lambda sd: sd.update(tiermem="{"), r"'tiermem' entry is not tiermem's JSON"),
        (lambda sd: sd["model"].pop("ln_f.bias"), r"it has no 'model\.ln_f\.bias'"),
        (
            lambda sd: sd["model"].update({"ln_f.bias": torch.zeros(24)}),
            r"'model\.ln_f\.bias' is not this process's "
            r"ShardedValue",
        ),
    ],
)
def test_load_sharded_state_dict_refuses_what_it_did_not_give(edit, message):
    tm = _model()
    before = (tm.state_dict(), tm.stepper.steps)
    sd = tm.sharded_state_dict()
    edit(sd)
    with pytest.raises(ConfigError, match=message):
        tm.load_sharded_state_dict(sd)
    assert same_state(tm.state_dict(), before[0]) and tm.stepper.steps == before[1]


# -- nothing read back unchecked (NOTE [Checkpoint directories]) ------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("dcp") / "ck"
    _model().save(str(path), format="dcp")
    return path


def _flip(path, at: int = 200) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))


def _evil_metadata(path) -> None:
    """A pickle that would create a file when unpickled."""

    class Evil:
        def __reduce__(self):
            return (open, (str(path.parent / "pwned"), "w"))

    (path / ".metadata").write_bytes(pickle.dumps(Evil()))


def _second_manifest(path) -> None:
    shutil.copy(path / "tiermem-rank0.json", path / "tiermem-rank1.json")


DAMAGE = {
    "flipped data byte": (lambda p: _flip(p / "__0_0.distcp"), StoreError, r"'__0_0\.distcp' fails its checksum\)"),
    "truncated data": (
        lambda p: os.truncate(p / "__0_0.distcp", 1000),
        StoreError,
        r"'__0_0\.distcp' fails its checksum: 1000 bytes, not \d+\)",
    ),
    "missing data": (lambda p: os.unlink(p / "__0_0.distcp"), StoreError, r"incomplete: cannot read '__0_0\.distcp'"),
    "flipped metadata byte": (lambda p: _flip(p / ".metadata", 50), StoreError, r"'\.metadata' fails its checksum"),
    "hostile metadata": (_evil_metadata, StoreError, r"'\.metadata' fails its checksum"),
    "edited manifest": (
        lambda p: _flip(p / "tiermem-rank0.json", 30),
        StoreError,
        r"unreadable manifest 'tiermem-rank0\.json' \(it fails its checksum\)",
    ),
    "lost manifest": (
        lambda p: os.unlink(p / "tiermem-rank0.json"),
        StoreError,
        r"has no tiermem manifest",
    ),
    "another save's manifest": (
        _second_manifest,
        StoreError,
        r"a manifest 'tiermem-rank1\.json' of another format, "
        r"rank or world",
    ),
}


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_damage_is_found_before_anything_changes(saved, tmp_path, name):
    damage, error, message = DAMAGE[name]
    path = tmp_path / "ck"
    shutil.copytree(saved, path)
    damage(path)
    target = _model(1, seed=4)
    before = (target.state_dict(), target.stepper.steps, target.stepper.param_steps())
    with pytest.raises(error, match=message) as info:
        target.load(str(path))
    assert str(info.value).startswith("tiermem:") and "nothing was loaded" in str(info.value)
    assert (
        same_state(target.state_dict(), before[0])
        and (target.stepper.steps, target.stepper.param_steps()) == before[1:]
    )
    assert not (tmp_path / "pwned").exists()  # never unpickled


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: TieredModel(TinyGPT(d=16), optimizer=AdamW(lr=1e-2)),
            r"'model\.[\w.]+' has shape \((37, )?24,?\), "
            r"the model has \((37, )?16,?\)",
        ),
        (lambda: TieredModel(TinyGPT(n_layer=1), optimizer=AdamW(lr=1e-2)), r"unexpected \['model\.blocks\.1\."),
        (
            lambda: TieredModel(TinyGPT(), optimizer=AdamW(lr=1e-2, no_decay_1d=True)),
            r"has 1 param groups, this model 2",
        ),
    ],
)
def test_a_checkpoint_of_another_model_is_refused(saved, make, message):
    tm = make()
    before = tm.state_dict()
    with pytest.raises(TierMemError, match=message):
        tm.load(str(saved))
    assert same_state(tm.state_dict(), before)


# -- the directory as a whole ---------------------------------------------------------------------
def test_a_save_replaces_a_checkpoint_a_file_or_a_symlink_whole(tmp_path):
    tm = _model()
    path = tmp_path / "ck"
    tm.save(str(path))  # a single file first
    tm.save(str(path), format="dcp")
    train_steps(tm, 1, offset=2)
    tm.save(str(path), format="dcp")  # over the previous directory
    assert os.listdir(tmp_path) == ["ck"]
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("precious")
    os.symlink(victim, tmp_path / "link")
    tm.save(str(tmp_path / "link"), format="dcp")  # the link is replaced, never followed
    assert os.listdir(victim) == ["keep"] and not os.path.islink(tmp_path / "link")
    fresh = _model(0, seed=9)
    fresh.load(str(path))
    assert same_state(fresh.state_dict(), tm.state_dict()) and fresh.stepper.steps == 3


def test_a_directory_that_is_not_a_checkpoint_is_refused_untouched(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match=r"it is a directory holding \['notes\.txt'\], not a checkpoint"):
        _model(0).save(str(tmp_path / "ck"), format="dcp")
    assert sorted(os.listdir(tmp_path)) == ["ck"] and os.listdir(tmp_path / "ck") == ["notes.txt"]


def test_a_failed_save_keeps_the_previous_checkpoint_and_leaves_no_debris(tmp_path, monkeypatch):
    tm = _model()
    path = tmp_path / "ck"
    tm.save(str(path), format="dcp")
    before = _contents(path, tmp_path)
    train_steps(tm, 1, offset=2)

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_dir, "write_manifest", disk_full)
    with pytest.raises(
        StoreError,
        match=r"saving the checkpoint to .* failed \(No space left on device\); free "
        r"space or choose another path. Any previous checkpoint there is unchanged",
    ):
        tm.save(str(path), format="dcp")
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith("contents")) == ["ck"]
    assert _same_tree(_contents(path, tmp_path), before)


def _dead_pid() -> int:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def test_a_dead_saves_temporary_directory_is_removed_and_a_live_ones_kept(tmp_path):
    dead = _dead_pid()
    stale, live = tmp_path / f"ck.tmp-{dead}", tmp_path / f"ck.tmp-{os.getppid()}"
    for d in (stale, live):
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"half")
    _model(0).save(str(tmp_path / "ck"), format="dcp")
    assert sorted(os.listdir(tmp_path)) == ["ck", live.name]


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_every_file_is_private_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        _model(0).save(str(tmp_path / "ck"), format="dcp")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "ck").st_mode & 0o777 == 0o700
    assert {os.stat(p).st_mode & 0o777 for p in (tmp_path / "ck").iterdir()} == {0o600}


def test_an_unknown_format_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^tiermem: format='zip' is not a checkpoint format; pass 'file'"):
        _model(0).save(str(tmp_path / "ck"), format="zip")
    assert os.listdir(tmp_path) == []


def test_a_frozen_base_is_read_one_parameter_at_a_time_by_a_dcp_save(tmp_path, monkeypatch):
    """Rank 0's frozen parameters reach DCP's writer one at a time, each read from its home when
    written: a frozen base on NVMe never passes through host memory whole."""
    import gc
    import weakref

    from tiermem.policies import ZeroInfinity
    from tiermem.train.weights.frozen import FrozenParams

    torch.manual_seed(4)
    module = torch.nn.Sequential(*(torch.nn.Linear(40, 40) for _ in range(5)))
    for layer in list(module)[:4]:
        layer.requires_grad_(False)
    (tmp_path / "nvme").mkdir()
    tm = TieredModel(module, ZeroInfinity(), precision="bf16", nvme_dir=str(tmp_path / "nvme"))
    live: list[weakref.ref] = []
    most = []
    value = FrozenParams.value

    def counted(self, name, **kw):
        gc.collect()
        most.append(sum(r() is not None for r in live))
        out = value(self, name, **kw)
        live.append(weakref.ref(out))
        return out

    monkeypatch.setattr(FrozenParams, "value", counted)
    tm.save(str(tmp_path / "ck"), format="dcp")
    monkeypatch.undo()
    assert len(most) == 8 and max(most) == 0  # 4 weights and 4 biases, none held when the next is read
    before = tm.state_dict()
    tm.load(str(tmp_path / "ck"))  # what was written comes back whole
    assert same_state(tm.state_dict(), before)


# -- NOTE [Streamed sharded values] ----------------------------------------------------------------
def _on_nvme(tmp_path, seed: int = 4, steps: int = 1) -> TieredModel:
    """Three frozen layers and three trained ones, each its own bucket, all homed on NVMe."""
    from tiermem.policies import ZeroInfinity

    torch.manual_seed(seed)
    module = torch.nn.Sequential(*(torch.nn.Linear(40, 40) for _ in range(6)))
    for layer in list(module)[:3]:
        layer.requires_grad_(False)
    nvme = tmp_path / f"nvme{seed}"
    nvme.mkdir()
    tm = TieredModel(module, ZeroInfinity(), precision="bf16", bucket_size=1700, nvme_dir=str(nvme))
    for i in range(steps):
        x = torch.randn(8, 40, generator=torch.Generator().manual_seed(i))
        tm.backward(tm(x).float().square().mean())
        tm.step()
    return tm


def _nvme_read(tm) -> int:
    return tm.report().bytes_moved.get((Tier.NVME, Tier.HOST), 0)


def test_a_sharded_state_dict_of_state_off_memory_reads_nothing_until_dcp_asks(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from tiermem.train.weights.frozen import FrozenParams

    tm = _on_nvme(tmp_path)
    tm.save(str(tmp_path / "first"), format="dcp")  # the step's read-ahead of its next bucket lands first
    read, frozen_reads = _nvme_read(tm), []
    value = FrozenParams.value
    monkeypatch.setattr(FrozenParams, "value", lambda self, n, **kw: frozen_reads.append(n) or value(self, n, **kw))
    sd = tm.sharded_state_dict()
    assert _nvme_read(tm) == read and frozen_reads == []  # nothing read, nothing held
    streamed = [v for v in [*sd["model"].values(), *(p for s in sd["optim"]["state"].values() for p in s.values())]]
    assert len(streamed) == 12 + 6 * 2 and not any(v.filled for v in streamed)

    key = (TensorClass.OPTIM_STATE, Tier.HOST)
    peak = tm.report().class_peak_bytes[key]
    dcp.save(sd, checkpoint_id=str(tmp_path / "ck"))
    assert tm.report().class_peak_bytes[key] == peak  # read through the home's own buffers
    state = 12 * sum(p.numel() for p in tm.module.parameters() if p.requires_grad)
    assert _nvme_read(tm) - read == 2 * state  # the weights' pass, the moments' pass (the report counts no copies)
    assert sorted(frozen_reads) == sorted(n for n, p in tm.module.named_parameters() if not p.requires_grad)
    whole = MetadataIndex("", torch.Size([0, 0]))
    box = sd["model"]["5.weight"].__get_tensor_shard__(whole)
    sd["model"]["4.weight"].__get_tensor_shard__(whole)  # another bucket, read into the same buffers
    assert torch.equal(box, tm.state_dict()["5.weight"])  # a box a writer kept owns its bytes

    dst = _on_nvme(tmp_path, seed=5, steps=0)
    sd = dst.sharded_state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "ck"))
    assert all(v.filled for v in sd["model"].values())
    dst.load_sharded_state_dict(sd)
    assert same_state(dst.state_dict(), tm.state_dict()) and dst.stepper.steps == 1
    assert not any(v.filled for v in sd["model"].values())  # what dcp.load filled went home, and was dropped


def test_a_streamed_value_not_filled_by_dcp_load_is_refused_by_load_sharded_state_dict(tmp_path):
    tm = _on_nvme(tmp_path)
    before = tm.state_dict()
    with pytest.raises(ConfigError, match=r"'model\.5\.bias' was not filled by a dcp\.load .* nothing was loaded"):
        tm.load_sharded_state_dict(tm.sharded_state_dict())
    assert same_state(tm.state_dict(), before) and tm.stepper.steps == 1


@pytest.mark.parametrize("where", ["memory", "nvme"])
def test_a_sharded_state_dict_taken_before_a_step_is_not_saved_after_it(tmp_path, where):
    """Its step counts are the call's: the next step's state beside them would be a checkpoint of
    no step, whether the values are views of the live state or read from home."""
    make = (
        (lambda seed, steps: _model(steps, seed=seed)) if where == "memory" else functools.partial(_on_nvme, tmp_path)
    )
    tm = make(4, 1)
    sd = tm.sharded_state_dict()
    if where == "memory":
        train_steps(tm, 1, offset=1)
    else:
        tm.backward(tm(torch.randn(8, 40)).float().square().mean())
        tm.step()
    with pytest.raises(
        BaseException, match=r"taken at step 1, and the model has stepped since.*again just before dcp\.save"
    ):
        dcp.save(sd, checkpoint_id=str(tmp_path / "ck"))
    dcp.save(tm.sharded_state_dict(), checkpoint_id=str(tmp_path / "ck2"))
    dst = make(5, 0)
    sd = dst.sharded_state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "ck2"))
    dst.load_sharded_state_dict(sd)
    assert same_state(dst.state_dict(), tm.state_dict()) and dst.stepper.steps == 2


def test_a_sharded_state_dict_taken_before_a_load_is_not_saved_after_it(tmp_path):
    tm = _on_nvme(tmp_path)
    tm.save(str(tmp_path / "first"), format="dcp")
    sd = tm.sharded_state_dict()
    tm.load(str(tmp_path / "first"))  # the same step count, other state (in general)
    with pytest.raises(BaseException, match=r"taken at step 1, and the model has loaded a checkpoint since"):
        dcp.save(sd, checkpoint_id=str(tmp_path / "ck"))


def test_a_dict_a_dcp_load_filled_is_not_saved_before_the_model_takes_it(tmp_path):
    """Its streamed values hold the loaded state, its views the model's own: a save would mix them."""
    src = _on_nvme(tmp_path)
    dcp.save(src.sharded_state_dict(), checkpoint_id=str(tmp_path / "ck"))
    dst = _on_nvme(tmp_path, seed=5, steps=0)
    sd = dst.sharded_state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "ck"))
    with pytest.raises(BaseException, match=r"holds what a dcp\.load filled in.*tm\.load_sharded_state_dict\(\)"):
        dcp.save(sd, checkpoint_id=str(tmp_path / "again"))
    dst.load_sharded_state_dict(sd)
    assert same_state(dst.state_dict(), src.state_dict())


def test_a_partial_dcp_load_leaves_values_unfilled_and_is_refused(tmp_path):
    src = _on_nvme(tmp_path)
    dcp.save({"model": src.sharded_state_dict()["model"]}, checkpoint_id=str(tmp_path / "weights"))
    dst = _on_nvme(tmp_path, seed=5, steps=0)
    before = dst.state_dict()
    sd = dst.sharded_state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "weights"), planner=DefaultLoadPlanner(allow_partial_load=True))
    with pytest.raises(ConfigError, match=r"'optim\.state\.\d\.\w+\.exp_avg' was not filled by a dcp\.load"):
        dst.load_sharded_state_dict(sd)
    assert same_state(dst.state_dict(), before)


def test_a_writer_resolving_from_two_threads_saves_every_bucket_right(tmp_path):
    from torch.distributed.checkpoint import FileSystemWriter

    tm = _on_nvme(tmp_path, steps=2)
    path = str(tmp_path / "ck")
    dcp.save(tm.sharded_state_dict(), storage_writer=FileSystemWriter(path, thread_count=2, single_file_per_rank=False))
    dst = _on_nvme(tmp_path, seed=5, steps=0)
    sd = dst.sharded_state_dict()
    dcp.load(sd, checkpoint_id=path)
    dst.load_sharded_state_dict(sd)
    assert same_state(dst.state_dict(), tm.state_dict())


def test_frozen_values_in_host_memory_are_handed_over_as_views(tmp_path):
    """An fp32 base trained in bf16 keeps its fp32 copy in host memory: the dict's value is that
    copy, not a copy of it (a save through torch's writer would hold a second base)."""

    def make(seed: int) -> TieredModel:
        torch.manual_seed(seed)
        module = torch.nn.Sequential(*(torch.nn.Linear(40, 40) for _ in range(3)))
        module[0].requires_grad_(False)
        return TieredModel(module, None, precision="bf16", bucket_size=1700)

    tm = make(4)
    sd = tm.sharded_state_dict()
    value = sd["model"]["0.weight"]
    live = tm.layout.frozen.live("0.weight")
    assert value.filled and value.dtype == torch.float32 and live is not None
    assert value.local().data_ptr() == live.data_ptr()
    dcp.save(sd, checkpoint_id=str(tmp_path / "ck"))
    other = make(5)
    sd = other.sharded_state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "ck"))
    other.load_sharded_state_dict(sd)
    assert same_state(other.state_dict(), tm.state_dict())


def test_a_sharded_state_dict_taken_before_the_trainable_set_changed_is_not_saved_after_it(tmp_path):
    tm = _on_nvme(tmp_path)
    sd = tm.sharded_state_dict()
    tm.module[5].requires_grad_(False)  # taken at the next backward
    tm.backward(tm(torch.randn(8, 40)).float().square().mean())
    with pytest.raises(BaseException, match=r"taken at step 1, and the model has frozen or unfrozen parameters since"):
        dcp.save(sd, checkpoint_id=str(tmp_path / "ck"))
