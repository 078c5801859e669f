"""After an update that failed part way (overlap_step: in the background), ``tm.state_dict()`` and
``tm.detach()`` refuse as ``tm.save()`` does instead of giving weights of two steps (issue 32): the
update's error once, then a tiermem: error saying to call tm.step() again; after that retry both
give the weights of the run that never failed."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from models import gpt_batch, gpt_loss, same_state, train_steps
from test_failed_steps import _pair, fail_in_the_background
from test_nvme_state import StateOnNvme, _disk_fails, _make

from tiermem import StoreError, Tier, TierMemError

TWO_STEPS = r"^tiermem: {} would use weights of two steps: the last tm\.step\(\) failed part way.*tm\.step\(\) again"


@pytest.mark.parametrize("policy", ["zero_infinity", "state_on_nvme"])
def test_state_dict_and_detach_refuse_a_failed_background_update_as_save_does(policy, tmp_path):
    ref, tm = _pair(policy)
    train_steps(ref, 3)
    train_steps(tm, 2)
    fail_in_the_background(tm)
    with pytest.raises(StoreError, match=os.strerror(errno.EIO)) as e:
        tm.state_dict()  # the update's own error, once, as the next forward or save would raise it
    assert any(n.startswith("tiermem:") and "tm.step() again" in n for n in getattr(e.value, "__notes__", []))
    with pytest.raises(TierMemError, match=TWO_STEPS.format(r"tm\.state_dict\(\)")):
        tm.state_dict()
    with pytest.raises(TierMemError, match=TWO_STEPS.format(r"tm\.save\(\)")):
        tm.save(str(tmp_path / "mixed.tm"))
    with pytest.raises(TierMemError, match=TWO_STEPS.format(r"tm\.detach\(\)")):
        tm.detach()
    assert next(tm.module.parameters()).dtype == torch.bfloat16  # still wrapped: nothing was given back
    assert not tm.step().skipped  # the retry completes step 3
    assert same_state(tm.state_dict(), ref.state_dict())
    trained = ref.state_dict()
    module = tm.detach()
    assert all(torch.equal(p.detach(), trained[n]) for n, p in module.named_parameters())


def test_detach_refuses_a_step_that_failed_part_way_in_the_foreground(tmp_path):
    """Without overlap_step: a write that fails after some buckets landed (as in
    tests/test_nvme_state.py); detach() refuses, and after the retry gives the stepped weights."""
    (tmp_path / "ref").mkdir()
    (tmp_path / "tm").mkdir()
    ref, tm = _make(StateOnNvme(), tmp_path / "ref"), _make(StateOnNvme(), tmp_path / "tm")
    train_steps(ref, 3)
    train_steps(tm, 2)
    x, y = gpt_batch(2)
    tm.backward(gpt_loss(tm(x), y))
    with _disk_fails(tm.stores[Tier.NVME], after=9, code=errno.EIO):
        with pytest.raises(StoreError):
            tm.step()
    with pytest.raises(TierMemError, match=TWO_STEPS.format(r"tm\.detach\(\)")):
        tm.detach()
    with pytest.raises(TierMemError, match=TWO_STEPS.format(r"tm\.state_dict\(\)")):
        tm.state_dict()
    tm.step()
    trained = ref.state_dict()
    module = tm.detach()
    assert all(torch.equal(p.detach(), trained[n]) for n, p in module.named_parameters())
