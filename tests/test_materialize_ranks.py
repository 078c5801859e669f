"""Models on the meta device under data parallelism (2 gloo ranks, tests/ranks.py): built from a
checkpoint (``weights=``) or from their modules' initialization, they train bit for bit like the
same values built in memory and wrapped on the same ranks, with weights replicated (ZeRO-2) or
sharded (``shard_weights=True``, ZeRO-3; ZeroInfinity's weights off the device), a frozen layer
included. From a checkpoint no rank broadcasts, and where the weights are sharded each rank reads
its chunks alone (NOTE [Models on the meta device])."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from models import TinyGPT, gpt_batch, gpt_loss
from ranks import run_ranks
from safetensors.torch import save_file

import tiermem
from tiermem.policies import ZeroInfinity, ZeroOffload
from tiermem.transfer.distributed import Distributed

BUCKET = 1500  # bytes of fp32 grads: 8 trainable buckets and 2 frozen, the ranks' chunks cutting parameters


class FrozenGPT(TinyGPT):
    def __init__(self):
        super().__init__()
        self.blocks[0].fc.requires_grad_(False)


@contextlib.contextmanager
def _watched(ckpt: str):
    """While open, counts the bytes this process reads from the file ``ckpt`` (``os.preadv``), those
    it asks the kernel to read ahead there (``os.posix_fadvise``), and the broadcasts it joins."""
    seen = {"read": 0, "ahead": 0, "broadcasts": 0}
    preadv, fadvise, broadcast = os.preadv, os.posix_fadvise, Distributed.broadcast_

    def ours(fd: int) -> bool:
        return bool(ckpt) and os.path.samefile(f"/proc/self/fd/{fd}", ckpt)

    def counted_preadv(fd, buffers, offset, *rest):
        n = preadv(fd, buffers, offset, *rest)
        seen["read"] += n if ours(fd) else 0
        return n

    def counted_fadvise(fd, offset, length, advice):
        seen["ahead"] += length if ours(fd) else 0
        return fadvise(fd, offset, length, advice)

    def counted_broadcast(self, t):
        seen["broadcasts"] += 1
        return broadcast(self, t)

    os.preadv, os.posix_fadvise, Distributed.broadcast_ = counted_preadv, counted_fadvise, counted_broadcast
    try:
        yield seen
    finally:
        os.preadv, os.posix_fadvise, Distributed.broadcast_ = preadv, fadvise, broadcast


def _ranks_train(rank: int, world: int, ckpt: str, nvme: str, shard: bool, policy: str) -> dict:
    """On each rank: the model built in memory from ``ckpt`` and the same model built on meta with
    ``weights=ckpt`` (or, ckpt == "", both from their initialization with seed 0), 3 steps of each on
    this rank's batches; both final states, and what each construction read and broadcast
    (``"<how> seen"``, :func:`_watched`)."""
    out = {}
    for how in ("memory", "meta"):
        torch.manual_seed(0)
        if how == "memory":
            model = FrozenGPT()
            if ckpt:
                from safetensors.torch import load_file

                model.load_state_dict(load_file(ckpt), strict=False)
        else:
            with torch.device("meta"):
                model = FrozenGPT()
        pol = ZeroInfinity() if policy == "zero-infinity" else ZeroOffload()
        with _watched(ckpt) as out[f"{how} seen"]:
            tm = tiermem.TieredModel(
                model,
                pol,
                precision="fp32",
                nvme_dir=f"{nvme}/{how}",
                shard_weights=shard,
                weights=ckpt if (ckpt and how == "meta") else None,
                bucket_size=BUCKET,
            )
        for step in range(3):
            x, y = gpt_batch(10 * step + rank)
            tm.backward(gpt_loss(tm(x), y))
            tm.step()
        out[how] = tm.state_dict()
    return out


SCENARIOS = [
    (source, policy, shard)
    for source in ("weights", "init")
    for policy, shard in (("zero-offload", False), ("zero-offload", True), ("zero-infinity", False))
]


def _ranks_all(rank: int, world: int, ckpt: str, root: str) -> dict:
    """Every scenario on one pair of ranks (a fresh pair costs seconds here)."""
    return {
        sc: _ranks_train(rank, world, ckpt if sc[0] == "weights" else "", f"{root}/{i}", sc[2], sc[1])
        for i, sc in enumerate(SCENARIOS)
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("meta-ranks")
    torch.manual_seed(7)
    sd = {k: v.contiguous() for k, v in FrozenGPT().state_dict().items() if k != "head.weight"}
    ckpt = str(root / "w.safetensors")
    save_file(sd, ckpt)  # the tied head is the embedding: its one name in the file is enough
    for i in range(len(SCENARIOS)):
        for how in ("memory", "meta"):
            (root / f"nvme/{i}/{how}").mkdir(parents=True)
    return run_ranks(_ranks_all, ckpt, str(root / "nvme"))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda sc: "-".join(str(x) for x in sc))
def test_meta_model_trains_as_in_memory_on_two_ranks(scenario, two_ranks):
    for got in two_ranks:
        a, b = got[scenario]["memory"], got[scenario]["meta"]
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
    first, second = (r[scenario]["meta"] for r in two_ranks)
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda sc: "-".join(str(x) for x in sc))
def test_only_values_from_init_or_memory_are_broadcast_at_construction(scenario, two_ranks):
    """A checkpoint holds the same values on every rank: no broadcast builds from it. A model given
    in memory, or initialized by its modules, starts from rank 0's values (a broadcast a bucket)."""
    source = scenario[0]
    for got in two_ranks:
        assert got[scenario]["memory seen"]["broadcasts"] > 0
        if source == "weights":
            assert got[scenario]["meta seen"]["broadcasts"] == 0
        else:
            assert got[scenario]["meta seen"]["broadcasts"] > 0


@pytest.mark.parametrize(
    "scenario", [sc for sc in SCENARIOS if sc[0] == "weights"], ids=lambda sc: "-".join(str(x) for x in sc)
)
def test_each_rank_reads_from_the_checkpoint_what_it_keeps(scenario, two_ranks):
    """Weights sharded over the ranks (``shard_weights=True``; ZeroInfinity's, off the device): each
    rank reads its chunk of every bucket, frozen ones included, and asks the kernel to read ahead no
    more: between them the two ranks read the checkpoint once, each about half (a bucket's chunks
    differ by one element at most). Replicated weights (ZeRO-2): each rank reads it whole, once."""
    _, policy, shard = scenario
    with torch.device("meta"):
        params = list(FrozenGPT().parameters())
    total = sum(4 * p.numel() for p in params)  # fp32, every parameter once (the tied head is the embedding)
    seen = [got[scenario]["meta seen"] for got in two_ranks]
    if shard or policy == "zero-infinity":
        assert seen[0]["read"] + seen[1]["read"] == total
        assert abs(seen[0]["read"] - seen[1]["read"]) <= 4 * len(params)  # one element a bucket, fewer buckets
        for s in seen:
            assert s["ahead"] <= s["read"]
    else:
        assert [s["read"] for s in seen] == [total, total]
