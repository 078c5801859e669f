"""Small models as users write them, shared by the model tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(3 * d, d)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class TinyGPT(nn.Module):
    """Token embedding tied to the output head, nested blocks, odd sizes."""

    def __init__(self, vocab: int = 37, d: int = 24, n_layer: int = 2, seq: int = 11):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


class Quirky(nn.Module):
    """Buffers (BatchNorm running stats), a frozen layer, a branch that gets no grad unless
    asked, and several outputs."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(13, 17, bias=False)  # a bias before BatchNorm has zero true grad: Adam would amplify noise
        self.bn = nn.BatchNorm1d(17)
        self.frozen = nn.Linear(17, 17)
        self.frozen.requires_grad_(False)
        self.branch = nn.Linear(17, 5)
        self.out = nn.Linear(17, 3)

    def forward(self, x, use_branch: bool = False):
        h = torch.relu(self.bn(self.inp(x)))
        h = self.frozen(h)
        y = self.out(h)
        z = self.branch(h) if use_branch else None
        return y, z


def gpt_batch(seed: int, vocab: int = 37, batch: int = 3, seq: int = 11):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def gpt_loss(logits, y):
    y = y.to(logits.device)  # the targets follow the logits (on a GPU machine tests train on cuda by default)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def train_steps(tm, steps: int, offset: int = 0) -> list[float]:
    """``steps`` steps of ``tm`` on ``gpt_batch(offset)``, ``gpt_batch(offset + 1)``, ...; the losses."""
    losses = []
    for i in range(offset, offset + steps):
        x, y = gpt_batch(i)
        loss = gpt_loss(tm(x), y)
        tm.backward(loss)
        losses.append(loss.item())
        tm.step()
    return losses


class disk_fills_up:
    """Within ``with disk_fills_up(store, after=n):`` the NVMe store's writes fail with ENOSPC
    once ``n`` write calls have gone through (so part of a step has landed when the disk fills)."""

    def __init__(self, store, after: int):
        self.store, self.after, self.calls = store, after, 0

    def __enter__(self):
        import errno

        real = self.real = self.store._pwritev

        def write(fd, bufs, offset):
            self.calls += 1
            if self.calls > self.after:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, bufs, offset)

        self.store._pwritev = write
        return self

    def __exit__(self, *exc):
        self.store._pwritev = self.real


def forward_at(state: dict, x: torch.Tensor, device, make=TinyGPT) -> torch.Tensor:
    """Plain PyTorch's oracle of a bf16 forward: ``make()`` holding ``state`` (fp32 master weights,
    as ``tm.state_dict()`` gives them) rounded to bf16, on ``device`` (the TieredModel's), on
    ``x``, without grad."""
    m = make()
    m.load_state_dict(state)
    m.to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        return m(x.to(device))


def same_state(a: dict, b: dict) -> bool:
    """Two state dicts with the same keys and bit-identical tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run_python(script: str, *, timeout: float, hang: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (dedented) in a fresh interpreter that imports tiermem from this tree and
    these helpers (``from models import ...``); fails the test with ``hang`` if it runs past
    ``timeout`` seconds (a deadlock stays in the child), and with the child's stderr if it fails."""
    tests = os.path.dirname(os.path.abspath(__file__))
    path = [os.path.dirname(tests), tests, os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        pytest.fail(hang)
    assert done.returncode == 0, done.stderr[-2000:]
    return done
