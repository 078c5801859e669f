"""Data parallel (NOTE [Data parallel]) on 2 gloo ranks in fresh processes (tests/ranks.py): N
ranks train like one process accumulating their N micro-batches, decide alike, checkpoint into
any world size, and fail loudly."""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from models import TinyGPT, gpt_batch, gpt_loss, same_state
from ranks import run_ranks
from tolerance import assert_adam_within, second_moments
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tiermem import AdamW, Budgets, ConfigError, PerClass, StoreError, TensorClass, Tier, TieredModel, TierMemError
from tiermem.policies import ActivationOffload, ZeroOffload

STEPS = 3
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP in one process


@pytest.fixture(autouse=True, scope="module")
def _same_kernel_as_the_ranks():
    """The ranks run torch's fused AdamW (tests/ranks.py); so do the one-process references here."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIERMEM_NO_COMPILE", "1")
        yield


def _rank_all(rank, world, tmp):
    """Every scenario that leaves the process group usable, in one pair of processes (a fresh
    process costs seconds here): each test below reads its part."""
    nvme_files: list[str] = []
    out = {
        "fp32": _rank_train(rank, world, "fp32", "zero-offload", None, 1.0),
        "bf16": _rank_train(rank, world, "bf16", "zero-offload", None, None),
        "host": _rank_train(rank, world, "fp32", "zero-offload", None, None),
        "nvme": _rank_train(rank, world, "fp32", "state-on-nvme", os.path.join(tmp, "nvme"), None, files=nvme_files),
        "nvme_files": nvme_files,
        "activations": _rank_train(rank, world, "fp32", "activation-offload", None, None),
        "overlap": _rank_train(rank, world, "fp32", "zero-offload", None, 1.0, overlap=True),
        "peak": _rank_peak(rank, world),
        "overflow": _rank_overflow(rank, world),
        "replica": _rank_replica(rank, world),
        "no_sync": (_rank_no_sync(rank, world, False), _rank_no_sync(rank, world, True)),
        "freezing": _rank_freezing(rank, world),
    }
    out["saved"] = _rank_save(rank, world, tmp, STEPS)
    for fmt in FORMATS:
        out[f"{fmt} 2->2"] = _rank_load(
            rank, world, os.path.join(tmp, f"by2.{fmt}"), os.path.join(tmp, f"by2-again.{fmt}"), 2, fmt
        )
        out[f"{fmt} 1->2"] = _rank_load(
            rank, world, os.path.join(tmp, f"by1.{fmt}"), os.path.join(tmp, f"by1-again.{fmt}"), 2, fmt
        )
    out["user"] = _rank_user(rank, world, tmp)
    out["empty"] = _rank_empty(rank, world, tmp)
    out["unseen"] = _rank_unseen(rank, world, tmp)
    out["nvme dcp"] = _rank_nvme_dcp(rank, world, tmp)
    return out


FORMATS = ("file", "dcp")  # one file rank 0 writes, as earlier versions did; a DCP directory every rank writes


@pytest.fixture(scope="module")
def dp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp")
    (tmp / "nvme").mkdir()
    tm, _ = _solo()
    for fmt in FORMATS:
        tm.save(str(tmp / f"by1.{fmt}"), format=fmt)
    return tmp, tm.state_dict(), run_ranks(_rank_all, str(tmp))


class StateOnNvme(PerClass):
    homes = {
        TensorClass.PARAM: Tier.DEVICE,
        TensorClass.ACTIVATION: Tier.DEVICE,
        TensorClass.GRAD: Tier.HOST,
        TensorClass.OPTIM_STATE: Tier.NVME,
    }


def _batch(step: int, rank: int):
    return gpt_batch(100 * step + rank)


def _make(precision: str = "fp32", policy=None, **kw) -> TieredModel:
    torch.manual_seed(0)
    return TieredModel(
        TinyGPT(),
        policy or ZeroOffload(),
        optimizer=AdamW(lr=1e-2, weight_decay=0.1),
        precision=precision,
        bucket_size=kw.pop("bucket_size", 3000),
        **kw,
    )


def _train(tm: TieredModel, rank: int, world: int, steps: range, scale=None) -> list:
    """Each rank its own micro-batch per step (in one process, every rank's, loss / world)."""
    results = []
    for i in steps:
        for r in [rank] if world > 1 else range(scale or 1):
            x, y = _batch(i, r)
            tm.backward(gpt_loss(tm(x), y) / (scale or 1))
        results.append(tm.step())
    return results


def _solo(steps=range(STEPS), schedule=None, **kw):
    """One process; step i accumulates ``schedule[i]`` micro-batches (ranks' batches 0, 1, ...; 2 each by default)."""
    tm = _make(**kw)
    res = [r for i in steps for r in _train(tm, 0, 1, range(i, i + 1), scale=schedule[i] if schedule else 2)]
    return tm, res


Batches = tuple[tuple[tuple[int, int], ...], ...]  # per step, the (step, rank) of each micro-batch
NO_SYNC: Batches = tuple(((i, 0), (i + 50, 0), (i, 1), (i + 50, 1)) for i in range(2))


def _per_step(schedule) -> Batches:
    """Step i accumulates ``schedule[i]`` micro-batches: ranks 0, 1, ... of step i."""
    return tuple(tuple((i, r) for r in range(n)) for i, n in enumerate(schedule))


@functools.cache
def _moments(batches: Batches, freezing: bool = False) -> dict:
    """torch's for-loop AdamW's second moments after ``batches`` (block 0 frozen at steps 1 and 2
    if ``freezing``): where a gradient is near its rounding (NOTE [Arithmetic tolerances])."""
    torch.manual_seed(0)
    m = TinyGPT()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for i, micro in enumerate(batches):
        if freezing:
            m.blocks[0].requires_grad_(i not in (1, 2))
        for step, rank in micro:
            x, y = _batch(step, rank)
            (gpt_loss(m(x), y) / len(micro)).backward()
        opt.step()
        opt.zero_grad()
    return second_moments(m, opt)


def _assert_rounding_apart(got: dict, want: dict, steps: int = STEPS, batches=None, freezing=False) -> None:
    """``got`` is ``want`` to NOTE [Arithmetic tolerances] (tests/tolerance.py) of ``steps`` AdamW
    steps (lr 1e-2, weight decay 0.1) on ``batches`` (two micro-batches a step by default): ranks
    summing their micro-batches' gradients round them differently from one process accumulating
    the same losses."""
    moments = _moments(batches or _per_step([2] * steps), freezing)
    assert_adam_within(got, want, moments, lr=1e-2, steps=steps, eps=1e-8, weight_decay=0.1)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# -- what each rank runs (top level: the spawned processes import them) --------------------------
def _rank_train(rank, world, precision, policy_name, nvme_dir, clip, overlap=False, files=None):
    policy = {
        "zero-offload": ZeroOffload(),
        "state-on-nvme": StateOnNvme(),
        "activation-offload": ActivationOffload(ZeroOffload(), min_bytes=0),
    }[policy_name]
    tm = _make(precision, policy, nvme_dir=nvme_dir, grad_clip=clip, overlap_step=overlap)
    per_step = []
    for i in range(STEPS):
        res = _train(tm, rank, world, range(i, i + 1))[0]
        last = i == STEPS - 1  # reading the state lands an overlapped update: only at the end, then
        per_step.append((res, {k: v.clone() for k, v in tm.state_dict().items()} if last or not overlap else {}))
    rep = tm.report()
    if files is not None:  # what the rank's directory holds while the model lives (a dropped one deletes its files)
        files.extend(os.listdir(os.path.join(nvme_dir, f"rank{rank}")))
    return per_step, rep.class_peak_bytes.get((TensorClass.OPTIM_STATE, Tier.HOST), 0), rep.collective_bytes


def test_two_ranks_train_like_one_process_accumulating_both(dp):
    ranks = [r["fp32"] for r in dp[2]]
    solo, solo_res = _solo(grad_clip=1.0)
    (r0, _, sent0), (r1, _, _) = ranks
    assert all(torch.equal(r0[-1][1][k], r1[-1][1][k]) for k in r0[-1][1])  # the ranks agree bit for bit
    _assert_rounding_apart(r0[-1][1], solo.state_dict())
    for (a, _), (b, _), s in zip(r0, r1, solo_res):  # one decision: the same norm and clip everywhere
        assert a == b
        assert a.grad_norm == pytest.approx(s.grad_norm, rel=1e-6) and not a.skipped
    assert sent0 > 0


def test_overlap_step_trains_like_one_process_with_overlap_step(dp):
    """The one-step delayed update under data parallelism: the weights' gathers run on the
    engine's thread beside the next backward's reduce-scatters (each on a group of its own)."""
    (r0, _, _), (r1, _, _) = (r["overlap"] for r in dp[2])
    assert all(torch.equal(r0[-1][1][k], r1[-1][1][k]) for k in r0[-1][1])
    solo, solo_res = _solo(grad_clip=1.0, overlap_step=True)
    _assert_rounding_apart(r0[-1][1], solo.state_dict())
    plain = dp[2][0]["fp32"][0][-1][1]
    assert _max_diff(r0[-1][1], plain) > 1e-4  # a delayed update is not the plain one
    for (a, _), s in zip(r0, solo_res):
        assert a.grad_norm == pytest.approx(s.grad_norm, rel=1e-6)


def test_bf16_loss_falls_and_ranks_stay_identical_after_every_step(dp):
    r0, r1 = (r["bf16"][0] for r in dp[2])
    for (_, a), (_, b) in zip(r0, r1):
        assert all(torch.equal(a[k], b[k]) for k in a)
    first = _make("bf16")
    assert _max_diff(r0[-1][1], first.state_dict()) > 1e-3  # it trained


def _wide() -> TieredModel:
    torch.manual_seed(0)
    return TieredModel(TinyGPT(d=96, n_layer=4), precision="bf16", bucket_size="96KiB")


def _rank_peak(rank, world):
    tm = _wide()
    _train(tm, rank, world, range(1))
    rep = tm.report()
    torch.manual_seed(0)  # the budget check counts a rank's share: what the first run used fits again
    TieredModel(
        TinyGPT(d=96, n_layer=4),
        precision="bf16",
        bucket_size="96KiB",
        budgets=Budgets(host=int(1.3 * rep.peak_bytes[Tier.HOST])),
    )
    return rep.class_peak_bytes[(TensorClass.OPTIM_STATE, Tier.HOST)]


def test_each_rank_holds_half_the_optimizer_state(dp):
    solo = _wide()
    _train(solo, 0, 1, range(1))
    whole = solo.report().class_peak_bytes[(TensorClass.OPTIM_STATE, Tier.HOST)]
    largest = max(b.numel for b in solo.layout.buckets) * 12  # the one bucket a rank gathers whole, to read it
    for peak in (r["peak"] for r in dp[2]):
        assert whole / 2 <= peak <= whole / 2 + largest + 64 * 4096, (peak, whole)


def test_state_on_nvme_each_rank_in_its_own_directory(dp):
    tmp, _, ranks = dp
    for r in ranks:  # placement never changes the numbers
        (a, _, _), (b, _, _), (c, _, _) = r["host"], r["nvme"], r["activations"]
        assert all(torch.equal(a[-1][1][k], b[-1][1][k]) for k in a[-1][1])
        assert all(torch.equal(a[-1][1][k], c[-1][1][k]) for k in a[-1][1])  # activations offloaded too
    assert sorted(os.listdir(tmp / "nvme")) == ["rank0", "rank1"]
    assert all(r["nvme_files"] for r in ranks)


# -- checkpoints across world sizes --------------------------------------------------------------
def _rank_save(rank, world, tmp, steps):
    tm = _make()
    _train(tm, rank, world, range(steps))
    for fmt in FORMATS:
        tm.save(os.path.join(tmp, f"by2.{fmt}"), format=fmt)
    return tm.state_dict()


def _rank_load(rank, world, path, resave, more, fmt):
    torch.manual_seed(123)
    tm = TieredModel(
        TinyGPT(), ZeroOffload(), optimizer=AdamW(lr=1e-2, weight_decay=0.1), precision="fp32", bucket_size=1700
    )  # another bucket size: the checkpoint is keyed by parameter
    tm.load(path)
    loaded = tm.state_dict()
    tm.save(resave, format=fmt)
    _train(tm, rank, world, range(STEPS, STEPS + more))
    return loaded, tm.state_dict()


def _contents(path, tmp_path) -> object:
    """A file's bytes; everything a DCP directory holds, read by torch alone (less the number of
    its manifests: the world size that wrote it)."""
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return f.read()
    out = tmp_path / f"contents-{len(os.listdir(tmp_path))}.pt"
    dcp_to_torch_save(str(path), str(out))
    whole = torch.load(out, weights_only=False)
    whole.pop("tiermem_manifests")
    return whole


def _same_tree(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _after_loading(path: str, resave: str, fmt: str):
    tm = _make(bucket_size=1700)
    tm.load(path)
    loaded = tm.state_dict()
    tm.save(resave, format=fmt)
    _train(tm, 0, 1, range(STEPS, STEPS + 2), scale=2)
    return loaded, tm.state_dict()


def _rank_three(rank, world, tmp):
    """Each 2-rank checkpoint loaded by 3 ranks, saved again, then two steps of 3 micro-batches."""
    return {
        fmt: _rank_load(rank, world, os.path.join(tmp, f"by2.{fmt}"), os.path.join(tmp, f"by2-by3.{fmt}"), 2, fmt)
        for fmt in FORMATS
    }


@pytest.fixture(scope="module")
def three(dp):
    return run_ranks(_rank_three, str(dp[0]), world=3)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("saved_by, loaded_by", [(2, 2), (2, 1), (1, 2), (2, 3)])
def test_a_checkpoint_loads_into_any_world_size(dp, three, tmp_path, fmt, saved_by, loaded_by):
    """Bit-exact after the load, the same contents saved again; then the steps after it train like
    one process accumulating as many micro-batches (to rounding, NOTE [Arithmetic tolerances]:
    dividing by 3 rounds differently from one process's losses / 3)."""
    tmp, solo_saved, ranks = dp
    saved = ranks[0]["saved"] if saved_by == 2 else solo_saved
    path = tmp / f"by{saved_by}.{fmt}"
    if loaded_by == 2:
        (loaded, after), (_, after1) = (r[f"{fmt} {saved_by}->2"] for r in ranks)
        assert all(torch.equal(after[k], after1[k]) for k in after)
        resave = tmp / f"by{saved_by}-again.{fmt}"
    elif loaded_by == 3:
        (loaded, after), rest = three[0][fmt], [r[fmt] for r in three[1:]]
        assert all(torch.equal(after[k], r[1][k]) for r in rest for k in after)
        resave = tmp / f"by2-by3.{fmt}"
    else:
        resave = tmp_path / f"again.{fmt}"
        loaded, after = _after_loading(str(path), str(resave), fmt)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)  # bit-exact after load
    assert _same_tree(_contents(resave, tmp_path), _contents(path, tmp_path))  # moments, step counts and all
    schedule = (2,) * STEPS + (loaded_by if loaded_by > 1 else 2,) * 2
    _assert_rounding_apart(after, _continued(schedule), steps=len(schedule), batches=_per_step(schedule))


@functools.cache
def _continued(schedule: tuple[int, ...]) -> dict:
    """One process's weights after steps of ``schedule[i]`` micro-batches each."""
    reference, _ = _solo(steps=range(len(schedule)), schedule=schedule)
    return reference.state_dict()


def _rank_user(rank, world, tmp):
    """A user's own dcp.save of tm.sharded_state_dict(), and dcp.load into one, on 2 ranks."""
    user = os.path.join(tmp, "by2-user")
    tm = _make()
    _train(tm, rank, world, range(STEPS))
    dcp.save(tm.sharded_state_dict(), checkpoint_id=user)
    mine = _make(bucket_size=1300)
    try:
        mine.load(user)  # no manifests: its bytes cannot be checked (NOTE [Nothing in a checkpoint runs])
    except StoreError as e:
        assert "has no tiermem manifest" in str(e)
    else:
        raise AssertionError("tm.load read a directory without manifests")
    sd = mine.sharded_state_dict()
    dcp.load(sd, checkpoint_id=user)
    mine.load_sharded_state_dict(sd)
    theirs = _make(bucket_size=900)
    sd = theirs.sharded_state_dict()
    dcp.load(sd, checkpoint_id=os.path.join(tmp, "by2.dcp"))
    theirs.load_sharded_state_dict(sd)
    return tm.state_dict(), mine.state_dict(), theirs.state_dict()


def test_a_users_own_dcp_save_and_load_of_the_sharded_state_dict(dp):
    tmp, _, ranks = dp
    saved = ranks[0]["saved"]
    for r in ranks:
        trained, loaded_by_tm, loaded_by_dcp = r["user"]
        assert same_state(trained, saved) and same_state(loaded_by_tm, saved) and same_state(loaded_by_dcp, saved)
    one = _make(bucket_size=1100)
    sd = one.sharded_state_dict()
    dcp.load(sd, checkpoint_id=str(tmp / "by2-user"))  # 2 -> 1
    one.load_sharded_state_dict(sd)
    assert same_state(one.state_dict(), saved)


class WithEmpty(nn.Module):
    """A parameter of no elements lies in no rank's chunk."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.empty = nn.Parameter(torch.zeros(0, 3))

    def forward(self, x):
        return self.lin(x) + self.empty.sum()


def _with_empty() -> TieredModel:
    torch.manual_seed(0)
    return TieredModel(WithEmpty(), optimizer=AdamW(lr=1e-2), precision="fp32", bucket_size=64)


def _rank_empty(rank, world, tmp):
    tm = _with_empty()
    tm.backward(tm(torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))).sum())
    tm.step()
    tm.save(os.path.join(tmp, "by2-empty.dcp"))
    return tm.state_dict()


def _rank_unseen(rank, world, tmp):
    """Rank 1 does not see the directory rank 0 made (as without a shared filesystem)."""
    tm = _make()
    real = os.path.isdir
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os.path, "isdir", lambda p: real(p) and not (rank == 1 and ".tmp-" in str(p)))
        with pytest.raises(StoreError) as info:
            tm.save(os.path.join(tmp, "unseen.dcp"))
    return str(info.value)


def test_a_directory_some_rank_does_not_see_is_refused_before_anything_is_written(dp):
    tmp, _, ranks = dp
    assert ranks[1]["unseen"].startswith("tiermem: rank 1 of 2 does not see the directory")
    assert ranks[0]["unseen"].startswith("tiermem: another rank does not see the directory")
    assert all("nothing was written. Save it where every rank sees the same files" in r["unseen"] for r in ranks)
    assert not [n for n in os.listdir(tmp) if n.startswith("unseen")]  # rank 0's temporary is gone too


def test_a_parameter_of_no_elements_is_saved_by_rank_0(dp):
    one = _with_empty()
    one.load(str(dp[0] / "by2-empty.dcp"))
    assert same_state(one.state_dict(), dp[2][0]["empty"]) and one.stepper.steps == 1


def _rank_nvme_dcp(rank, world, tmp):
    """State on NVMe, saved as DCP: host memory holds no more than before; loads into host state."""
    nvme = os.path.join(tmp, "nvme-dcp")
    os.makedirs(nvme, exist_ok=True)
    tm = _make(policy=StateOnNvme(), nvme_dir=nvme)
    _train(tm, rank, world, range(STEPS))
    tm.save(os.path.join(tmp, "by2-nvme.first"))  # a step's read-ahead of its next bucket lands first
    key = (TensorClass.OPTIM_STATE, Tier.HOST)
    before = tm.report()
    tm.save(os.path.join(tmp, "by2-nvme.dcp"))
    after = tm.report()
    read = after.bytes_moved[(Tier.NVME, Tier.HOST)] - before.bytes_moved[(Tier.NVME, Tier.HOST)]
    host = _make(bucket_size=1700)
    host.load(os.path.join(tmp, "by2-nvme.dcp"))
    return (
        tm.state_dict(),
        host.state_dict(),
        after.class_peak_bytes[key] - before.class_peak_bytes[key],
        read,
        sum(b.numel for b in tm.layout.step_buckets) * 12,
    )


def test_state_on_nvme_is_streamed_into_a_dcp_checkpoint_by_every_rank(dp):
    for r in dp[2]:
        trained, loaded, more_host, read, shard_bytes = r["nvme dcp"]
        assert same_state(loaded, trained)
        assert more_host == 0  # through the home's own buffers: no bucket more, let alone the shard
        assert read == shard_bytes  # this rank's shard of each bucket read once, in order
    assert same_state(dp[2][0]["nvme dcp"][0], dp[2][1]["nvme dcp"][0])
    assert sorted(n for n in os.listdir(dp[0] / "by2-nvme.dcp") if n.endswith(".distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]


# -- one decision for all; failures ----------------------------------------------------------------
def _rank_overflow(rank, world):
    tm = _make("fp16")
    x, y = _batch(0, rank)
    loss = gpt_loss(tm(x), y)
    tm.backward(loss * float("inf") if rank == 1 else loss)
    res = tm.step()
    return res.skipped, res.loss_scale, res.step


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(dp):
    assert [r["overflow"] for r in dp[2]] == [(True, 2.0**15, 0)] * 2


def _rank_raises(rank, world):
    tm = _make()
    x, y = _batch(0, rank)
    tm.backward(gpt_loss(tm(x), y))
    if rank == 1:
        raise RuntimeError("rank 1 gives up")
    tm.step()


def test_a_rank_that_raises_makes_the_others_fail_not_hang():
    results, errors = run_ranks(_rank_raises, deadline=60, allow_errors=True)
    assert "rank 1 gives up" in errors[1]
    assert "TierMemError" in errors[0] and "rank 0 of 2" in errors[0] and "failed" in errors[0], errors[0]


def _rank_mismatch(rank, world):
    torch.manual_seed(0)
    TieredModel(TinyGPT(), bucket_size=3000 if rank == 0 else 5000)


def test_ranks_with_different_configurations_are_caught_at_construction():
    _, errors = run_ranks(_rank_mismatch, allow_errors=True)
    assert set(errors) == {0, 1}
    assert all(
        "ConfigError" in e and "ranks [1] built a different model or configuration" in e for e in errors.values()
    )


def _rank_replica(rank, world):
    return TieredModel(nn.Linear(3, 3), process_group=False).report().world  # a full replica: no collective


def test_process_group_false_keeps_a_full_replica(dp):
    assert [r["replica"] for r in dp[2]] == [1, 1]


def _rank_no_sync(rank, world, use_no_sync):
    tm = _make()
    for i in range(2):
        x, y = _batch(i, rank)
        x2, y2 = _batch(i + 50, rank)
        if use_no_sync:
            with tm.no_sync():
                tm.backward(gpt_loss(tm(x), y))
        else:
            tm.backward(gpt_loss(tm(x), y))
        tm.backward(gpt_loss(tm(x2), y2))
        tm.step()
    return tm.state_dict(), tm.report().collective_bytes


def test_no_sync_communicates_once_with_the_same_result(dp):
    (plain, sent_plain), (once, sent_once) = dp[2][0]["no_sync"]
    assert sent_once < sent_plain
    _assert_rounding_apart(plain, once, steps=2, batches=NO_SYNC)


def _freeze_block0(tm: TieredModel, i: int) -> None:
    tm.module.blocks[0].requires_grad_(i not in (1, 2))  # trained, frozen for two steps, trained again


def _rank_freezing(rank, world):
    """NOTE [Freezing and unfreezing] under data parallelism: alike on every rank, it trains as
    one process does; a rank that differs, or a parameter frozen at construction unfrozen, is
    refused on every rank (the group stays usable)."""
    tm = _make()
    for i in range(4):
        _freeze_block0(tm, i)
        _train(tm, rank, world, range(i, i + 1))
    out = {"alike": tm.state_dict()}
    tm.module.blocks[1].requires_grad_(rank == 0)
    x, y = _batch(9, rank)
    with pytest.raises(TierMemError, match=r"the ranks train different parameters"):
        tm.backward(gpt_loss(tm(x), y))
    tm.module.blocks[1].requires_grad_(True)
    m = TinyGPT()
    m.blocks[1].requires_grad_(False)
    frozen = TieredModel(m, ZeroOffload(), precision="fp32", bucket_size=3000)
    m.blocks[1].requires_grad_(True)
    with pytest.raises(
        ConfigError,
        match=r"under data parallelism this version cannot add them to the sharded "
        r"buckets: build the model with them trainable and freeze them",
    ):
        frozen.backward(gpt_loss(frozen(x), y))
    out["refused"] = True
    return out


def test_freezing_alike_on_every_rank_trains_as_one_process_and_differing_is_refused(dp):
    ranks = dp[2]
    solo = _make()
    for i in range(4):
        _freeze_block0(solo, i)
        _train(solo, 0, 1, range(i, i + 1), scale=2)
    want = solo.state_dict()
    for r in ranks:
        _assert_rounding_apart(r["freezing"]["alike"], want, steps=4, freezing=True)
        assert r["freezing"]["refused"]


def test_without_a_process_group_nothing_is_distributed():
    tm = _make()
    rep = tm.report()
    assert (rep.rank, rep.world, rep.collective_bytes) == (0, 1, 0)
    with pytest.raises(TierMemError):
        TieredModel(nn.Linear(2, 2), process_group=object())  # a group given without torch.distributed


def _rank_nccl(rank, world):
    torch.manual_seed(0)
    tm = TieredModel(TinyGPT(), optimizer=AdamW(lr=1e-2), precision="bf16", bucket_size=3000, grad_clip=1.0)
    for i in range(STEPS):
        x, y = _batch(i, rank)
        tm.backward(gpt_loss(tm(x), y))
        tm.step()
    return {k: v.cpu() for k, v in tm.state_dict().items()}, tm.report().class_peak_bytes.get(
        (TensorClass.OPTIM_STATE, Tier.HOST), 0
    )


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: this machine has fewer than 2")
def test_nccl_ranks_agree_and_hold_half_the_state():
    (a, peak_a), (b, peak_b) = run_ranks(_rank_nccl, backend="nccl")
    assert all(torch.equal(a[k], b[k]) for k in a)
    torch.manual_seed(0)
    solo = TieredModel(TinyGPT(), optimizer=AdamW(lr=1e-2), precision="bf16", bucket_size=3000)
    whole = solo.report().class_peak_bytes[(TensorClass.OPTIM_STATE, Tier.HOST)]
    assert peak_a < 0.75 * whole and peak_b < 0.75 * whole
