"""Multi-node is the same code: ``torchrun --nnodes 2 --nproc_per_node 2`` started twice on this
machine, two "nodes" meeting through the c10d rendezvous, trains examples/train_gpt.py on 4 gloo
ranks with each rank's NVMe files under ``--nvme-dir``/rank<global rank> and writes one
torch.distributed.checkpoint directory that one process here loads. Tiny, with a deadline: it
runs everywhere (2 CPU cores are enough); NCCL on real nodes is the README's."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import torch
from fresh import Python

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.gpt import GPT, GPTConfig, load_tokens  # noqa: E402
from tiermem import AdamW, TieredModel  # noqa: E402

STEPS = 4
DEADLINE = 300  # seconds for both nodes: 6 processes importing torch on 2 cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(port: int, nvme: Path, ck: Path, cwd: Path) -> Python:
    """torchrun's agent, forked (NOTE [Scripts forked from the forkserver] in tests/fresh.py); the
    agent starts its 2 workers as fresh interpreters."""
    cmd = [
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "tiermem-two-nodes",
        "--local-addr",
        "127.0.0.1",
        "--max-restarts",
        "0",
        str(ROOT / "examples" / "train_gpt.py"),
        "--preset",
        "tiny",
        "--seq-len",
        "16",
        "--batch-size",
        "4",
        "--steps",
        str(STEPS),
        "--log-every",
        "2",
        "--warmup",
        "1",
        "--eval-batches",
        "1",
        "--sample-tokens",
        "0",
        "--policy",
        "state-on-nvme",
        "--nvme-dir",
        str(nvme),
        "--save",
        str(ck),
        "--device",
        "cpu",
    ]  # gloo: 4 ranks on any machine, a GPU one too
    env = {**os.environ, "TIERMEM_NO_COMPILE": "1"}  # torch's fused AdamW: no kernel compiled in each of 4 processes
    return Python(*cmd, cwd=cwd, env=env, merge=True)


def test_two_nodes_of_two_ranks_train_the_example_and_checkpoint_it(tmp_path):
    nvme, ck = tmp_path / "nvme", tmp_path / "ck"
    nvme.mkdir()
    port = _free_port()
    nodes = [_node(port, nvme, ck, tmp_path) for _ in range(2)]
    outs = []
    try:
        for p in nodes:
            outs.append(p.communicate(timeout=DEADLINE)[0])
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the two nodes did not finish within {DEADLINE} s") from None
    finally:
        for p in nodes:  # each node's agent and its workers: a session of their own
            if p.poll() is None:
                p.kill()
                p.communicate()
    both = "\n".join(outs)
    assert [p.returncode for p in nodes] == [0, 0], both[-4000:]
    assert both.count("on each of 4 ranks") == 1, both[-4000:]  # global rank 0 alone prints
    assert re.findall(r"^step\s+(\d+)/4 \|", both, re.MULTILINE) == ["2", "4"], both[-4000:]
    assert f"checkpoint written to {ck}" in both
    assert sorted(os.listdir(nvme)) == ["rank0", "rank1", "rank2", "rank3"]  # by global rank, not local
    files = sorted(os.listdir(ck))
    assert [f for f in files if f.endswith(".distcp")] == [f"__{r}_0.distcp" for r in range(4)]
    assert [f for f in files if f.startswith("tiermem-rank")] == [f"tiermem-rank{r}.json" for r in range(4)]
    tok, _ = load_tokens()
    torch.manual_seed(0)
    one = TieredModel(
        GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size, block_size=16)),
        device="cpu",
        optimizer=AdamW(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, no_decay_1d=True),
    )
    one.load(str(ck))  # 4 ranks' shards, every checksum checked, read by one process
    assert one.stepper.steps == STEPS
