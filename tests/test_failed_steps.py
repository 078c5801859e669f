"""Failure paths of a step that other tests leave out: an update that fails in the background under
overlap_step (NOTE [A failed background update] in tiermem/train/stepper.py)."""

from __future__ import annotations

import errno
import os
import tempfile
import threading

import pytest
import torch
from models import forward_at, gpt_batch, gpt_loss, same_state, train_steps as _train
from test_nvme_state import StateOnNvme, _files_fail, _make

from tiermem import StoreError, Tier, TierMemError
from tiermem.policies import ZeroInfinity


class _files_fail_later(_files_fail):
    """:class:`_files_fail` whose first failing write waits for :attr:`go` before it fails: the
    next forward and backward run while the update in the background is still going."""

    def __init__(self, store, prefixes):
        super().__init__(store, prefixes)
        self.go = threading.Event()

    def fails(self, fd: int) -> bool:
        failing = super().fails(fd)
        if failing:
            assert self.go.wait(60), "the test never let the write fail"
        return failing


def _pair(policy: str):
    make = {"zero_infinity": ZeroInfinity, "state_on_nvme": StateOnNvme}[policy]
    ref = _make(make(), tempfile.mkdtemp(), overlap_step=True)
    tm = _make(make(), tempfile.mkdtemp(), overlap_step=True)
    return ref, tm


@pytest.mark.parametrize("policy", ["zero_infinity", "state_on_nvme"])
def test_a_failed_background_update_refuses_the_next_forward_and_a_retry_matches(policy):
    """overlap_step: the update of step 3 fails in the background (bucket 0's state cannot be
    written, bucket 1's lands). The next forward is refused with the error and a note saying to
    call tm.step() again; that retry completes the update, and the run then trains bit for bit
    like one that never failed (same policy, overlap_step too)."""
    ref, tm = _pair(policy)
    ref_losses = _train(ref, 5)
    _train(tm, 2)
    x, y = gpt_batch(2)
    tm.backward(gpt_loss(tm(x), y))
    probe = gpt_batch(99)[0]
    with _files_fail(tm.stores[Tier.NVME], ("bucket0_state.",)):
        tm.step()
        handle = tm.stepper._background[0]
        while not handle.done():
            threading.Event().wait(0.01)
    with pytest.raises(StoreError, match=os.strerror(errno.EIO)) as e:
        with torch.no_grad():
            tm(probe)
    assert any(n.startswith("tiermem:") and "tm.step() again" in n for n in getattr(e.value, "__notes__", []))
    with pytest.raises(TierMemError, match=r"^tiermem: tm\(\.\.\.\) would use weights of two steps.*tm\.step\(\)"):
        tm(probe)  # still refused: nothing was retried
    assert not tm.step().skipped  # the retry: what is left of step 3's update runs in the background again
    assert _train(tm, 2, offset=3) == ref_losses[3:]
    assert same_state(tm.state_dict(), ref.state_dict())
    with torch.no_grad():
        assert torch.equal(tm(probe), forward_at(ref.state_dict(), probe, tm.device))


@pytest.mark.parametrize("policy", ["zero_infinity", "state_on_nvme"])
def test_a_background_update_that_fails_during_the_next_backward(policy):
    """overlap_step: the update of step 3 fails only once the forward and backward of step 4 ran
    (on the weights of step 2, as overlap_step does). Step 4's tm.step() raises the error; its
    retry completes step 3 and then takes step 4: bit for bit the run that never failed."""
    ref, tm = _pair(policy)
    ref_losses = _train(ref, 6)
    _train(tm, 2)
    x, y = gpt_batch(2)
    tm.backward(gpt_loss(tm(x), y))
    with _files_fail_later(tm.stores[Tier.NVME], ("bucket0_state.",)) as failing:
        tm.step()
        x, y = gpt_batch(3)
        loss = gpt_loss(tm(x), y)
        tm.backward(loss)
        failing.go.set()
        with pytest.raises(StoreError, match=os.strerror(errno.EIO)):
            tm.step()
    assert loss.item() == ref_losses[3]
    assert not tm.step().skipped  # completes step 3, then takes step 4
    assert _train(tm, 2, offset=4) == ref_losses[4:]
    assert same_state(tm.state_dict(), ref.state_dict())


def test_a_checkpoint_loaded_after_a_failed_background_update(tmp_path):
    """The other way out of a failed background update (ZeRO-Infinity, overlap_step): tm.load()
    of the checkpoint before the step; training from it gives the bits of the run that never
    failed, also when the failure was never reported before the load."""
    ref, tm = _pair("zero_infinity")
    _train(ref, 2)
    ref.save(str(tmp_path / "ref.tm"))  # the oracle loads at the same point (the save lands step 2's update,
    ref.load(str(tmp_path / "ref.tm"))  # which the forward of step 3 would not have seen under overlap_step)
    ref_losses = _train(ref, 3, offset=2)
    _train(tm, 2)
    ckpt = str(tmp_path / "two.tm")
    tm.save(ckpt)
    x, y = gpt_batch(2)
    tm.backward(gpt_loss(tm(x), y))
    with _files_fail(tm.stores[Tier.NVME], ("bucket0_state.",)):
        tm.step()
        handle = tm.stepper._background[0]
        while not handle.done():
            threading.Event().wait(0.01)
    tm.load(ckpt)  # the failure, never reported, is dropped with what it left to do
    assert _train(tm, 3, offset=2) == ref_losses
    assert same_state(tm.state_dict(), ref.state_dict())
