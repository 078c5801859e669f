"""``tiermem.optim.formats.update`` (with ``hyper_record``) runs the update of the kind it is given, or refuses: a kind it has no
fused update for ("generic", whose optimizer steps itself, or one that bypassed StateFormat's check)
raises instead of running Lion's update (issue 32)."""

from __future__ import annotations

import pytest
import torch

from tiermem import ConfigError
from tiermem.optim import formats
from tiermem.optim.formats import StateFormat, StatePart

# what Lion's update reads: a group that a wrong default would silently step with
HYPER = {"lr": 0.1, "betas": (0.9, 0.99), "weight_decay": 0.0}


def _step(fmt: StateFormat, master: torch.Tensor, state: list, grad: torch.Tensor) -> None:
    """One update at step 1, as the step runs it: the group's record, then the kind's kernel."""
    record = formats.hyper_record(fmt, HYPER, step=1, grad_scale=1.0, clip_coef=1.0)
    formats.update(fmt, master, state, grad, record, out=None)


def _generic() -> StateFormat:
    return StateFormat("generic", (StatePart("master", torch.float32), StatePart("exp_avg", torch.float32)))


def _bypassed() -> StateFormat:
    fmt = _generic()
    object.__setattr__(fmt, "kind", "rmsprop")  # a kind StateFormat's own check would refuse
    return fmt


@pytest.mark.parametrize("make", [_generic, _bypassed], ids=["generic", "unknown"])
def test_a_kind_without_a_fused_update_is_refused_and_nothing_changes(make):
    fmt = make()
    master, state, grad = torch.ones(8), torch.zeros(8), torch.full((8,), 0.5)
    with pytest.raises(ConfigError, match=rf"tiermem: formats.update has no fused update for kind='{fmt.kind}'"):
        _step(fmt, master, [state], grad)
    assert torch.equal(master, torch.ones(8)) and torch.equal(state, torch.zeros(8))


def test_lion_still_steps():
    fmt = formats.state_format("lion")
    master, state, grad = torch.ones(8), torch.zeros(8), torch.full((8,), 0.5)
    _step(fmt, master, [state], grad)
    # Lion: sign(0.1 * 0 + 0.9 * 0.5) = 1, so master - lr; exp_avg = 0.99 * 0 + 0.01 * 0.5
    assert torch.equal(master, torch.full((8,), 1.0 - 0.1, dtype=torch.float32))
    assert torch.equal(state, torch.full((8,), 0.5, dtype=torch.float32) * torch.tensor(0.01, dtype=torch.float32))
