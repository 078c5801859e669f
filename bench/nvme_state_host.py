"""Host bytes of the NVMe state pipeline when one parameter dwarfs the others.

    python bench/nvme_state_host.py [--width 256] [--layers 4] [--ratio 10]

A GPT-like stack of ``--layers`` blocks (fc and proj, ``width`` x 4*``width`` each) with a token
embedding ``--ratio`` times one block's size, trained for two steps in bf16 with its optimizer
state on NVMe (ZeroOffload with OPTIM_STATE on NVMe) and ``bucket_size`` set to one block. The
pipeline (NOTE [Three-stage state pipeline]) holds three host sets, each as large as the
largest bucket; this prints what they hold against two anchors measured in the same run: the
sets as the typical (block) bucket would size them, and the model's whole optimizer state.
The ratio of the sets to the whole state is printed last.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiermem import TensorClass, Tier, TieredModel
from tiermem.policies import ZeroOffload


class StateOnNvme(ZeroOffload):
    homes = {**ZeroOffload.homes, TensorClass.OPTIM_STATE: Tier.NVME}


class Model(nn.Module):
    def __init__(self, width: int, layers: int, vocab: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width, bias=False), nn.GELU(), nn.Linear(4 * width, width, bias=False))
            for _ in range(layers)
        )

    def forward(self, idx):
        x = self.wte(idx)
        for b in self.blocks:
            x = x + b(x)
        return x.float().pow(2).mean()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ratio", type=int, default=10)
    a = ap.parse_args()
    block = 8 * a.width * a.width  # params of one block
    vocab = a.ratio * block // a.width
    model = Model(a.width, a.layers, vocab)
    with tempfile.TemporaryDirectory() as d, TieredModel(model, StateOnNvme(), nvme_dir=d, bucket_size=4 * block) as tm:
        for i in range(2):
            idx = torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(i))
            tm.backward(tm(idx))
            tm.step()
        host = tm.stores[Tier.HOST].ledger
        sets = sum(host.held(f"nvme state set{i}") for i in range(3))
        largest = max(b.numel for b in tm.layout.buckets)
        typical = sorted(b.numel for b in tm.layout.buckets)[len(tm.layout.buckets) // 2]
        n_params = sum(p.numel() for p in model.parameters())
    state = 12 * n_params  # fp32 master, exp_avg, exp_avg_sq
    print(
        f"params {n_params:,}; embedding {vocab * a.width:,} = {a.ratio}x a block ({block:,}); "
        f"buckets: largest {largest:,}, median {typical:,} elements"
    )
    print(f"host sets now:               {sets / 2**20:8.2f} MiB (3 x 12 B x largest bucket)")
    print(f"anchor, sets by the median:  {3 * 12 * typical / 2**20:8.2f} MiB")
    print(f"anchor, the whole state:     {state / 2**20:8.2f} MiB")
    print(f"sets / sets by the median: {sets / (3 * 12 * typical):.2f}x; sets / whole state: {sets / state:.2f}x")


if __name__ == "__main__":
    main()
