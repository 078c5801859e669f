"""Each functional optimizer entry names itself in its errors: a wrong argument to ``sgd_step`` is
reported as ``sgd_step``'s, not ``adam_step``'s (issue 32). A table: every entry times every bad
argument the entries share."""

from __future__ import annotations

import pytest
import torch

from tiermem import ConfigError
from tiermem.optim import (
    adafactor_step,
    adagrad_step,
    adam8bit_step,
    adam_step,
    lion_step,
    quantize_blockwise,
    sgd_step,
)

N = 512  # two whole blocks of the 8-bit state


def _t(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(N, dtype=dtype)


def _adam(master, grad, **kw):
    return adam_step(master, _t(), _t(), grad, **{**dict(beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0), **kw})


def _adam8bit(master, grad, **kw):
    (m, m_max), (v, v_max) = quantize_blockwise(_t()), quantize_blockwise(_t())
    hyper = dict(beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0)
    return adam8bit_step(master, m, m_max, v, v_max, grad, **{**hyper, **kw})


ENTRIES = {
    "adam_step": _adam,
    "adam8bit_step": _adam8bit,
    "sgd_step": lambda master, grad, **kw: sgd_step(master, None, grad, **kw),
    "adagrad_step": lambda master, grad, **kw: adagrad_step(master, _t(), grad, **kw),
    "lion_step": lambda master, grad, **kw: lion_step(master, _t(), grad, **kw),
    "adafactor_step": lambda master, grad, **kw: adafactor_step(master, grad, variance=_t(), **kw),
}

BAD = {
    "fractional step": dict(step=1.5),
    "step 0": dict(step=0),
    "step as a string": dict(step="1"),
    "negative lr": dict(lr=-1.0),
    "negative weight_decay": dict(weight_decay=-1.0),
    "grad_scale 0": dict(grad_scale=0.0),
    "negative clip_coef": dict(clip_coef=-1.0),
    "unknown impl": dict(impl="bogus"),
    "integer grad": dict(grad=torch.zeros(N, dtype=torch.int32)),
    "grad not a tensor": dict(grad=[0.0] * N),
    "integer out": dict(out=torch.zeros(N, dtype=torch.int32)),
    "bf16 master without stochastic_round": dict(master=_t(torch.bfloat16)),
}


@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_each_functional_entry_names_itself_in_its_errors(entry, bad):
    kw = {"master": _t(), "grad": _t(), "step": 1, "lr": 1e-3, **BAD[bad]}
    with pytest.raises(ConfigError) as caught:
        ENTRIES[entry](kw.pop("master"), kw.pop("grad"), **kw)
    assert str(caught.value).startswith(f"tiermem: {entry} "), str(caught.value)
