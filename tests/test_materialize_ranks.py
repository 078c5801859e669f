"""Models on the meta device under data parallelism (2 gloo ranks, tests/ranks.py): built from a
checkpoint (``weights=``) or from their modules' initialization, they train bit for bit like the
same values built in memory and wrapped on the same ranks, with weights replicated (ZeRO-2) or
sharded (``shard_weights=True``, ZeRO-3), a frozen layer included."""

from __future__ import annotations

import pytest
import torch
from models import TinyGPT, gpt_batch, gpt_loss
from ranks import run_ranks
from safetensors.torch import save_file

import tiermem
from tiermem.policies import ZeroInfinity, ZeroOffload


class FrozenGPT(TinyGPT):
    def __init__(self):
        super().__init__()
        self.blocks[0].fc.requires_grad_(False)


def _ranks_train(rank: int, world: int, ckpt: str, nvme: str, shard: bool, policy: str) -> dict:
    """On each rank: the model built in memory from ``ckpt`` and the same model built on meta with
    ``weights=ckpt`` (or, ckpt == "", both from their initialization with seed 0), 3 steps of each on
    this rank's batches; both final states."""
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
        tm = tiermem.TieredModel(
            model,
            pol,
            precision="fp32",
            nvme_dir=f"{nvme}/{how}",
            shard_weights=shard,
            weights=ckpt if (ckpt and how == "meta") else None,
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
