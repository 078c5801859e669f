"""A module attached to the wrapped model after wrapping (issue 32): the next forward or step
refuses it with a tiermem: error that says what to do; detach() is all or nothing: it gives the
wrapped parameters their fp32 weights and the added ones back as they are, or, when a wrapped
parameter is gone, changes nothing (NOTE [The parameters a model was wrapped with])."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tiermem import ConfigError, TieredModel
from tiermem.policies import KeepOnDevice, ZeroInfinity, ZeroOffload


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def _train_step(tm: TieredModel) -> None:
    tm.backward(tm(torch.ones(2, 4)).float().square().sum())
    tm.step()


def _policies(tmp_path):
    return {
        "offload": dict(policy=ZeroOffload()),
        "device": dict(policy=KeepOnDevice()),
        "infinity": dict(policy=ZeroInfinity(), nvme_dir=str(tmp_path)),
    }


CHANGED = r"the module's parameters changed after it was wrapped \(added: 2\.weight, 2\.bias\).*tm\.detach\(\)"


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_module_attached_after_wrapping_is_refused_at_the_next_forward(precision):
    model = _model()
    tm = TieredModel(model, precision=precision)
    _train_step(tm)
    model.append(nn.Linear(4, 4))  # Sequential's forward runs it
    with pytest.raises(ConfigError, match=r"^tiermem: tm\(\.\.\.\): " + CHANGED):
        tm(torch.ones(2, 4))
    with pytest.raises(ConfigError, match=r"^tiermem: tm\(\.\.\.\): " + CHANGED):  # and again: nothing changed
        tm(torch.ones(2, 4))
    del model[2]  # undone: the model trains on
    _train_step(tm)


def test_a_module_attached_between_backward_and_step_is_refused_at_the_step():
    model = _model()
    tm = TieredModel(model, precision="fp32")
    tm.backward(tm(torch.ones(2, 4)).square().sum())
    model.append(nn.Linear(4, 4))
    with pytest.raises(ConfigError, match=r"^tiermem: step\(\): " + CHANGED):
        tm.step()


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("where", ["offload", "device", "infinity"])
def test_detach_after_a_module_was_attached_gives_everything_back(where, precision, tmp_path, caplog):
    model = _model()
    tm = TieredModel(model, precision=precision, **_policies(tmp_path)[where])
    _train_step(tm)
    trained = {k: v.clone() for k, v in tm.state_dict().items()}
    extra = nn.Linear(4, 4)
    extra_before = {k: v.clone() for k, v in extra.state_dict().items()}
    model.extra = extra
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        out = tm.detach()
    assert out is model
    for name, p in model.named_parameters():
        if name.startswith("extra."):
            assert p is getattr(extra, name.removeprefix("extra.")) and torch.equal(p, extra_before[name[6:]])
        else:
            assert p.dtype == torch.float32 and torch.equal(p.detach(), trained[name]), name
    assert any(
        "extra.weight, extra.bias were added to the module after it was wrapped" in r.getMessage()
        for r in caplog.records
    )
    # wrapped again, it trains every parameter, the attached one too
    again = TieredModel(model, precision=precision, **_policies(tmp_path)[where])
    before = extra.weight.detach().clone()
    again.backward(again(torch.ones(2, 4)).float().square().sum())  # Sequential's forward runs extra too
    again.step()
    assert not torch.equal(again.state_dict()["extra.weight"], before)
    again.detach()


def test_detach_changes_nothing_when_a_wrapped_parameter_is_gone():
    model = _model()
    tm = TieredModel(model, precision="bf16")
    _train_step(tm)
    trained = {k: v.clone() for k, v in tm.state_dict().items()}
    original = model[0].weight
    model[0].weight = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(
        ConfigError,
        match=r"^tiermem: detach\(\): the module no longer has parameters it was "
        r"wrapped with \(replaced or deleted: 0\.weight\).*nothing was changed",
    ):
        tm.detach()
    with pytest.raises(ConfigError, match=r"replaced or deleted: 0\.weight"):  # a retry says the same
        tm.detach()
    assert original.dtype == torch.bfloat16  # the working copies and hooks are still the model's
    model[0].weight = original  # put back: the model trains and detaches as before
    assert torch.equal(tm.state_dict()["0.weight"], trained["0.weight"])
    _train_step(tm)
    after = {k: v.clone() for k, v in tm.state_dict().items()}
    out = tm.detach()
    assert all(torch.equal(p.detach(), after[n]) and p.dtype == torch.float32 for n, p in out.named_parameters())
