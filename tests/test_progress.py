"""Progress lines of long work (tiermem/observe/progress.py): bytes done of the total, rate, time
left; at most one line per interval, and one at the end."""

from __future__ import annotations

import logging

import pytest
import torch
from models import TinyGPT
from safetensors.torch import save_file

import tiermem
from tiermem.observe.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lines_say_bytes_rate_and_time_left_at_most_every_interval(caplog):
    clock = Clock()
    p = Progress("reading ckpt", 4 * 2**30, every=5.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="tiermem.observe.progress"):
        clock.now = 2.0
        p.advance(2**30)  # before the interval: no line
        clock.now = 6.0
        p.advance(2**30)  # 2 GiB in 6 s: 341 MiB/s, 2 GiB left: 6 s
        clock.now = 7.0
        p.advance(2**30)  # within 5 s of the last line: none
        clock.now = 12.0
        p.advance(2**30)
        p.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "tiermem: reading ckpt: 2.00 GiB of 4.00 GiB (341.33 MiB/s, 6 s left)",
        "tiermem: reading ckpt: 4.00 GiB of 4.00 GiB (341.33 MiB/s, 0 s left)",
        "tiermem: reading ckpt: 4.00 GiB in 12.0 s (341.33 MiB/s)",
    ]


@pytest.mark.parametrize("weights", [True, False])
def test_building_a_meta_model_says_how_far_it_got(weights, tmp_path, caplog):
    torch.manual_seed(0)
    ckpt = str(tmp_path / "w.safetensors")
    save_file({k: v for k, v in TinyGPT().state_dict().items() if k != "head.weight"}, ckpt)
    with torch.device("meta"):
        model = TinyGPT()
    with caplog.at_level(logging.INFO, logger="tiermem.observe.progress"):
        tm = tiermem.TieredModel(model, precision="fp32", weights=ckpt if weights else None)
        tm.save_pretrained(tmp_path / "out")
    n = sum(p.numel() for p in model.parameters())
    lines = [r.getMessage() for r in caplog.records]
    from tiermem.errors import fmt_bytes

    what = f"reading {ckpt}" if weights else "initializing the model at its homes"
    assert lines[0].startswith(f"tiermem: {what}: {fmt_bytes(n * 4)} in ")
    assert lines[1].startswith(f"tiermem: writing {tmp_path / 'out'}: ")
