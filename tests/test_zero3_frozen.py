"""Frozen weights sharded over the ranks (NOTE [Frozen weights sharded over the ranks]): a peft
LoRA model on 2 gloo ranks (tests/ranks.py) under ZeroInfinity, weights on the host and
``shard_weights=True`` trains like one process accumulating both ranks' micro-batches (fp32 to
rounding, NOTE [Arithmetic tolerances] in tests/tolerance.py; bf16 ranks bit for bit alike), each rank keeping half the
frozen base at its home (the ledger; ``du`` of its NVMe directory); gradient checkpointing, eval(),
detach() and checkpoints (a single file, and a DCP directory saved at 2 ranks loaded in one
process) work as in one process. One pair of processes runs every scenario; each test reads its part."""

from __future__ import annotations

import functools
import os
import subprocess

import pytest
import torch

peft = pytest.importorskip("peft")  # the `test` extra
transformers = pytest.importorskip("transformers")

from ranks import run_ranks  # noqa: E402
from test_peft import SPEC, _batch, _lora, _mode  # noqa: E402
from test_zero3 import WeightsOnHost  # noqa: E402
from tolerance import assert_adam_within, second_moments  # noqa: E402

from tiermem import TensorClass, Tier, TieredModel  # noqa: E402
from tiermem.plan import footprint as fp  # noqa: E402
from tiermem.policies import ZeroInfinity, ZeroOffload  # noqa: E402
from tiermem.train.weights.weight_shards import shard_key  # noqa: E402

D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME
STEPS = 2
BUCKET = "16KiB"  # a few frozen buckets (4096 elements each) and a few trainable ones

#: setup -> (policy, shard_weights, the weights' home)
SETUPS = {
    "zero-infinity": (ZeroInfinity, False, N),
    "weights-on-host": (WeightsOnHost, False, H),
    "shard-weights": (ZeroOffload, True, D),
}


@pytest.fixture(autouse=True, scope="module")
def _same_kernel_as_the_ranks():
    """The ranks run torch's fused AdamW (tests/ranks.py); so do the one-process references here."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIERMEM_NO_COMPILE", "1")
        yield


def _model(precision: str, mode: str = "plain") -> torch.nn.Module:
    model = _lora("attention")
    _mode(model, mode)
    return model.to(torch.bfloat16) if precision == "bf16" else model  # one copy of the base: no fp32 host copy


def _make(setup: str, tmp: str, *, precision: str = "fp32", mode: str = "plain", tag: str = "", **kw) -> TieredModel:
    policy, shard, _ = SETUPS[setup]
    nvme = os.path.join(tmp, f"{setup}-{precision}-{mode}{tag}")
    os.makedirs(nvme, exist_ok=True)
    return TieredModel(
        _model(precision, mode),
        policy(),
        optimizer=SPEC,
        precision=precision,
        bucket_size=kw.pop("bucket_size", BUCKET),
        shard_weights=shard,
        nvme_dir=nvme,
        **kw,
    )


def _train(tm: TieredModel, rank: int, world: int, steps: range) -> list[float]:
    """Each rank its own micro-batch per step (in one process, both ranks', loss / 2)."""
    losses = []
    for i in steps:
        for r in [rank] if world > 1 else range(2):
            loss = tm(**_batch(2 * i + r)).loss
            tm.backward(loss / (1 if world > 1 else 2))
            losses.append(loss.item())
        assert not tm.step().skipped
    return losses


def _du(path: str) -> int:
    return int(subprocess.run(["du", "-sb", path], check=True, capture_output=True, text=True).stdout.split()[0])


def _frozen_home(tm: TieredModel) -> dict:
    """What a model keeps of its frozen parameters and weights at the weights' home."""
    frozen = [p for p in tm.module.parameters() if not p.requires_grad]
    home = SETUPS[next(s for s in SETUPS if isinstance(tm.policy, SETUPS[s][0]))][2]
    rep = tm.report()
    cold = [b for b in tm.gathered.full.values() if getattr(b, "frozen", False)] if tm.gathered is not None else []
    store = tm.stores[home] if home != N else None
    keys = [shard_key(b) for b in cold] if cold else [f"{n}:frozen" for n, p in tm.module.named_parameters()]
    return {
        "peak": rep.class_peak_bytes.get((TensorClass.PARAM, home), 0),
        "kept": sum(store.get(k).nbytes for k in keys if k in set(store.keys())) if store is not None else 0,
        "frozen bytes": sum(p.numel() for p in frozen) * tm.dtype.itemsize,
        "frozen buckets": len(cold),
        "du": _du(tm.stores[N].directory) if N in tm.stores else 0,
    }


# -- what each rank runs (top level: the ranks import them) ----------------------------------------
def _rank_setup(rank, world, tmp, setup):
    tm = _make(setup, tmp)
    states = []
    for i in range(STEPS):
        _train(tm, rank, world, range(i, i + 1))
        states.append(tm.state_dict())
    out = {"states": states, "home": _frozen_home(tm)}
    bf16 = _make(setup, tmp, precision="bf16")
    _train(bf16, rank, world, range(STEPS))  # no reads between steps: the second follows the first's trace
    out["on_demand"] = dict(bf16.gathered.on_demand)
    out["bf16"] = bf16.state_dict()
    return out


def _rank_variants(rank, world, tmp):
    out = {}
    for mode in ("checkpoint", "reentrant"):  # the frozen base read again by the recomputed forward
        tm = _make("weights-on-host", tmp, mode=mode)
        _train(tm, rank, world, range(STEPS))
        out[mode] = tm.state_dict()
    tm = _make("zero-infinity", tmp, tag="-eval")
    evals = []
    for i in range(STEPS):
        _train(tm, rank, world, range(i, i + 1))
        tm.eval()
        with torch.no_grad():
            evals.append(tm(**_batch(9)).logits.float())
        tm.train()
    out["eval"] = evals
    path = os.path.join(tmp, "frozen.tm")
    tm.save(path, format="file")  # rank 0 writes, every rank gathers the frozen base
    other = _make("weights-on-host", tmp, bucket_size="8KiB", tag="-loaded")
    other.load(path)
    out["file"] = (tm.state_dict(), other.state_dict())
    name, base = next((n, p) for n, p in other.module.named_parameters() if not p.requires_grad and p.dim() == 2)
    with other.resident(base), torch.no_grad():  # on every rank: the base's bucket is gathered for the block
        base.mul_(0.5)
    out["halved"] = (name, other.state_dict())
    dcp = os.path.join(tmp, "frozen.dcp")
    tm.save(dcp)  # every rank its shards; rank 0 the frozen base, read by every rank
    out["dcp"] = tm.state_dict()
    module = other.detach()
    out["detached"] = {n: p.detach().clone() for n, p in module.named_parameters()}
    return out


def _rank_all(rank, world, tmp):
    out = {setup: _rank_setup(rank, world, tmp, setup) for setup in SETUPS}
    out["variants"] = _rank_variants(rank, world, tmp)
    return out


@pytest.fixture(scope="module")
def z3(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero3-frozen")
    return str(tmp), run_ranks(_rank_all, str(tmp), deadline=400)


@functools.cache
def _moments(steps: int) -> dict[str, torch.Tensor]:
    """torch's AdamW second moments on the LoRA model after ``steps`` steps accumulating both ranks'
    micro-batches: where a gradient is near its rounding (NOTE [Arithmetic tolerances])."""
    m = _model("fp32")
    trained = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=SPEC.lr, betas=SPEC.betas, weight_decay=SPEC.weight_decay, foreach=False)
    for i in range(steps):
        for r in range(2):
            (m(**_batch(2 * i + r)).loss / 2).backward()
        opt.step()
        opt.zero_grad()
    return second_moments(m, opt)


def _assert_rounding_apart(got: dict, want: dict, steps: int = STEPS) -> None:
    """Ranks summing their micro-batches' gradients and one process accumulating them round
    differently: ``got`` is ``want`` to NOTE [Arithmetic tolerances] (tests/tolerance.py)."""
    hp = dict(lr=SPEC.lr, betas=SPEC.betas, eps=SPEC.eps, weight_decay=SPEC.weight_decay)
    assert_adam_within(got, want, _moments(steps), steps=steps, **hp)


def _solo(tmp, precision: str = "fp32", steps: int = STEPS, **kw) -> TieredModel:
    tm = TieredModel(_model(precision), ZeroOffload(), optimizer=SPEC, precision=precision, bucket_size=BUCKET, **kw)
    _train(tm, 0, 1, range(steps))
    return tm


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- the tests --------------------------------------------------------------------------------------
@pytest.mark.parametrize("setup", SETUPS)
def test_lora_on_two_ranks_trains_like_one_process_accumulating_both(z3, setup):
    ranks = [r[setup] for r in z3[1]]
    solo = TieredModel(_model("fp32"), ZeroOffload(), optimizer=SPEC, precision="fp32", bucket_size=BUCKET)
    for i in range(STEPS):
        _train(solo, 0, 1, range(i, i + 1))
        a, b = ranks[0]["states"][i], ranks[1]["states"][i]
        assert _same(a, b)  # the ranks agree bit for bit, the frozen base included
        _assert_rounding_apart(a, solo.state_dict(), steps=i + 1)
    assert ranks[0]["home"]["frozen buckets"] >= 3  # the base was sharded, in buckets of its own
    assert ranks[0]["on_demand"] == {}  # after the first step every bucket was gathered ahead of use


@pytest.mark.parametrize("setup", SETUPS)
def test_bf16_ranks_stay_identical(z3, setup):
    a, b = (r[setup]["bf16"] for r in z3[1])
    assert _same(a, b)
    start = _model("bf16").state_dict()
    assert _max_diff(a, start) > 1e-3  # it trained


@pytest.mark.parametrize("setup", SETUPS)
def test_each_rank_keeps_half_the_frozen_base_at_home(z3, setup, tmp_path):
    """Per rank, the ledger of the weights' home peaks at about half what one process's does (the
    frozen base is nearly all of it), and on NVMe the rank's directory holds at most about half
    the bytes (before: every rank kept the whole base, over 0.9 of one process's)."""
    solo = _make(setup, str(tmp_path))  # one process: every weight whole at its home
    _train(solo, 0, 1, range(1))
    whole = _frozen_home(solo)
    assert whole["peak"] >= whole["frozen bytes"]
    for r in z3[1]:
        mine = r[setup]["home"]
        ratio = mine["peak"] / whole["peak"]
        if SETUPS[setup][2] == H:  # one process: a page-rounded buffer per parameter; a rank: one per chunk
            assert mine["frozen bytes"] / 2 <= mine["peak"] <= 0.55 * whole["peak"], (mine, whole)
        elif SETUPS[setup][2] == D:  # the device also holds the buckets gathered: the chunks kept there
            assert whole["kept"] == whole["frozen bytes"]
            padding = 4 * mine["frozen buckets"]  # each chunk padded by less than an element
            assert whole["kept"] / 2 <= mine["kept"] <= whole["kept"] / 2 + padding, (mine, whole)
        else:
            assert 0.45 <= ratio <= 0.55, (ratio, mine, whole)
        if SETUPS[setup][2] == N:
            # one process: a file per parameter, each with its own header and padding; a rank: one per chunk
            assert mine["frozen bytes"] / 2 <= mine["du"] <= 0.55 * whole["du"], (mine["du"], whole["du"])


@pytest.mark.parametrize("mode", ["checkpoint", "reentrant"])
def test_lora_with_gradient_checkpointing(z3, mode, tmp_path):
    a, b = (r["variants"][mode] for r in z3[1])
    assert _same(a, b)
    _assert_rounding_apart(a, _solo(tmp_path).state_dict())


def test_eval_between_steps(z3, tmp_path):
    evals, evals1 = (r["variants"]["eval"] for r in z3[1])
    assert all(torch.equal(e, f) for e, f in zip(evals, evals1))
    solo = TieredModel(_model("fp32"), ZeroOffload(), optimizer=SPEC, precision="fp32", bucket_size=BUCKET)
    for i, e in enumerate(evals):
        _train(solo, 0, 1, range(i, i + 1))
        solo.eval()
        with torch.no_grad():
            assert (solo(**_batch(9)).logits.float() - e).abs().max() <= 1e-4
        solo.train()


def test_checkpoint_file_resident_and_detach_at_two_ranks(z3):
    for r in z3[1]:
        saved, loaded = r["variants"]["file"]
        assert _same(saved, loaded)  # the frozen base gathered, written by rank 0, each rank's piece loaded
        name, halved = r["variants"]["halved"]
        assert torch.equal(halved[name], loaded[name] * 0.5)  # resident() wrote each rank's piece home
        assert all(torch.equal(halved[k], loaded[k]) for k in loaded if k != name)
        assert _same(halved, r["variants"]["detached"])  # detach() gathers the base on every rank


def test_dcp_saved_at_two_ranks_loads_in_one_process(z3):
    tmp, ranks = z3
    solo = TieredModel(_model("fp32"), ZeroOffload(), optimizer=SPEC, precision="fp32", bucket_size=BUCKET)
    solo.load(os.path.join(tmp, "frozen.dcp"))
    assert _same(solo.state_dict(), ranks[0]["variants"]["dcp"])


def test_plan_counts_a_rank_share_of_the_frozen_base():
    """The budget check's rule (and ``tiermem plan --ranks``): a rank counts half the frozen base
    where one process counts all of it, and the gathers on the device."""
    from tiermem.plan import sizing
    from tiermem.plan.placement import plan

    model = _model("fp32")
    planned = plan(model, ZeroInfinity(), SPEC, torch.bfloat16, 4096, world=2)
    need = {
        w: fp.model_footprint(model, planned.buckets, planned.weight_homes, torch.bfloat16, world=w, bucket_numel=4096)
        for w in (1, 2)
    }
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad) * 2
    assert need[1][N][fp.FROZEN_WEIGHTS] == frozen
    assert frozen / 2 <= need[2][N][fp.FROZEN_WEIGHTS] <= frozen / 2 + 16 * 2  # each chunk padded by < 2 elements
    assert need[2][D][fp.GATHERED] > 0
    placement = sizing.placement_of("ZeroInfinity")
    one, two = (sizing.tier_bytes(1000, "bf16", placement, frozen=10**6, world=w)[N] for w in (1, 2))
    assert two == one // 2  # weights, state and the frozen base: each rank half of each


# -- a DCP directory holds each rank's own pieces of the frozen base -------------------------------
def _frozen_elements_by_file(path: str, frozen: list[str]) -> dict[str, int]:
    """How many elements of the frozen parameters ``frozen`` each file of a DCP directory holds
    (DCP's metadata: each chunk's box, and the file it lies in); a file per rank."""
    import math

    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(path).read_metadata()
    out: dict[str, int] = {}
    for index, where in md.storage_data.items():
        if index.fqn.removeprefix("model.") in frozen:
            box = next(c for c in md.state_dict_metadata[index.fqn].chunks if c.offsets == index.offset)
            out[where.relative_path] = out.get(where.relative_path, 0) + math.prod(box.sizes)
    return out


def _mixed(nvme: str) -> TieredModel:
    """An fp32 LoRA base trained in bf16 under ZeroInfinity, homed in ``nvme`` (made here)."""
    os.makedirs(nvme, exist_ok=True)
    return TieredModel(
        _model("fp32"), ZeroInfinity(), optimizer=SPEC, precision="bf16", bucket_size=BUCKET, nvme_dir=nvme
    )


def _rank_dcp(rank, world, tmp, solo_path):
    """A run saved after its first step and one not saved train on alike; a model that loads the
    checkpoint (another NVMe directory, and another bucket size) trains on like them; a model
    loads a checkpoint one process saved."""
    plain = _make("zero-infinity", tmp, tag="-plain")
    _train(plain, rank, world, range(2))
    tm = _make("zero-infinity", tmp, tag="-saved")
    _train(tm, rank, world, range(1))
    gathers = tm.gathered.gathers
    path = os.path.join(tmp, "saved.dcp")
    tm.save(path)
    out = {"gathers during save": tm.gathered.gathers - gathers}
    _train(tm, rank, world, range(1, 2))
    out["plain"], out["saved"] = plain.state_dict(), tm.state_dict()
    back = _make("zero-infinity", tmp, tag="-back")
    back.load(path)
    _train(back, rank, world, range(1, 2))
    out["loaded"] = back.state_dict()
    other = _make("weights-on-host", tmp, bucket_size="8KiB", tag="-other")  # other chunks of other buckets
    other.load(path)
    out["other"] = other.state_dict()
    one = _make("zero-infinity", tmp, tag="-from-one")
    one.load(solo_path)
    out["from one"] = one.state_dict()
    _train(one, rank, world, range(1, 2))
    out["from one on"] = one.state_dict()
    # an fp32 base trained in bf16: its fp32 copies, each rank keeping its pieces, are its values
    copies = [_mixed(os.path.join(tmp, f"{tag}{rank}")) for tag in ("mixed", "mixed-back")]
    _train(copies[0], rank, world, range(1))
    copies[0].save(os.path.join(tmp, "mixed.dcp"))
    copies[1].load(os.path.join(tmp, "mixed.dcp"))
    for tm in copies:  # the working copies at home (what the forward reads) were loaded too
        _train(tm, rank, world, range(1, 2))
    out["copies"] = [tm.state_dict() for tm in copies]
    return out


@pytest.fixture(scope="module")
def z3_dcp(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("zero3-frozen-dcp"))
    solo = _solo(tmp, steps=1)
    solo_path = os.path.join(tmp, "solo.dcp")
    solo.save(solo_path, format="dcp")  # one process: the frozen base whole, as before sharded saves
    return tmp, solo.state_dict(), run_ranks(_rank_dcp, tmp, solo_path, deadline=400)


def test_dcp_of_a_sharded_frozen_base_loads_at_two_ranks_and_trains_on(z3_dcp):
    _, _, ranks = z3_dcp
    for r in ranks:
        assert _same(r["plain"], r["saved"])  # saving changed nothing
        assert _same(r["saved"], r["loaded"])  # the loaded model trained on bit for bit
    assert _same(ranks[0]["loaded"], ranks[1]["loaded"])
    assert _same(ranks[0]["other"], ranks[1]["other"])
    for r in ranks:  # frozen parameters with an fp32 copy: each rank's pieces of it, in fp32
        assert _same(*r["copies"])


def test_dcp_of_a_sharded_frozen_base_loads_in_one_process(z3_dcp, tmp_path):
    tmp, _, ranks = z3_dcp
    solo = TieredModel(_model("fp32"), ZeroOffload(), optimizer=SPEC, precision="fp32", bucket_size=BUCKET)
    solo.load(os.path.join(tmp, "saved.dcp"))
    reference = _solo(tmp_path, steps=1)  # what the ranks' first step gave, to rounding
    loaded = solo.state_dict()
    _assert_rounding_apart(loaded, reference.state_dict(), steps=1)
    _train(solo, 0, 1, range(1, 2))
    _assert_rounding_apart(solo.state_dict(), ranks[0]["saved"], steps=2)
    frozen = [n for n, p in _model("fp32").named_parameters() if not p.requires_grad]
    other = ranks[0]["other"]  # loaded at two ranks into other buckets: the saved values exactly
    assert frozen and all(torch.equal(loaded[n], other[n]) for n in frozen)


def test_a_checkpoint_one_process_saved_loads_at_two_ranks(z3_dcp):
    """The frozen base whole in one chunk (one process's save, the layout every DCP save of the
    frozen base had before the ranks wrote their pieces) loads into each rank's pieces."""
    _, saved, ranks = z3_dcp
    for r in ranks:
        assert _same(r["from one"], saved)
    assert _same(ranks[0]["from one on"], ranks[1]["from one on"])


def test_each_rank_saves_its_share_of_the_frozen_base_without_gathering(z3_dcp):
    """Before, every rank gathered every frozen bucket at a save and rank 0 wrote the whole base."""
    tmp, _, ranks = z3_dcp
    assert [r["gathers during save"] for r in ranks] == [0, 0]
    frozen = {n: p.numel() for n, p in _model("fp32").named_parameters() if not p.requires_grad}
    by_file = _frozen_elements_by_file(os.path.join(tmp, "saved.dcp"), list(frozen))
    whole = sum(frozen.values())
    assert sum(by_file.values()) == whole and len(by_file) == 2, by_file  # each element once, in both ranks' files
    buckets = -(-whole // 4096)  # BUCKET: 4096 elements; a rank's chunk of each is at most half of it, rounded up
    assert all(n <= whole / 2 + buckets for n in by_file.values()), by_file  # before: rank 0's file all of it
