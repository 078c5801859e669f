"""A user's own ``dcp.save`` / ``dcp.load`` of ``tm.sharded_state_dict()`` with a LoRA base sharded
over 2 gloo ranks and homed on NVMe with the optimizer state (NOTE [Streamed sharded values]): each
rank hands DCP its own pieces of the base, read from its home when DCP asks, with no gather, and
takes back the pieces it keeps; two ranks and one process load the directory bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("peft")  # the `test` extra
pytest.importorskip("transformers")

import torch.distributed.checkpoint as dcp
from ranks import run_ranks
from test_peft import SPEC
from test_zero3_frozen import BUCKET, _frozen_elements_by_file, _make, _mixed, _model, _same, _train

from tiermem import TieredModel
from tiermem.checkpoint.shards import ShardedValue
from tiermem.policies import ZeroOffload


def _rank_user(rank, world, tmp):
    path = os.path.join(tmp, "user.dcp")
    tm = _make("zero-infinity", tmp, tag="-user")
    _train(tm, rank, world, range(1))
    gathers = tm.gathered.gathers
    sd = tm.sharded_state_dict()
    frozen = [n for n, p in tm.module.named_parameters() if not p.requires_grad]
    mine = [sd["model"][n] for n in frozen if n in sd["model"]]  # a rank names the parameters its chunks hold
    out = {"streamed": {v._name for v in mine if isinstance(v, ShardedValue) and not v.filled}, "mine": len(mine)}
    dcp.save(sd, checkpoint_id=path)
    out["gathers"] = tm.gathered.gathers - gathers
    out["saved"] = tm.state_dict()
    back = _make("zero-infinity", tmp, tag="-user-back")
    sd = back.sharded_state_dict()
    dcp.load(sd, checkpoint_id=path)
    back.load_sharded_state_dict(sd)
    out["loaded"] = back.state_dict()
    for model in (tm, back):
        _train(model, rank, world, range(1, 2))
    out["trained"], out["loaded trained"] = tm.state_dict(), back.state_dict()
    # an fp32 base trained in bf16: each rank's piece of its fp32 copy, on NVMe beside its chunk
    mixed = [_mixed(os.path.join(tmp, f"user-{tag}{rank}")) for tag in ("mixed", "mixed-back")]
    _train(mixed[0], rank, world, range(1))
    sd = mixed[0].sharded_state_dict()
    pieces = [sd["model"][n] for n, p in mixed[0].module.named_parameters() if not p.requires_grad and n in sd["model"]]
    out["mixed streamed"] = (len(pieces), sum(v.dtype == torch.float32 and not v.filled for v in pieces))
    dcp.save(sd, checkpoint_id=os.path.join(tmp, "user-mixed.dcp"))
    sd = mixed[1].sharded_state_dict()
    dcp.load(sd, checkpoint_id=os.path.join(tmp, "user-mixed.dcp"))
    mixed[1].load_sharded_state_dict(sd)
    out["mixed"] = [m.state_dict() for m in mixed]
    for model in mixed:  # the working copies at home (what the forward reads) were loaded too
        _train(model, rank, world, range(1, 2))
    out["mixed trained"] = [m.state_dict() for m in mixed]
    return out


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("zero3-user-dcp"))
    return tmp, run_ranks(_rank_user, tmp, deadline=300)


def test_each_rank_hands_dcp_its_own_pieces_of_the_frozen_base_without_gathering(user):
    tmp, ranks = user
    frozen = {n: p.numel() for n, p in _model("fp32").named_parameters() if not p.requires_grad}
    assert all(len(r["streamed"]) == r["mine"] for r in ranks)  # nothing read when returned
    assert set.union(*(r["streamed"] for r in ranks)) == {f"model.{n}" for n in frozen}
    assert [r["gathers"] for r in ranks] == [0, 0]  # before: every frozen bucket gathered on every rank
    by_file = _frozen_elements_by_file(os.path.join(tmp, "user.dcp"), list(frozen))
    whole = sum(frozen.values())
    assert sum(by_file.values()) == whole and len(by_file) == 2, by_file  # each element once, a file per rank
    buckets = -(-whole // 4096)  # BUCKET: 4096 elements; a rank's chunk of each at most half, rounded up
    assert all(n <= whole / 2 + buckets for n in by_file.values()), by_file


def test_the_ranks_load_it_back_and_train_on_bit_for_bit(user):
    _, ranks = user
    for r in ranks:
        assert _same(r["saved"], r["loaded"]) and _same(r["trained"], r["loaded trained"])
    assert _same(ranks[0]["loaded trained"], ranks[1]["loaded trained"])


def test_an_fp32_base_trained_in_bf16_comes_back_from_each_ranks_pieces_of_its_copy(user):
    _, ranks = user
    frozen = [n for n, p in _model("fp32").named_parameters() if not p.requires_grad]
    for r in ranks:
        mine, streamed = r["mixed streamed"]
        assert mine == streamed > 0  # its pieces of the fp32 copy, nothing read when returned
        saved, loaded = r["mixed"]
        assert _same(saved, loaded) and all(saved[n].dtype == torch.float32 for n in frozen)
        assert _same(*r["mixed trained"])


def test_one_process_loads_what_the_ranks_saved(user):
    tmp, ranks = user
    solo = TieredModel(_model("fp32"), ZeroOffload(), optimizer=SPEC, precision="fp32", bucket_size=BUCKET)
    sd = solo.sharded_state_dict()  # in memory: views of the live state, filled in place
    dcp.load(sd, checkpoint_id=os.path.join(tmp, "user.dcp"))
    solo.load_sharded_state_dict(sd)
    assert _same(solo.state_dict(), ranks[0]["saved"]) and _same(ranks[0]["saved"], ranks[1]["saved"])
