"""8-bit optimizer state under data parallelism (NOTE [Chunks cut where the state allows]): each
rank's chunk edges fall on a 256-element block of the parameter they cut, so 2 gloo ranks train
bit for bit like one process accumulating both micro-batches; and the rule itself, on made-up
buckets (where a chunk may be cut, what a rank keeps, what the plan counts)."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch
from models import TinyGPT, gpt_batch, gpt_loss
from ranks import run_ranks
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tiermem import AdamW8bit, TieredModel
from tiermem.optim.formats import state_format
from tiermem.plan.buckets import Bucket
from tiermem.plan.footprint import OPTIM_STATE, footprint
from tiermem.types import Tier

#: one step: after it, parameters with fp32 state (LayerNorm's, below MIN_8BIT) differ from one
#: process's by an ulp (torch's vectorized ops, which update them, round differently at another
#: offset: as with AdamW's fp32 state, tests/test_data_parallel.py), and from the next step on that
#: difference reaches every parameter through the forward
STEPS = 1
MIN_8BIT = 256  # TinyGPT's matrices (888 to 2304 elements) get 8-bit state, its vectors fp32
BUCKET = 4000  # several matrices a bucket: the even share cuts some inside a parameter, off its blocks
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(autouse=True, scope="module")
def _same_kernel_as_the_ranks():
    """The ranks run the reference kernels (tests/ranks.py sets TIERMEM_NO_COMPILE); so does the
    one-process run here (the native kernel is bit-identical to it: tests/test_optim_8bit.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIERMEM_NO_COMPILE", "1")
        yield


def _make(bucket_size: int = BUCKET) -> TieredModel:
    torch.manual_seed(0)
    return TieredModel(
        TinyGPT(),
        optimizer=AdamW8bit(lr=1e-2, weight_decay=0.1, min_8bit_size=MIN_8BIT, bf16_stochastic_round=True),
        precision="bf16",
        bucket_size=bucket_size,
    )


def _rank_8bit(rank: int, world: int):
    tm = _make()
    for i in range(STEPS):
        x, y = gpt_batch(100 * i + rank)
        tm.backward(gpt_loss(tm(x), y))
        tm.step()
    chunks = [
        (b.numel, b.chunk_size(world), [(s.offset, s.numel, s.first) for s in sb.slots])
        for b, sb in zip(tm.layout.buckets, tm.layout.step_buckets)
        if not b.state.elementwise
    ]
    eight = sorted(s.name for b in tm.layout.buckets if not b.state.elementwise for s in b.slots)
    return {k: v.clone() for k, v in tm.state_dict().items()}, chunks, eight


def _rank_checkpoints(rank: int, world: int, tmp: str):
    """A step, then a DCP directory and a one-file checkpoint of it (2 -> 1); the one process's
    DCP directory loaded and saved again (1 -> 2)."""
    tm = _make()
    x, y = gpt_batch(rank)
    tm.backward(gpt_loss(tm(x), y))
    tm.step()
    tm.save(os.path.join(tmp, "by2.dcp"), format="dcp")
    tm.save(os.path.join(tmp, "by2.file"), format="file")  # the state gathered whole (ShardedState.read)
    again = _make(bucket_size=1700)  # another bucket size: the checkpoint is keyed by parameter
    again.load(os.path.join(tmp, "by1.dcp"))
    again.save(os.path.join(tmp, "by1-by2.dcp"), format="dcp")
    return True


def _contents(path: str, tmp: pathlib.Path) -> dict:
    """Everything a DCP directory holds, read by torch alone (less its manifests: the world size)."""
    out = tmp / f"contents-{len(os.listdir(tmp))}.pt"
    dcp_to_torch_save(path, str(out))
    whole = torch.load(out, weights_only=False)
    whole.pop("tiermem_manifests")
    return whole


def _same_tree(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_a_dcp_checkpoint_of_8bit_state_goes_from_2_ranks_to_1_and_from_1_to_2(tmp_path):
    solo = _make()
    x, y = gpt_batch(7)
    solo.backward(gpt_loss(solo(x), y))
    solo.step()
    solo.save(str(tmp_path / "by1.dcp"), format="dcp")
    run_ranks(_rank_checkpoints, str(tmp_path))
    one = _make(bucket_size=1700)
    one.load(str(tmp_path / "by2.dcp"))  # 2 -> 1
    one.save(str(tmp_path / "by2-by1.dcp"), format="dcp")
    one.save(str(tmp_path / "by2-by1.file"), format="file")
    by2 = _contents(str(tmp_path / "by2.dcp"), tmp_path)
    assert any("exp_avg_absmax" in parts for parts in by2["optim"]["state"].values())  # 8-bit state was saved
    assert _same_tree(by2, _contents(str(tmp_path / "by2-by1.dcp"), tmp_path))  # codes, scales, masters: all
    assert _same_tree(
        _contents(str(tmp_path / "by1.dcp"), tmp_path), _contents(str(tmp_path / "by1-by2.dcp"), tmp_path)
    )
    with open(tmp_path / "by2.file", "rb") as a, open(tmp_path / "by2-by1.file", "rb") as b:
        assert a.read() == b.read()  # 2 ranks gather the state whole as one process holds it


def _solo() -> dict:
    tm = _make()
    for i in range(STEPS):
        for r in range(2):
            x, y = gpt_batch(100 * i + r)
            tm.backward(gpt_loss(tm(x), y) / 2)
        tm.step()
    return tm.state_dict()


def test_two_ranks_with_8bit_state_and_bf16_masters_train_bit_for_bit_as_one_process():
    (w0, chunks0, eight), (w1, chunks1, _) = run_ranks(_rank_8bit)
    solo = _solo()
    assert w0.keys() == solo.keys() and eight
    for k in solo:
        assert torch.equal(w0[k], w1[k]), k  # the ranks agree bit for bit
        if k in eight:  # 8-bit state, bf16 masters rounded stochastically: bit for bit, not to a tolerance
            assert torch.equal(w0[k], solo[k]), k
        else:  # fp32 state: an ulp (see STEPS); a wrong update is ~lr = 1e-2 off
            assert (w0[k] - solo[k]).abs().max().item() <= 1e-5, k
    assert chunks0 and chunks1, "no bucket kept 8-bit state"
    firsts = [first for _, _, slots in chunks0 + chunks1 for _, _, first in slots]
    assert all(first % 256 == 0 for first in firsts)  # every piece of a parameter starts on one of its blocks
    assert any(first > 0 for first in firsts), "no parameter was cut: the test would not test the alignment"
    for numel, size, _ in chunks0:
        assert -(-numel // 2) <= size < -(-numel // 2) + 256  # the even share, moved by less than a block


# -- the rule on made-up buckets ------------------------------------------------------------------
def _bucket(sizes, fmt) -> Bucket:
    b = Bucket(0, Tier.HOST, Tier.HOST, 0, state=fmt)
    for i, n in enumerate(sizes):
        b.add(f"p{i}", nn.Parameter(torch.empty(n)), i)
    return b


EIGHT = state_format("adamw8bit", numel=10**6)
FP32 = state_format("adamw")


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("sizes", [[5000], [1000, 3001, 777, 4096], [300, 300, 300], [1, 70000, 13]])
def test_every_chunk_edge_inside_a_parameter_is_on_one_of_its_blocks(sizes, world):
    b = _bucket(sizes, EIGHT)
    size = b.chunk_size(world)
    assert size >= -(-b.numel // world)
    for r in range(1, world):
        edge = r * size
        for s in b.slots:
            if s.offset < edge < s.offset + s.numel:
                assert (edge - s.offset) % 256 == 0, (sizes, world, size, edge)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_elementwise_state_keeps_the_even_share(world):
    b = _bucket([1000, 3001, 777], FP32)
    assert b.chunk_size(world) == -(-b.numel // world)


def test_two_ranks_move_an_edge_by_less_than_a_block():
    b = _bucket([1000, 3001, 777, 4096], EIGHT)
    even = -(-b.numel // 2)
    assert even < b.chunk_size(2) < even + 256


def test_an_indivisible_state_is_cut_only_at_parameter_edges():
    fmt = state_format("adamw")
    whole = type(fmt)(fmt.kind, fmt.parts, divisible=False)
    b = _bucket([1000, 3001, 777], whole)
    size = b.chunk_size(2)
    assert size == 4001  # the first parameter edge at or past the even share (2389)
    assert whole.next_cut(0, 50) == 0 and whole.next_cut(1, 50) == 50 and whole.next_cut(50, 50) == 50
    assert EIGHT.next_cut(1, 1000) == 256 and EIGHT.next_cut(256, 1000) == 256 and EIGHT.next_cut(900, 1000) == 1000


@pytest.mark.parametrize("world", [2, 3])
def test_the_plan_counts_the_most_state_any_rank_keeps(world):
    b = _bucket([1000, 3001, 777, 4096], EIGHT)
    size = b.chunk_size(world)
    kept = []
    for r in range(world):  # each rank's pieces, counted by hand: its absmax holds one per started block
        lo, hi = r * size, min((r + 1) * size, b.numel)
        pieces = [min(s.offset + s.numel, hi) - max(s.offset, lo) for s in b.slots]
        kept.append(sum(-(-n // 256) for n in pieces if n > 0))
    got = b.chunk_part_numels(world)
    assert got[2] == got[4] == max(kept)  # exp_avg_absmax, exp_avg_sq_absmax
    assert got[0] == got[1] == got[3] == size  # master and codes: the padded chunk
    need = footprint([b], [], torch.bfloat16, world=world)[Tier.HOST][OPTIM_STATE]
    assert need == sum(n * p.itemsize for n, p in zip(got, b.state.parts))
