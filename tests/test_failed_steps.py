"""Failure paths of a step that other tests leave out: an update that fails in the background under
overlap_step (NOTE [A failed background update] in tiermem/train/step/background.py), and an NVMe write that
fails on one rank of two under data parallelism."""

from __future__ import annotations

import errno
import os
import tempfile
import threading
from datetime import timedelta

import pytest
import torch
from models import forward_at, gpt_batch, gpt_loss, same_state, train_steps as _train
from ranks import run_ranks
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


def _background_done(tm) -> None:
    """Wait until the update ``tm`` runs in the background (overlap_step), if any, has ended: the
    files made to fail next must fail that step's writes, not the previous step's, which may still be
    writing (a race that failed CI on a loaded machine: the previous step's write waited on ``go``)."""
    if tm.stepper.background.in_flight is None:
        return
    handle = tm.stepper.background.in_flight.handle
    while not handle.done():
        threading.Event().wait(0.01)


def fail_in_the_background(tm) -> None:
    """Step 3 of ``tm`` (two steps trained, overlap_step) fails in the background: bucket 0's state
    is not written; returns once the background update has ended."""
    x, y = gpt_batch(2)
    tm.backward(gpt_loss(tm(x), y))
    _background_done(tm)
    with _files_fail(tm.stores[Tier.NVME], ("bucket0_state.",)):
        tm.step()
        _background_done(tm)


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
    _background_done(tm)
    with _files_fail(tm.stores[Tier.NVME], ("bucket0_state.",)):
        tm.step()
        _background_done(tm)
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
    _background_done(tm)
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
    fail_in_the_background(tm)
    tm.load(ckpt)  # the failure, never reported, is dropped with what it left to do
    assert _train(tm, 3, offset=2) == ref_losses
    assert same_state(tm.state_dict(), ref.state_dict())


# -- data parallelism: a step that fails on one rank -----------------------------------------------
def _attempt(log: list, what: str, call):
    """``call()``; logs ``(what, None)``, or ``(what, "<type>: <message and notes>")`` if it raised a
    tiermem error (any other error fails the rank, and the test)."""
    try:
        out = call()
    except TierMemError as e:
        log.append((what, f"{type(e).__name__}: {e} {' '.join(getattr(e, '__notes__', []))}"))
        return None
    log.append((what, None))
    return out


def _rank_write_fails(rank, world, directory, failing, overlap=False):
    """Two steps on 2 ranks, state on NVMe; rank 1's state writes named by ``failing`` fail in step 3.
    Then each rank tries what a training loop would: a forward, the retry, one more step. Returns
    what each call raised, and the working weights after step 3 and at the end."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=5))  # a rank left waiting fails soon
    tm = _make(StateOnNvme(), directory, precision="fp32", bucket=3000, process_group=group, overlap_step=overlap)
    log: list = []

    def step(i):
        x, y = gpt_batch(100 * i + rank)
        tm.backward(gpt_loss(tm(x), y))
        tm.step()

    step(0)
    step(1)
    x, y = gpt_batch(200 + rank)
    tm.backward(gpt_loss(tm(x), y))
    _background_done(tm)  # overlap_step: step 2's update has landed before the files fail
    with _files_fail(tm.stores[Tier.NVME], failing if rank == 1 else ("/nothing/",)):
        _attempt(log, "step 3", tm.step)
        _background_done(tm)  # overlap_step: rank 1's update fails while the files do
    weights = [p.detach().clone() for p in tm.module.parameters()]
    with torch.no_grad():
        _attempt(log, "forward", lambda: tm(gpt_batch(99)[0]))
    _attempt(log, "retry", tm.step)
    _attempt(log, "step 4", lambda: step(3))
    return log, weights, [p.detach().clone() for p in tm.module.parameters()]


@pytest.mark.parametrize("failing", [("bucket0_state.",), ("",)], ids=["first-bucket", "every-write"])
def test_a_write_that_fails_on_one_rank_stops_every_rank(tmp_path, failing):
    """Rank 1's NVMe state write fails in step 3 (docs/fault-tolerance.md: under data parallelism
    the way out is a checkpoint). What happens today on both ranks: step 3 raises a ``tiermem:``
    error on each (rank 1's names the disk's error), the forward after it is refused on each,
    every later call raises a ``tiermem:`` error or leaves both ranks' weights equal, and nothing
    hangs: no rank trains on, silently, with weights that differ from the other's."""
    results, errors = run_ranks(_rank_write_fails, str(tmp_path), failing, deadline=90, allow_errors=True)
    assert not errors, errors  # no rank hung or died
    (log0, after0, end0), (log1, after1, end1) = results[0], results[1]
    for log in (log0, log1):
        assert log[0][1] is not None and log[0][1].split(": ", 1)[1].startswith("tiermem:"), log
        assert log[1][1] is not None and "would use weights of two steps" in log[1][1], log
        assert all(raised is None or "tiermem:" in raised for _, raised in log), log
    assert os.strerror(errno.EIO) in log1[0][1], log1[0][1]  # the failing rank is told why
    assert all(torch.equal(a, b) for a, b in zip(after0, after1))
    assert all(torch.equal(a, b) for a, b in zip(end0, end1)) or all(
        raised is not None for log in (log0, log1) for what, raised in log if what == "step 4"
    )


def test_an_update_that_fails_in_the_background_on_one_rank_stops_every_rank(tmp_path):
    """The same under overlap_step: rank 1's update of step 3 fails in the background. Rank 1's next
    call raises the disk's error; every call after it, on either rank, raises a ``tiermem:`` error
    or leaves both ranks' weights equal (there is no retry under data parallelism: restart the
    ranks and load a checkpoint); nothing hangs, and both ranks end with the same weights."""
    results, errors = run_ranks(
        _rank_write_fails, str(tmp_path), ("bucket0_state.",), True, deadline=90, allow_errors=True
    )
    assert not errors, errors
    (log0, after0, end0), (log1, after1, end1) = results[0], results[1]
    assert log1[1][1] is not None and os.strerror(errno.EIO) in log1[1][1], log1  # the forward after it
    assert log1[2][1] is not None and "tm.load() the last checkpoint" in log1[2][1], log1  # no retry
    for log in (log0, log1):
        assert all(raised is None or "tiermem:" in raised for _, raised in log), log
        assert log[3][1] is not None, log  # step 4 trains on no rank
    assert all(torch.equal(a, b) for a, b in zip(after0, after1))
    assert all(torch.equal(a, b) for a, b in zip(end0, end1))
