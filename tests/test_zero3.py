"""Weights sharded over the ranks (ZeRO-3, NOTE [Weights sharded over the ranks]) on 2 gloo ranks
(tests/ranks.py): ZeroInfinity, weights on the host and ``shard_weights=True`` train like one
process accumulating both ranks' micro-batches, each rank keeping half the weights at home; no_sync,
overlap_step, gradient checkpointing, eval() and checkpoints work as in one process; ranks whose
forwards read different weights stop at once with an error naming them. One pair of processes runs
every scenario (a fresh process costs seconds here); each test reads its part."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch
from models import TinyGPT, gpt_loss
from ranks import run_ranks
from test_data_parallel import NO_SYNC, STEPS, _assert_rounding_apart, _batch, _max_diff
from torch import nn
from torch.utils.checkpoint import checkpoint

from tiermem import AdamW, Budgets, OutOfTierMemory, PerClass, TensorClass, Tier, TieredModel, TierMemError
from tiermem.plan import footprint as fp
from tiermem.plan.placement import plan as plan_placement
from tiermem.policies import KeepOnDevice, ZeroInfinity, ZeroOffload

D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME


@pytest.fixture(autouse=True, scope="module")
def _same_kernel_as_the_ranks():
    """The ranks run torch's fused AdamW (tests/ranks.py); so do the one-process references here."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIERMEM_NO_COMPILE", "1")
        yield


class WeightsOnHost(PerClass):
    homes = {TensorClass.PARAM: H, TensorClass.ACTIVATION: D, TensorClass.GRAD: H, TensorClass.OPTIM_STATE: H}


class GradsOnNvme(PerClass):
    homes = {TensorClass.PARAM: H, TensorClass.ACTIVATION: D, TensorClass.GRAD: N, TensorClass.OPTIM_STATE: H}


#: setup -> (policy, shard_weights, whether it needs a directory on NVMe, the weights' home)
SETUPS = {
    "zero-infinity": (ZeroInfinity(), False, True, N),
    "weights-on-host": (WeightsOnHost(), False, False, H),
    "shard-weights": (ZeroOffload(), True, False, D),
}


class CheckpointedGPT(TinyGPT):
    """TinyGPT whose blocks run under activation checkpointing: their forward runs again in backward."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.reentrant)
        return self.head(self.ln_f(x))


class Divergent(TinyGPT):
    """A forward that reads one more weight (in a bucket of its own) where ``diverge`` is set."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(24, 96)
        self.diverge = False

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        x = self.blocks[0](x)
        if self.diverge:
            x = x + self.extra(x)[..., :24]
        return self.head(self.ln_f(self.blocks[1](x)))


def _make(setup: str, tmp: str | None = None, *, precision: str = "fp32", model=TinyGPT, **kw) -> TieredModel:
    policy, shard, on_nvme, _ = SETUPS[setup]
    torch.manual_seed(0)
    return TieredModel(
        model(),
        policy,
        optimizer=AdamW(lr=1e-2, weight_decay=0.1),
        precision=precision,
        bucket_size=kw.pop("bucket_size", 3000),
        shard_weights=shard,
        nvme_dir=tmp if on_nvme else kw.pop("nvme_dir", None),
        **kw,
    )


def _train(tm: TieredModel, rank: int, world: int, steps: range) -> list:
    """Each rank its own micro-batch per step (in one process, both ranks', loss / 2)."""
    results = []
    for i in steps:
        for r in [rank] if world > 1 else range(2):
            x, y = _batch(i, r)
            tm.backward(gpt_loss(tm(x), y) / (1 if world > 1 else 2))
        results.append(tm.step())
    return results


def _dir(tmp: str, *parts: str) -> str:
    path = os.path.join(tmp, *parts)
    os.makedirs(path, exist_ok=True)
    return path


# -- what each rank runs (top level: the spawned processes import them) --------------------------
def _rank_setup(rank, world, tmp, setup):
    tm = _make(setup, _dir(tmp, setup))
    need = _construction_need(tm)
    built = {t: tm.report().peak_bytes.get(t, 0) for t in (D, H)}
    states = []
    for i in range(STEPS):
        res = _train(tm, rank, world, range(i, i + 1))[0]
        states.append((res, tm.state_dict()))
    rep = tm.report()
    home = SETUPS[setup][3]
    bf16 = _make(setup, _dir(tmp, setup + "-bf16"), precision="bf16")
    _train(bf16, rank, world, range(STEPS))
    return {
        "states": states,
        "need": need,
        "built": built,
        "gathers": tm.gathered.gathers,
        "on_demand": dict(tm.gathered.on_demand),
        "bf16": bf16.state_dict(),
        "home_peak": rep.class_peak_bytes.get((TensorClass.PARAM, home), 0),
        "device_peak": rep.class_peak_bytes.get((TensorClass.PARAM, D), 0),
        "device shards": [k for k in tm.stores[D].keys() if k.endswith(":param shard")],
        "sent": rep.collective_bytes,
    }


def _construction_need(tm: TieredModel) -> dict:
    """The footprint of ``tm``'s layout, less what only a running step takes (tests/test_footprint.py)."""
    planned = plan_placement(tm.module, tm.placement, AdamW(), tm.dtype, 750)
    buckets, homes = planned.buckets, planned.weight_homes
    need = fp.model_footprint(
        tm.module,
        buckets,
        homes,
        tm.dtype,
        world=tm.group.world,
        shard_weights=tm.gathered is not None and any(b.param_tier == D for b in tm.gathered.full.values()),
        device_is_host=tm.device.type == "cpu",
    )
    step_only = {
        fp.GRADS_IN_FLIGHT,
        fp.LARGEST_MODULE,
        fp.GRADS_TO_REDUCE,
        fp.GATHERED,
        fp.GATHER_STAGING,
        fp.GATHER_ROUNDED,
    }
    built = {t: sum(n for what, n in need.get(t, {}).items() if what not in step_only) for t in (D, H)}
    world, w = tm.group.world, tm.dtype.itemsize
    whole_bucket = need[H][fp.WHOLE_BUCKET]  # three parts; building takes the master's alone, a checkpoint all
    built[H] -= whole_bucket + 3 * (fp.host_buffer_bytes(whole_bucket // 3) - whole_bucket // 3)
    # the master's buffer goes back to the system before the step's staging buffers are taken
    staging = need[H].get(fp.WEIGHT_STAGING, 0)
    staging_pages = staging and 2 * fp.host_buffer_bytes(staging // 2)  # two buffers, when any
    built[H] += max(fp.host_buffer_bytes(whole_bucket // 3), staging_pages) - staging_pages
    staged = max((-(-b.numel // 2) * tm.dtype.itemsize for b in buckets if b.param_tier == N), default=0)
    if staged:  # the page rounding of the step's staging buffers is no part of what building takes
        built[H] -= need[H][fp.GATHER_STAGING] // staged * (fp.host_buffer_bytes(staged) - staged)
    largest = max(-(-b.numel // world) * w for b in buckets)  # each gather's rounded chunk takes as much
    rounded = {t: need[t].get(fp.GATHER_ROUNDED, 0) // largest for t in (D, H)}  # how many at once, at most
    built[H] -= rounded[H] * (fp.host_buffer_bytes(largest) - largest)
    return {
        "built": built,
        "gathered": need[D].get(fp.GATHERED, 0),
        "rounded": rounded[H] * fp.host_buffer_bytes(largest),
        "rounded on the device": rounded[D] * largest,
    }


def _rank_variants(rank, world, tmp):
    """no_sync, overlap_step, gradient checkpointing, eval(), grads on NVMe: weights on the host."""
    out = {}
    for use in (False, True):
        tm = _make("weights-on-host")
        for i in range(2):
            (x, y), (x2, y2) = _batch(i, rank), _batch(i + 50, rank)
            with tm.no_sync() if use else contextlib.nullcontext():
                tm.backward(gpt_loss(tm(x), y))
            tm.backward(gpt_loss(tm(x2), y2))
            tm.step()
        out[f"no_sync={use}"] = (tm.state_dict(), tm.report().collective_bytes)
    tm = _make("zero-infinity", _dir(tmp, "overlap"), overlap_step=True, grad_clip=1.0)
    _train(tm, rank, world, range(STEPS))
    out["overlap"] = tm.state_dict()
    for reentrant in (False, True):
        tm = _make("shard-weights", model=lambda: CheckpointedGPT(reentrant))
        _train(tm, rank, world, range(STEPS))
        out[f"checkpoint reentrant={reentrant}"] = tm.state_dict()
    tm = _make("zero-infinity", _dir(tmp, "eval"))
    evals = []
    for i in range(STEPS):
        _train(tm, rank, world, range(i, i + 1))
        tm.eval()
        with torch.no_grad():
            evals.append(tm(_batch(7, 0)[0]).float())
        tm.train()
    out["eval"] = (evals, tm.state_dict())
    torch.manual_seed(0)
    nvme = TieredModel(
        TinyGPT(),
        GradsOnNvme(),
        optimizer=AdamW(lr=1e-2, weight_decay=0.1),
        precision="fp32",
        bucket_size=3000,
        nvme_dir=_dir(tmp, "grads"),
    )
    _train(nvme, rank, world, range(STEPS))
    out["grads on nvme"] = nvme.state_dict()
    for shard in (False, True):  # state and weights on the device: a sharded chunk rounded from the device's master
        torch.manual_seed(0)
        tm = TieredModel(
            TinyGPT(),
            KeepOnDevice(),
            optimizer=AdamW(lr=1e-2, weight_decay=0.1),
            precision="bf16",
            bucket_size=3000,
            shard_weights=shard,
        )
        _train(tm, rank, world, range(STEPS))
        kinds = sorted({type(h).__name__ for h in tm.gathered.shards.values()}) if shard else []
        kept = [k for k in tm.stores[D].keys() if k.endswith(":param shard")]
        out[f"on device shard_weights={shard}"] = (tm.state_dict(), kinds, kept)
    return out


def _rank_checkpoint(rank, world, tmp):
    """tm.save under ZeRO-3 (rank 0 writes from the masters), loaded back on 2 ranks; resident()
    writes on every rank; detach() gives every rank the fp32 weights."""
    tm = _make("zero-infinity", _dir(tmp, "save"))
    _train(tm, rank, world, range(STEPS))
    path = os.path.join(tmp, "zero3.tm")
    tm.save(path)
    saved = tm.state_dict()
    other = _make("weights-on-host", bucket_size=1700)
    other.load(path)
    loaded = other.state_dict()
    with torch.no_grad(), pytest.raises(TierMemError) as refused:  # outside resident(): refused, nothing changes
        other.module.ln_f.weight.mul_(0.5)
    with other.resident(other.module.ln_f):
        with torch.no_grad():
            other.module.ln_f.weight.mul_(0.5)
    halved = other.state_dict()["ln_f.weight"]
    _train(other, rank, world, range(STEPS, STEPS + 1))
    after = other.state_dict()
    detached = {n: p.detach().clone() for n, p in other.detach().named_parameters(remove_duplicate=False)}
    return saved, loaded, halved, after, detached, str(refused.value)


def _rank_budget(rank, world, host):
    """A host budget that holds a rank's half of the weights on the host but not all of them."""
    torch.manual_seed(0)
    tm = TieredModel(
        TinyGPT(d=96, n_layer=4), WeightsOnHost(), precision="bf16", bucket_size="96KiB", budgets=Budgets(host=host)
    )
    return tm.report().peak_bytes[H]


def _rank_divergent(rank, world):
    torch.manual_seed(0)
    tm = TieredModel(Divergent(), ZeroOffload(), precision="fp32", bucket_size=3000, shard_weights=True)
    tm.module.diverge = rank == 1
    x, y = _batch(0, rank)
    t0 = time.perf_counter()
    with pytest.raises(TierMemError) as e:
        tm.backward(gpt_loss(tm(x), y))
    return str(e.value), time.perf_counter() - t0


def _rank_all(rank, world, tmp, host_budget):
    out = {setup: _rank_setup(rank, world, tmp, setup) for setup in SETUPS}
    out["variants"] = _rank_variants(rank, world, tmp)
    out["checkpoint"] = _rank_checkpoint(rank, world, tmp)
    out["budget"] = _rank_budget(rank, world, host_budget)
    out["divergent"] = _rank_divergent(rank, world)  # last: the model it leaves is broken
    return out


def _host_need(world: int) -> int:
    """The host bytes TieredModel's budget check asks for the wide model with its weights on the host."""
    model = TinyGPT(d=96, n_layer=4)
    planned = plan_placement(model, WeightsOnHost(), AdamW(), torch.bfloat16, 96 * 1024 // 4)
    buckets, homes = planned.buckets, planned.weight_homes
    return fp.totals(fp.model_footprint(model, buckets, homes, torch.bfloat16, world=world))[H]


@pytest.fixture(scope="module")
def z3(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero3")
    solo_host, rank_host = _host_need(1), _host_need(2)
    host_budget = (solo_host + rank_host) // 2  # a rank's share fits; one process's whole does not
    return tmp, solo_host, host_budget, run_ranks(_rank_all, str(tmp), host_budget, deadline=240)


def _solo(steps=range(STEPS), **kw) -> TieredModel:
    torch.manual_seed(0)
    tm = TieredModel(
        TinyGPT(), ZeroOffload(), optimizer=AdamW(lr=1e-2, weight_decay=0.1), precision="fp32", bucket_size=3000, **kw
    )
    _train(tm, 0, 1, steps)
    return tm


# -- the tests --------------------------------------------------------------------------------
@pytest.mark.parametrize("setup", SETUPS)
def test_two_ranks_train_like_one_process_accumulating_both(z3, setup):
    ranks = [r[setup] for r in z3[3]]
    solo_results = []
    torch.manual_seed(0)
    solo = TieredModel(
        TinyGPT(), ZeroOffload(), optimizer=AdamW(lr=1e-2, weight_decay=0.1), precision="fp32", bucket_size=3000
    )
    for i, ((res0, sd0), (res1, sd1)) in enumerate(zip(ranks[0]["states"], ranks[1]["states"])):
        solo_results.append(_train(solo, 0, 1, range(i, i + 1))[0])
        assert all(torch.equal(sd0[k], sd1[k]) for k in sd0)  # the ranks agree bit for bit
        _assert_rounding_apart(sd0, solo.state_dict(), steps=i + 1)
        assert res0 == res1 and res0.grad_norm == pytest.approx(solo_results[-1].grad_norm, rel=1e-6)
    assert ranks[0]["on_demand"] == {}  # after the first step every bucket was gathered ahead of use


@pytest.mark.parametrize("setup", SETUPS)
def test_bf16_ranks_stay_identical(z3, setup):
    a, b = (r[setup]["bf16"] for r in z3[3])
    assert all(torch.equal(a[k], b[k]) for k in a)
    torch.manual_seed(0)
    assert _max_diff(a, TinyGPT().state_dict()) > 1e-3  # it trained


@pytest.mark.parametrize("setup", SETUPS)
def test_each_rank_keeps_half_the_weights_at_home(z3, setup, tmp_path):
    """Per rank, the ledger of the weights' home peaks at half the weights' bytes (plus, on the
    host, each chunk's buffer rounded to whole pages), where one process holds them all; beside
    the masters (on the host; on a CPU device, whose memory is the host's), no chunk is kept at
    all, only those rounded from the masters for the gathers in flight (NOTE [A chunk rounded
    from its master]); the device holds gathered buckets within what the footprint allows."""
    home = SETUPS[setup][3]
    tm = _make(setup, str(tmp_path))  # in one process, every weight whole at its home
    _train(tm, 0, 1, range(1))
    whole = sum(p.numel() for p in tm.module.parameters()) * 4  # fp32
    assert tm.report().class_peak_bytes[(TensorClass.PARAM, home)] >= whole
    buckets = len(tm.layout.buckets)
    for r in z3[3]:
        mine, gathered = r[setup], r[setup]["need"]["gathered"]
        if home == D and tm.device.type == "cpu":  # rounded from the host's masters: no chunk kept
            rounded = r[setup]["need"]["rounded on the device"]
            assert not mine["device shards"] and rounded > 0
            assert 0 < mine["device_peak"] <= gathered + rounded, (mine["device_peak"], gathered, rounded)
        elif home == D:  # the chunks and the gathered buckets share the device
            assert whole / 2 < mine["device_peak"] <= whole / 2 + 4 * buckets + gathered
        elif home == H:  # below what the chunks kept in their page-rounded buffers took
            kept = sum(fp.host_buffer_bytes(-(-b.numel // 2) * 4) for b in tm.layout.buckets)
            assert 0 < mine["home_peak"] <= r[setup]["need"]["rounded"] < kept, (mine["home_peak"], kept)
            assert 0 < mine["device_peak"] <= gathered
        else:
            largest = max(-(-b.numel // 2) for b in tm.layout.buckets) * 4
            # a page per chunk's buffer; on NVMe, the padding and two chunks written beside their value
            rounding = 4096 * buckets if home == H else 4 * buckets + fp.JOURNAL_BUCKETS["weights"] * largest
            assert whole / 2 <= mine["home_peak"] <= whole / 2 + rounding, (mine["home_peak"], whole)
            assert 0 < mine["device_peak"] <= gathered


@pytest.mark.parametrize("setup", SETUPS)
def test_construction_allocates_what_the_footprint_says(z3, setup):
    for r in z3[3]:
        assert r[setup]["built"] == r[setup]["need"]["built"]


def test_a_model_that_fits_two_ranks_but_not_one(z3):
    """The budget check counts a rank's share of the weights: accepted on 2 ranks, refused alone
    with the figures."""
    _, solo_host, budget, ranks = z3
    assert all(r["budget"] <= budget for r in ranks)
    torch.manual_seed(0)
    with pytest.raises(OutOfTierMemory, match=r"out of host memory.*working weights"):
        TieredModel(
            TinyGPT(d=96, n_layer=4),
            WeightsOnHost(),
            precision="bf16",
            bucket_size="96KiB",
            budgets=Budgets(host=budget),
        )


def test_no_sync_communicates_once_with_the_same_result(z3):
    (plain, sent_plain), (once, sent_once) = (z3[3][0]["variants"][f"no_sync={u}"] for u in (False, True))
    assert sent_once < sent_plain
    _assert_rounding_apart(plain, once, steps=2, batches=NO_SYNC)


def test_overlap_step_trains_like_one_process_with_overlap_step(z3):
    a, b = (r["variants"]["overlap"] for r in z3[3])
    assert all(torch.equal(a[k], b[k]) for k in a)
    solo = _solo(grad_clip=1.0, overlap_step=True)
    _assert_rounding_apart(a, solo.state_dict())
    assert _max_diff(a, _solo(grad_clip=1.0).state_dict()) > 1e-4  # a delayed update is not the plain one


def test_sharded_weights_beside_a_device_master_are_rounded_from_it(z3):
    """KeepOnDevice with shard_weights: no chunk of weights is kept on the device (each gather
    rounds the device's master), and bf16 training is bit for bit that of replicated weights."""
    for r in z3[3]:
        replicated, _, _ = r["variants"]["on device shard_weights=False"]
        sharded, kinds, kept = r["variants"]["on device shard_weights=True"]
        assert kinds == ["MasterShards"] and kept == []
        assert all(torch.equal(replicated[k], sharded[k]) for k in replicated)
    torch.manual_seed(0)
    assert _max_diff(sharded, TinyGPT().state_dict()) > 1e-3  # it trained


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(z3, reentrant):
    a, b = (r["variants"][f"checkpoint reentrant={reentrant}"] for r in z3[3])
    assert all(torch.equal(a[k], b[k]) for k in a)
    _assert_rounding_apart(a, _solo().state_dict())


def test_eval_between_steps(z3):
    (evals, sd), (evals1, _) = (r["variants"]["eval"] for r in z3[3])
    assert all(torch.equal(e, f) for e, f in zip(evals, evals1))
    torch.manual_seed(0)
    solo = TieredModel(
        TinyGPT(), ZeroOffload(), optimizer=AdamW(lr=1e-2, weight_decay=0.1), precision="fp32", bucket_size=3000
    )
    for i, e in enumerate(evals):
        _train(solo, 0, 1, range(i, i + 1))
        solo.eval()
        with torch.no_grad():
            assert (solo(_batch(7, 0)[0]).float() - e).abs().max() <= 1e-5
        solo.train()
    _assert_rounding_apart(sd, solo.state_dict())


def test_grads_on_nvme_under_data_parallelism(z3):
    """Placement never changes the numbers: grads on NVMe (each rank its chunk) as on the host."""
    for r in z3[3]:
        nvme = r["variants"]["grads on nvme"]
        host = r["weights-on-host"]["states"][-1][1]
        assert all(torch.equal(nvme[k], host[k]) for k in nvme)


def test_checkpoints_and_resident_under_zero3(z3):
    (saved, loaded, halved, after, detached, refused), (_, loaded1, _, after1, detached1, _) = (
        r["checkpoint"] for r in z3[3]
    )
    assert refused == (
        "tiermem: mul_ writes into the weight 'ln_f.weight', which is sharded over the ranks; write to it inside "
        "`with tm.resident(...)` on every rank, which sends the new values home and to the optimizer's master weights"
    )
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)  # written by rank 0 from the masters
    assert all(torch.equal(loaded[k], loaded1[k]) for k in loaded)
    assert torch.equal(halved, loaded["ln_f.weight"] * 0.5)  # resident() wrote on every rank
    assert all(torch.equal(after[k], after1[k]) and torch.equal(after[k], detached[k]) for k in after)
    assert all(torch.equal(detached[k], detached1[k]) for k in detached)


def test_ranks_that_read_different_weights_stop_at_once_naming_them(z3):
    errors = [r["divergent"] for r in z3[3]]
    for text, seconds in errors:
        assert "out of step on their sharded weights" in text and "extra.weight" in text, text
        assert "read the same weights on every rank" in text
        assert seconds < 10  # not the group's timeout (30 s here)


def test_shard_weights_alone_changes_nothing():
    """In one process there is nothing to shard over: the same layout and numbers as without.

    The layout is compared through the ledger's peak per class and tier, all but the device's
    gradients in flight: backward hands each gradient to the d2h lane's thread, and the device
    holds it until that thread has copied it, so how many wait at once depends on the thread
    scheduling of the run (the step waits for them only under a device budget). Two runs of the
    same model differ there by a bucket or two on a loaded machine, with or without sharding."""
    runs = []
    for shard in (False, True):
        torch.manual_seed(0)
        tm = TieredModel(
            TinyGPT(), ZeroOffload(), optimizer=AdamW(lr=1e-2), precision="bf16", bucket_size=3000, shard_weights=shard
        )
        _train(tm, 0, 1, range(2))
        rep = tm.report()
        layout = [
            (b.param_tier, b.grad_tier, b.state_tier, [(s.name, s.offset) for s in b.slots]) for b in tm.layout.buckets
        ]
        settled = {k: v for k, v in rep.class_peak_bytes.items() if k != (TensorClass.GRAD, D)}
        runs.append((tm.state_dict(), tm.gathered, layout, settled, rep.peak_bytes[H]))
    (plain, none, layout, peaks, host), (sharded, gathered, layout_sharded, peaks_sharded, host_sharded) = runs
    assert gathered is none is None and layout == layout_sharded
    assert peaks == peaks_sharded and host == host_sharded
    assert all(torch.equal(plain[k], sharded[k]) for k in plain)
