"""A frozen base's copy in its own dtype, sharded over the ranks (NOTE [Frozen weights sharded
over the ranks]): an fp32 LoRA base trained in bf16 on 2 gloo ranks (tests/ranks.py), its working
weights sharded (ZeroInfinity: on NVMe, so its fp32 copy too; weights on the host, or on the
device with ``shard_weights=True``: the copy on the host), keeps half the fp32 base per rank where each rank kept all of it; it trains bit for bit
as the same model with its base rounded to bf16 beforehand (what the working weights are, copy or
not); its values (``state_dict()``, ``detach()``) are the fp32 base exactly; and checkpoints (a
single file, DCP directories saved at 2 ranks or one process, loaded at 2 ranks or one) carry the
fp32 values exactly. One pair of processes runs every scenario; each test reads its part."""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch
from safetensors.torch import save_file

peft = pytest.importorskip("peft")  # the `test` extra
transformers = pytest.importorskip("transformers")

from ranks import run_ranks  # noqa: E402
from test_peft import SPEC, _batch  # noqa: E402
from test_zero3_frozen import BUCKET, SETUPS, STEPS, _du, _model, _same, _train  # noqa: E402

from tiermem import Tier, TieredModel  # noqa: E402
from tiermem.memory.aligned import ALIGN  # noqa: E402
from tiermem.memory.nvme_layout import HEADER  # noqa: E402
from tiermem.train.weights.frozen import copy_key  # noqa: E402

H, N = Tier.HOST, Tier.NVME
COPIED = ("zero-infinity", "weights-on-host", "shard-weights")  # the copy on NVMe, on the host (twice)


@pytest.fixture(autouse=True, scope="module")
def _same_kernel_as_the_ranks():
    """The ranks run torch's fused AdamW (tests/ranks.py); so do the one-process models here."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIERMEM_NO_COMPILE", "1")
        yield


def _mixed(setup: str, tmp: str, tag: str, *, rounded: bool = False, shifted: bool = False, **kw) -> TieredModel:
    """The fp32 LoRA model trained in bf16 (its frozen base keeps an fp32 copy); ``rounded``: its
    frozen base rounded to bf16 first (no copy: the working weights are the same); ``shifted``:
    its frozen base 1 more (a model a load must give the checkpoint's base, copy and working
    weights both)."""
    policy, shard, _ = SETUPS[setup]
    model = _model("fp32")
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16) if rounded else p.data + 1 if shifted else p.data
    nvme = os.path.join(tmp, f"copy-{setup}-{tag}")
    os.makedirs(nvme, exist_ok=True)
    return TieredModel(
        model,
        policy(),
        optimizer=SPEC,
        precision="bf16",
        bucket_size=kw.pop("bucket_size", BUCKET),
        shard_weights=shard,
        nvme_dir=nvme,
        **kw,
    )


def _copy_bytes(tm: TieredModel) -> dict:
    """The bytes of the frozen parameters' fp32 copies this process keeps, by tier (the stores' own
    count of each key), and (``"files"``) how many values on NVMe hold them."""
    frozen = [n for n, p in tm.module.named_parameters() if not p.requires_grad]
    keys = {copy_key(n) for n in frozen}
    out: dict = {H: sum(tm.stores[H].get(k).nbytes for k in set(tm.stores[H].keys()) & keys)}
    on_nvme = set(tm.stores[N].keys()) & keys if N in tm.stores else set()
    out[N], out["files"] = sum(tm.stores[N].nbytes(k) for k in on_nvme), len(on_nvme)
    return out


def _frozen_names() -> list[str]:
    return [n for n, p in _model("fp32").named_parameters() if not p.requires_grad]


def _loss(tm: TieredModel, i: int) -> float:
    """The loss of batch ``i`` in eval mode: what the working weights compute, nothing changed."""
    tm.eval()
    with torch.no_grad():
        loss = tm(**_batch(i)).loss.item()
    tm.train()
    return loss


def _halve(tm: TieredModel) -> str:
    """A 2-d frozen parameter halved in a resident block (its bf16 value written: the copy takes it)."""
    name, base = next((n, p) for n, p in tm.module.named_parameters() if not p.requires_grad and p.dim() == 2)
    with tm.resident(base), torch.no_grad():
        base.mul_(0.5)
    return name


# -- what each rank runs ------------------------------------------------------------------------------
class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _rank_copies(rank, world, tmp, solo_path, weights):
    out: dict = {"weights": {}}
    for setup in COPIED:  # built from a checkpoint (``weights=``): each rank reads its pieces, no broadcast
        built, fresh = _mixed(setup, tmp, "weights", shifted=True, weights=weights), _mixed(setup, tmp, "fresh")
        out["weights"][setup] = {"state": built.state_dict(), "bytes": _copy_bytes(built)}
        out["weights"][setup]["losses"] = (_loss(built, 9 + rank), _loss(fresh, 9 + rank))
    for setup in COPIED:
        logged, log = _Lines(), logging.getLogger("tiermem")
        log.addHandler(logged)
        level = log.level
        log.setLevel(logging.INFO)
        try:
            tm = _mixed(setup, tmp, "train")
        finally:
            log.removeHandler(logged)
            log.setLevel(level)
        ref = _mixed(setup, tmp, "rounded", rounded=True)
        cold = [b for b in tm.gathered.full.values() if b.frozen]
        out[setup] = {"bytes": _copy_bytes(tm), "buckets": len(cold), "losses": _train(tm, rank, world, range(STEPS))}
        out[setup]["logged"] = [line for line in logged.lines if "copy beside their working copy" in line]
        out[setup]["rounded losses"] = _train(ref, rank, world, range(STEPS))
        out[setup]["state"], out[setup]["rounded"] = tm.state_dict(), ref.state_dict()
        if N in tm.stores:
            out[setup]["du"] = _du(tm.stores[N].directory) - _du(ref.stores[N].directory)
        if setup == "zero-infinity":
            saved = tm
    path = os.path.join(tmp, "copy.tm")
    saved.save(path, format="file")  # every rank gathers each copy; rank 0 writes it
    other = _mixed("weights-on-host", tmp, "file", shifted=True, bucket_size="8KiB")
    other.load(path)
    out["file"] = other.state_dict()
    dcp = os.path.join(tmp, "copy.dcp")
    saved.save(dcp)  # every rank its pieces of each copy
    out["saved"] = saved.state_dict()
    back = _mixed("weights-on-host", tmp, "dcp", shifted=True, bucket_size="8KiB")  # other chunks of other buckets
    back.load(dcp)
    out["dcp"] = back.state_dict()
    out["losses"] = {k: _loss(m, 9 + rank) for k, m in (("saved", saved), ("file", other), ("dcp", back))}
    out["halved"] = (_halve(back), back.state_dict())
    out["detached"] = {n: p.detach().clone() for n, p in back.detach().named_parameters()}
    one = _mixed("zero-infinity", tmp, "from-one", shifted=True)
    one.load(solo_path)
    out["from one"] = one.state_dict()
    out["losses"]["from one"] = _loss(one, 9 + rank)
    return out


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """The ranks' results, and one process's: its copy bytes and ``du`` beside the rounded model's,
    and its state after a step, saved as a DCP directory the ranks load."""
    tmp = str(tmp_path_factory.mktemp("zero3-frozen-copy"))
    solo, ref = _mixed("zero-infinity", tmp, "solo"), _mixed("zero-infinity", tmp, "solo-rounded", rounded=True)
    one = {"bytes": _copy_bytes(solo), "du": _du(solo.stores[N].directory) - _du(ref.stores[N].directory)}
    _train(solo, 0, 1, range(1))
    solo_path = os.path.join(tmp, "solo.dcp")
    solo.save(solo_path)
    weights = os.path.join(tmp, "w.safetensors")
    save_file({k: v.clone().contiguous() for k, v in _model("fp32").state_dict().items()}, weights)
    one["state"] = solo.state_dict()
    one["losses"] = [_loss(solo, 9 + r) for r in range(2)]
    return tmp, one, run_ranks(_rank_copies, tmp, solo_path, weights, deadline=400)


# -- the tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("setup", COPIED)
def test_each_rank_keeps_half_the_fp32_copy(copies, setup):
    """One process (and, before, every rank) keeps the whole fp32 base beside its working weights;
    each rank now keeps its chunks' elements of it, on the copy's tier: half, to a chunk's rounding."""
    _, one, ranks = copies
    frozen = sum(p.numel() for p in _model("fp32").parameters() if not p.requires_grad) * 4
    tier, other = (N, H) if SETUPS[setup][2] == N else (H, N)
    assert (one["bytes"][N], one["bytes"][H]) == (frozen, 0)  # one process, ZeroInfinity: on NVMe, whole
    mine = [r[setup]["bytes"] for r in ranks]
    assert all(m[other] == 0 for m in mine), mine
    assert sum(m[tier] for m in mine) == frozen  # each element in one rank's piece
    slack = 4 * ranks[0][setup]["buckets"]  # rank 0's chunk of each frozen bucket: half of it rounded up
    assert all(frozen / 2 - slack <= m[tier] <= frozen / 2 + slack for m in mine), (mine, frozen, slack)
    if tier == N:  # on disk: a file per piece (a header, the data padded to a block), one per parameter before
        for r, m in zip(ranks, mine):
            assert m[N] + m["files"] * HEADER <= r[setup]["du"] <= m[N] + m["files"] * (HEADER + ALIGN), (r, m)
            assert r[setup]["du"] < one["du"] and one["du"] >= frozen + one["bytes"]["files"] * HEADER


@pytest.mark.parametrize("setup", COPIED)
def test_the_log_line_and_the_plan_say_a_rank_keeps_its_share(copies, setup):
    """The constructor's line names the copies sharded and this rank's bytes; the plan's footprint
    (the budget check, ``tiermem plan --ranks``) counts a rank's share of the copy where one
    process counts all of it."""
    from tiermem.plan import footprint as fp
    from tiermem.plan.placement import plan

    _, _, ranks = copies
    tier = SETUPS[setup][2] if SETUPS[setup][2] == N else H
    for r in ranks:
        (line,) = r[setup]["logged"]
        assert "21 of them sharded over the 2 ranks, this rank's pieces" in line, line
        assert f"{r[setup]['bytes'][tier] / 2**30:.2f} GiB" in line, line
    model = _model("fp32")
    policy, shard, _ = SETUPS[setup]
    planned = plan(model, policy(), SPEC, torch.bfloat16, 4096, world=2)
    homes, kw = planned.weight_homes, dict(shard_weights=shard, bucket_numel=4096)
    need = {
        w: fp.model_footprint(model, planned.buckets, homes, torch.bfloat16, world=w, **kw)[tier][fp.FROZEN_COPY]
        for w in (1, 2)
    }
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad) * 4
    assert need[1] == frozen
    slack = 4 * ranks[0][setup]["buckets"]  # the rank with the larger chunks: half a bucket rounded up each
    assert max(r[setup]["bytes"][tier] for r in ranks) == need[2] <= frozen / 2 + slack


@pytest.mark.parametrize("setup", COPIED)
def test_a_model_built_from_a_checkpoint_keeps_its_pieces(copies, setup):
    """``weights=``: the checkpoint's values whatever the module held (its base 1 more), each
    rank's pieces of the copies as many bytes as when built from the module, and the same loss."""
    _, _, ranks = copies
    start = _model("fp32").state_dict()
    for r in ranks:
        got = r["weights"][setup]
        assert _same(got["state"], start)
        assert got["bytes"] == r[setup]["bytes"]
        assert got["losses"][0] == got["losses"][1]


@pytest.mark.parametrize("setup", COPIED)
def test_trains_bit_for_bit_as_its_base_rounded_beforehand(copies, setup):
    """The working weights are the fp32 base rounded to bf16, copy or no copy: the same losses and
    trained state, bit for bit; and its frozen values are the fp32 base, exactly."""
    _, _, ranks = copies
    start = _model("fp32").state_dict()
    for r in ranks:
        got = r[setup]
        assert got["losses"] == got["rounded losses"]
        frozen = set(_frozen_names())
        assert all(torch.equal(got["state"][k], got["rounded"][k]) for k in got["state"] if k not in frozen)
        assert all(got["state"][k].dtype == torch.float32 and torch.equal(got["state"][k], start[k]) for k in frozen)
    assert _same(ranks[0][setup]["state"], ranks[1][setup]["state"])


def test_a_single_file_carries_the_fp32_base_exactly(copies):
    """Loaded into a model whose base differs (1 more): the copies and the working weights both
    take the checkpoint's (the same loss, bit for bit)."""
    _, _, ranks = copies
    for r in ranks:
        assert _same(r["file"], r["saved"])  # gathered, written by rank 0, each rank's pieces loaded
        assert r["losses"]["file"] == r["losses"]["saved"]


def test_dcp_at_two_ranks_loads_at_two_ranks_and_in_one_process(copies, tmp_path):
    tmp, _, ranks = copies
    for r in ranks:
        assert _same(r["dcp"], r["saved"])  # other buckets, other chunks: the same values
        assert r["losses"]["dcp"] == r["losses"]["saved"]  # the working weights rounded from them
    solo = _mixed("weights-on-host", str(tmp_path), "solo-loads")
    solo.load(os.path.join(tmp, "copy.dcp"))
    assert _same(solo.state_dict(), ranks[0]["saved"])


def test_dcp_of_one_process_loads_at_two_ranks(copies):
    _, one, ranks = copies
    for rank, r in enumerate(ranks):
        assert _same(r["from one"], one["state"])
        assert r["losses"]["from one"] == one["losses"][rank]


def test_each_rank_writes_its_fp32_pieces_to_the_dcp_directory(copies):
    """Each copy's elements once, in fp32, split between both ranks' files (before: rank 0's
    file held every copy whole)."""
    from torch.distributed.checkpoint import FileSystemReader

    tmp, _, _ = copies
    md = FileSystemReader(os.path.join(tmp, "copy.dcp")).read_metadata()
    frozen = set(_frozen_names())
    by_file: dict[str, int] = {}
    for index, where in md.storage_data.items():
        fqn = index.fqn.removeprefix("model.")
        if fqn in frozen:
            assert md.state_dict_metadata[index.fqn].properties.dtype == torch.float32
            box = next(c for c in md.state_dict_metadata[index.fqn].chunks if c.offsets == index.offset)
            by_file[where.relative_path] = by_file.get(where.relative_path, 0) + math.prod(box.sizes)
    whole = sum(p.numel() for p in _model("fp32").parameters() if not p.requires_grad)
    assert sum(by_file.values()) == whole and len(by_file) == 2, by_file
    assert all(n <= whole / 2 + 4096 for n in by_file.values()), by_file


def test_resident_writes_and_detach_give_the_values_of_one_process(copies, tmp_path):
    """A resident block's write becomes each rank's piece of the copy, as it becomes one process's
    whole copy; ``detach()`` gathers the copies into the module, exactly."""
    tmp, _, ranks = copies
    solo = _mixed("weights-on-host", str(tmp_path), "solo-halves")
    solo.load(os.path.join(tmp, "copy.dcp"))
    name = _halve(solo)
    want = solo.state_dict()
    assert not torch.equal(want[name], ranks[0]["dcp"][name])  # the write changed the copy
    for r in ranks:
        assert r["halved"][0] == name
        assert _same(r["halved"][1], want)
        detached = r["detached"]
        assert all(torch.equal(detached[k], want[k]) for k in detached)
        assert all(detached[k].dtype == torch.float32 for k in _frozen_names())
