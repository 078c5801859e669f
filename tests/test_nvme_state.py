"""Optimizer state on NVMe: same numbers as in memory, bounded host memory, atomic steps, resume."""

from __future__ import annotations

import collections
import errno
import os
import signal
import subprocess

import forked
import pytest
import torch
from models import (
    TinyGPT,
    forward_at,
    gpt_batch,
    gpt_loss,
    same_state,
    train_steps as _train,
)  # _train: test_param_offload imports it

from tiermem import AdamW, Budgets, StoreError, TensorClass, Tier, TieredModel, TierMemError
from tiermem.plan.policy import Policy
from tiermem.policies import ZeroInfinity, ZeroOffload


class StateOnNvme(Policy):
    """ZeRO-Offload, but the optimizer state of every parameter (or of those matching a prefix)
    lives on NVMe."""

    def __init__(self, prefix: str = ""):
        self.prefix = prefix

    def place(self, info):
        if info.kind is TensorClass.OPTIM_STATE and info.name.startswith(self.prefix):
            return Tier.NVME
        return ZeroOffload().place(info)


def _make(policy, tmp_path, precision="bf16", bucket=2000, n_layer=2, **kw):
    torch.manual_seed(11)
    return TieredModel(
        TinyGPT(n_layer=n_layer),
        policy,
        optimizer=AdamW(lr=1e-2, weight_decay=0.1),
        precision=precision,
        grad_clip=1.0,
        bucket_size=bucket,
        nvme_dir=str(tmp_path) if tmp_path else None,
        **kw,
    )


def _trains_like(tm, ref, steps):
    """``tm`` and ``ref`` give the same losses and bit-identical weights over ``steps``; the report."""
    assert _train(tm, steps) == _train(ref, steps)
    assert same_state(tm.state_dict(), ref.state_dict())
    return tm.report()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("policy", [StateOnNvme(), StateOnNvme(prefix="blocks.1.")], ids=["all", "some"])
def test_state_on_nvme_gives_identical_numbers(tmp_path, precision, policy):
    ref = _make(ZeroOffload(), None, precision)
    rep = _trains_like(_make(policy, tmp_path, precision), ref, 5)
    assert rep.class_peak_bytes[(TensorClass.OPTIM_STATE, Tier.NVME)] > 0
    assert rep.bytes_moved[(Tier.NVME, Tier.HOST)] > 0 and rep.bytes_moved[(Tier.HOST, Tier.NVME)] > 0


def test_host_memory_is_bounded_whatever_the_bucket_count(tmp_path):
    peaks = []
    for n_layer in (1, 4):
        d = tmp_path / f"l{n_layer}"
        d.mkdir()
        tm = _make(StateOnNvme(), d, n_layer=n_layer, bucket=4000)
        _train(tm, 2)
        peaks.append((len(tm.layout.buckets), tm.report().class_peak_bytes[(TensorClass.OPTIM_STATE, Tier.HOST)]))
    (few, host_few), (many, host_many) = peaks
    assert many > few + 5
    assert host_many == host_few  # three buffer sets of the largest bucket, however many buckets


class _WritesFail:
    """Within ``with``, the store's writes for which :meth:`fails` says so raise ``OSError(code)``;
    the others go through."""

    code = errno.EIO

    def __init__(self, store):
        self.store = store

    def fails(self, fd: int) -> bool:
        raise NotImplementedError

    def __enter__(self):
        real = self.real = self.store._pwritev

        def write(fd, bufs, offset):
            if self.fails(fd):
                raise OSError(self.code, os.strerror(self.code))
            return real(fd, bufs, offset)

        self.store._pwritev = write
        return self

    def __exit__(self, *exc):
        self.store._pwritev = self.real


class _disk_fails(_WritesFail):
    """Within ``with _disk_fails(store, after=n, code=errno.EIO):`` the store's writes fail with
    ``code`` once ``n`` write calls have gone through."""

    def __init__(self, store, after: int, code: int):
        super().__init__(store)
        self.after, self.code, self.calls = after, code, 0

    def fails(self, fd: int) -> bool:
        self.calls += 1
        return self.calls > self.after


class _files_fail(_WritesFail):
    """Within ``with _files_fail(store, prefixes):`` the store's writes to the files whose names
    start with one of ``prefixes`` (a key's file is named after it: ``bucket0:state`` ->
    ``bucket0_state.<hash>...``; ``""``: every file) fail with EIO, whatever the order the I/O
    threads run them in."""

    def __init__(self, store, prefixes: tuple[str, ...]):
        super().__init__(store)
        self.prefixes = prefixes

    def fails(self, fd: int) -> bool:
        return os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(self.prefixes)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
@pytest.mark.parametrize("after", [1, 4, 9])
def test_failed_step_is_completed_by_a_retry_bit_for_bit(tmp_path, code, after):
    """NOTE [A failed step is rolled forward]: a write that fails mid-step leaves every parameter
    with its state from before the step or from after it (never torn, never a mix within a
    bucket); the retry equals the uninterrupted run bit for bit, device weights included."""
    ref = _make(StateOnNvme(), tmp_path / "ref" if (tmp_path / "ref").mkdir() is None else None)
    tm = _make(StateOnNvme(), tmp_path / "tm" if (tmp_path / "tm").mkdir() is None else None)
    _train(ref, 2)
    _train(tm, 2)
    x, y = gpt_batch(2)
    tm.backward(gpt_loss(tm(x), y))
    before = tm.state_dict()
    with _disk_fails(tm.stores[Tier.NVME], after=after, code=code):
        with pytest.raises(StoreError, match=os.strerror(code)):
            tm.step()
    try:
        shown = tm.state_dict()
    except TierMemError as e:
        assert str(e).startswith("tiermem: tm.state_dict() would use weights of two steps"), e
        shown = None
    after_fail = held(tm)
    assert (shown is None) is not same_state(after_fail, before)  # refused exactly when part of the step landed
    _train(ref, 1, offset=2)
    stepped = ref.state_dict()
    assert all(torch.equal(after_fail[k], before[k]) or torch.equal(after_fail[k], stepped[k]) for k in before)
    assert not same_state(after_fail, stepped)  # the failure did stop part of the step
    tm.step()  # retry: the grads of the buckets that had not landed were kept
    assert same_state(tm.state_dict(), stepped)
    assert all(torch.equal(p, q) for p, q in zip(tm.module.parameters(), ref.module.parameters()))
    assert _train(tm, 2, offset=3) == _train(ref, 2, offset=3)
    assert same_state(tm.state_dict(), ref.state_dict())


def held(tm) -> dict:
    """What each bucket holds, as ``tm.state_dict()`` would give it: read from the model's state
    directly, since ``tm.state_dict()`` refuses a mix of two steps."""
    tm.stepper.finish_pending()
    return tm._state.module_state()


def forward_after_failure(tm, probe, before) -> bool:
    """``tm(probe)`` just after a step failed part way, checked: the output of plain PyTorch at the
    pre-step weights ``before`` when nothing of the step moved, a ``tiermem:`` error saying to
    retry the step when some of it did (a forward would mix weights of two steps). Returns
    whether the step moved anything (read after the forward: reading the state writes a bucket kept
    in memory, NOTE [A failed step is rolled forward])."""
    try:
        with torch.no_grad():
            out = tm(probe)
    except TierMemError as e:
        out, refused = None, e
    else:
        refused = None
    moved = not same_state(held(tm), before)
    if moved:
        assert refused is not None, "a forward between a failed step and its retry ran on a mix of two steps"
        assert str(refused).startswith("tiermem:") and "tm.step()" in str(refused)
        with pytest.raises(TierMemError, match=r"^tiermem: tm\.state_dict\(\) would use weights of two steps"):
            tm.state_dict()  # nor a state dict of the mix
        path = os.path.join(os.path.dirname(tm.stores[Tier.NVME].directory), "mixed.tm")
        with pytest.raises(TierMemError, match=r"^tiermem: tm\.save\(\) would use weights of two steps.*tm\.step\(\)"):
            tm.save(path)  # a checkpoint would keep the mix for good
        assert not os.path.exists(path)
    else:
        assert refused is None, refused
        assert torch.equal(out, forward_at(before, probe, tm.device)), (
            "a failed step that moved nothing changed the weights"
        )
    return moved


EVERY_STATE = tuple(f"bucket{i}_state." for i in range(10))


def fail_then_retry(tm, ref, failing: tuple[str, ...], moves: bool) -> None:
    """``tm`` and its oracle ``ref`` train two steps; ``tm``'s third fails on the files named by
    ``failing``: the forward in between is checked (:func:`forward_after_failure`, ``moves``: whether
    part of the step landed), the retry completes the step, and ``tm`` then holds ``ref``'s weights
    after its third step and computes plain PyTorch's output at them."""
    _train(ref, 2)
    _train(tm, 2)
    x, y = gpt_batch(2)
    tm.backward(gpt_loss(tm(x), y))
    before, probe = tm.state_dict(), gpt_batch(99)[0]
    with _files_fail(tm.stores[Tier.NVME], failing):
        with pytest.raises(StoreError, match=os.strerror(errno.EIO)):
            tm.step()
    assert forward_after_failure(tm, probe, before) is moves
    tm.step()  # the retry
    _train(ref, 1, offset=2)
    stepped = ref.state_dict()
    assert same_state(tm.state_dict(), stepped)
    with torch.no_grad():
        assert torch.equal(tm(probe), forward_at(stepped, probe, tm.device))


@pytest.mark.parametrize(
    "policy,failing,moves",
    [
        ("state_on_nvme", ("",), False),  # bucket 0's new weights reached the device, its state did not
        ("state_on_nvme", ("bucket0_state.",), True),  # bucket 1 lands, bucket 0 does not
        ("zero_infinity", EVERY_STATE, False),  # new weights land on disk, no state does
        ("zero_infinity", ("bucket0_state.",), True),
    ],
    ids=["sonvme-nothing", "sonvme-part", "zinf-nothing", "zinf-part"],
)
def test_a_forward_between_a_failed_step_and_its_retry(tmp_path, policy, failing, moves):
    """What a forward computes after a step failed on NVMe: plain PyTorch at the pre-step weights
    when nothing of the step moved; refused with a ``tiermem:`` error saying to retry the step
    when part of it did; after the retry, plain PyTorch at the weights of one uninterrupted step."""
    ref = _make(ZeroOffload(), None)
    tm = _make({"state_on_nvme": StateOnNvme(), "zero_infinity": ZeroInfinity()}[policy], tmp_path)
    fail_then_retry(tm, ref, failing, moves)
    assert _train(tm, 2, offset=3) == _train(ref, 2, offset=3)


def test_a_retry_that_fails_before_updating_anything_keeps_the_first_norm(tmp_path):
    """A failed step's retry that fails too, before any bucket lands: the step is still the first
    one's to complete, with its gradient norm and clip coefficient (the grads of the buckets it
    updated are gone), so the next retry still equals the uninterrupted run bit for bit."""
    ref = _make(StateOnNvme(), tmp_path / "ref" if (tmp_path / "ref").mkdir() is None else None)
    tm = _make(StateOnNvme(), tmp_path / "tm" if (tmp_path / "tm").mkdir() is None else None)
    _train(ref, 2)
    _train(tm, 2)
    x, y = gpt_batch(2)
    tm.backward(gpt_loss(tm(x), y))
    for failing in (("bucket1_state.",), ("",)):  # bucket 0 lands; then the retry lands nothing
        with _files_fail(tm.stores[Tier.NVME], failing):
            with pytest.raises(StoreError):
                tm.step()
    tm.step()
    _train(ref, 1, offset=2)
    assert same_state(tm.state_dict(), ref.state_dict())
    assert _train(tm, 2, offset=3) == _train(ref, 2, offset=3)


def test_resume_from_nvme_state_is_bit_identical(tmp_path):
    dirs = [tmp_path / n for n in ("full", "first", "second")]
    for d in dirs:
        d.mkdir()
    full = _make(StateOnNvme(), dirs[0])
    _train(full, 6)
    first = _make(StateOnNvme(), dirs[1])
    _train(first, 3)
    path = str(tmp_path / "ckpt")
    first.save(path)
    second = _make(StateOnNvme(), dirs[2], bucket=5000)
    second.load(path)
    _train(second, 3, offset=3)
    a, b = full.state_dict(), second.state_dict()
    assert same_state(a, b)
    # a checkpoint taken with state on NVMe loads into a model with state in memory, and back
    plain = _make(ZeroOffload(), None)
    plain.load(path)
    assert all(torch.equal(first.state_dict()[k], v) for k, v in plain.state_dict().items())


def test_nvme_placement_needs_a_directory_and_room(tmp_path):
    from tiermem import ConfigError, OutOfTierMemory

    with pytest.raises(ConfigError, match="pass nvme_dir"):
        _make(StateOnNvme(), None)
    with pytest.raises(OutOfTierMemory, match=r"out of nvme memory.*optimizer state \(one value per key\)"):
        _make(StateOnNvme(), tmp_path, budgets=Budgets(nvme="10KB"))


@pytest.mark.parametrize("damage", ["header", "data"])
def test_corrupt_state_is_detected_every_retry_refuses_and_a_checkpoint_resumes(tmp_path, damage):
    """A bucket's state file damaged on disk (one value per key: nothing to fall back to): the step
    fails naming the file and saying to resume from the last checkpoint, and so does every retry,
    rather than run on anything else; loading the last checkpoint restores it bit-exact and it
    trains on."""
    (tmp_path / "tm").mkdir()
    (tmp_path / "ref").mkdir()
    tm = _make(StateOnNvme(), tmp_path / "tm")
    _train(tm, 2)
    ckpt = str(tmp_path / "ckpt")
    tm.save(ckpt)
    _train(tm, 1, offset=2)
    store = tm.stores[Tier.NVME]
    key = sorted(k for k in store.keys() if k.endswith(":state"))[-1]
    path = store._journal.keys[key].current().path
    with open(path, "r+b") as f:
        f.seek(40 if damage == "header" else 4096 + 3)  # a header byte, or a data byte
        f.write(b"\xff")
    x, y = gpt_batch(3)
    tm.backward(gpt_loss(tm(x), y))
    for _ in range(3):
        with pytest.raises(
            StoreError,
            match=rf"holding '{key}' is corrupt.*the stored value is lost.*resume from "
            rf"the last checkpoint",
        ):
            tm.step()
    tm.load(ckpt)  # writes every key again
    ref = _make(StateOnNvme(), tmp_path / "ref")
    ref.load(ckpt)
    assert same_state(tm.state_dict(), ref.state_dict())
    assert _train(tm, 2, offset=2) == _train(ref, 2, offset=2)
    assert same_state(tm.state_dict(), ref.state_dict())


@pytest.mark.parametrize("policy", ["state-on-nvme", "zero-infinity"])
@pytest.mark.parametrize("writes", [3, 11])
def test_a_run_killed_mid_step_resumes_bit_exact_from_its_checkpoint(tmp_path, policy, writes):
    """kill -9 part-way through a step's NVMe writes (one value per key: some buckets of that step
    landed, one was torn): a new run on the same directory (its lock, spares and files left as the
    killed run left them) loads the last checkpoint and trains on bit for bit like a run that was
    never killed."""
    d = tmp_path / "nvme"
    d.mkdir()
    ckpt = tmp_path / "ckpt"
    child = forked.run(_train_then_die_mid_step, policy, str(d), str(ckpt), writes)
    assert child.exitcode == -signal.SIGKILL, child.error or f"not killed (exit code {child.exitcode})"
    (tmp_path / "ref").mkdir()
    ref = _make(_policy(policy), tmp_path / "ref")
    ref_losses = _train(ref, 5)
    resumed = _make(_policy(policy), d)  # the same directory: the dead run's lock is taken over
    resumed.load(str(ckpt))
    assert _train(resumed, 3, offset=2) == ref_losses[2:]
    assert same_state(resumed.state_dict(), ref.state_dict())


def _policy(name: str):
    return {"state-on-nvme": StateOnNvme(), "zero-infinity": ZeroInfinity()}[name]


def _train_then_die_mid_step(policy: str, d: str, ckpt: str, writes: int) -> None:
    """The killed run of the test above, in a child process: two steps, a checkpoint, then the
    third step's NVMe writes until the one after ``writes``, where the process kills itself
    (SIGKILL: no handler, no cleanup)."""
    tm = _make(_policy(policy), d)
    _train(tm, 2)
    tm.save(ckpt)
    x, y = gpt_batch(2)
    tm.backward(gpt_loss(tm(x), y))
    store, calls = tm.stores[Tier.NVME], []
    real = store._pwritev

    def write(fd, bufs, offset):
        calls.append(offset)
        if len(calls) > writes:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step, mid-write
        return real(fd, bufs, offset)

    store._pwritev = write
    tm.step()


def test_zero_infinity_holds_each_value_once_on_disk(tmp_path):
    """ZeroInfinity after a few steps: the directory holds one file per key (weights per parameter,
    state per bucket) plus at most the store's spare files (the journal at rest, a constant), and
    ``du`` says so: 14 B/param of values, <= 15 B/param in all here. The spares are a constant (at
    most ``limit`` per size band: 8.4 MB here), so the model is large enough (21M params) that the
    file system's own slack (du counts blocks a file system may have allocated ahead of a recent
    write: 15.03 B/param was seen with 10.5M params) does not decide the last figure."""
    torch.manual_seed(0)
    width, depth = 512, 80
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(depth)))
    n = width * width * depth
    tm = TieredModel(
        model, ZeroInfinity(), optimizer=AdamW(lr=1e-3), precision="bf16", bucket_size="512KiB", nvme_dir=str(tmp_path)
    )
    x = torch.randn(8, width)
    for _ in range(3):
        tm.backward(tm(x).float().square().mean())
        tm.step()
    store = tm.stores[Tier.NVME]
    keys = list(store.keys())
    assert len(keys) == depth + len(tm.layout.buckets)  # one weight key per layer, one state key per bucket
    slots = {store._journal.keys[k].current().path for k in keys}
    files = {str(tmp_path / name) for name in os.listdir(tmp_path) if name != "tiermem.lock"}
    spares = files - slots
    assert all(os.path.basename(f).startswith("spare-") for f in spares)
    bands = collections.Counter(os.path.getsize(f).bit_length() for f in spares)  # NvmeStore's spares
    assert all(count <= store._journal.spares.limit for count in bands.values())  # at most `limit` of each size band

    def du(*paths) -> int:
        out = subprocess.run(
            ["du", "-s", "-c", "--block-size=1", *map(str, paths)], capture_output=True, text=True, check=True
        ).stdout
        return int(out.splitlines()[-1].split()[0])

    payload = 14 * n  # bf16 weights 2 B + fp32 master, exp_avg, exp_avg_sq 12 B, each once
    assert du(*slots) == payload + 4096 * len(slots)  # each value once, and its file's header
    largest = 4096 + 12 * max(b.numel for b in tm.layout.buckets)
    total = du(tmp_path)
    assert total <= du(*slots) + len(spares) * largest + 2 * 4096  # + the spares and the lock file
    assert total / n <= 15, f"{total / n:.2f} B/param on disk"
    tm.detach()
