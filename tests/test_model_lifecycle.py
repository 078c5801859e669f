"""What a TieredModel holds (threads, host memory, NVMe files and the directory's lock) goes back
when it is detached, left by a ``with`` block, or dropped (NOTE [A dropped model lets go])."""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
import weakref

import forked
import pytest
import torch
from models import TinyGPT, gpt_batch, gpt_loss, run_python, train_steps

from tiermem import ConfigError, Phase, Tier, TieredModel, TierMemError
from tiermem.memory import deferred
from tiermem.policies import ZeroInfinity


def _threads() -> set[threading.Thread]:
    """Live threads but those a process keeps: the release worker (NOTE [Finalizers only enqueue])
    and, on a GPU, the one thread that pins host memory (NOTE [Registering host memory]), which
    the first model of a process starts."""
    return {
        t
        for t in threading.enumerate()
        if t.is_alive() and t.name != "tiermem-release" and not t.name.startswith("tiermem-pin")
    }


def _files(directory) -> list[str]:
    return sorted(os.listdir(directory))


def _build(model, nvme_dir) -> TieredModel:
    """Weights and optimizer state on NVMe: every kind of thing a model holds is there."""
    return TieredModel(model, ZeroInfinity(), nvme_dir=str(nvme_dir), precision="bf16", bucket_size=4096)


def test_a_dropped_model_gives_back_threads_memory_files_and_lock(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tiermem")
    model = TinyGPT()
    before = _threads()
    tm = _build(model, tmp_path)
    train_steps(tm, 2)
    assert _threads() - before  # lanes and NVMe I/O threads run
    assert any(f != "tiermem.lock" for f in _files(tmp_path))
    host_ledger = tm.stores[Tier.HOST].ledger
    assert host_ledger.used > 0
    alive = [weakref.ref(o) for o in (tm, tm.engine, tm.grads, *tm.stores.values())]
    del tm
    deferred.collect()  # gc.collect(), then wait for the release worker
    gc.collect()  # what it gave back holds reference cycles of its own
    assert [r() for r in alive] == [None] * len(alive)
    assert not {t for t in _threads() - before if t.name.startswith("tiermem")}
    assert _files(tmp_path) == []  # slot files deleted, the lock let go
    assert host_ledger.used == 0
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())  # no hook left on the module
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert "dropped without detach()" in caplog.text
    again = _build(TinyGPT(), tmp_path)  # the directory is free for the next model
    assert all(l == l for l in train_steps(again, 1))  # noqa: E741 - finite losses
    again.detach()


def test_the_next_model_on_a_directory_builds_right_after_a_drop(tmp_path):
    model = TinyGPT()
    tm = _build(model, tmp_path)
    train_steps(tm, 1)
    del tm
    gc.collect()  # the release runs on its worker; the next construction waits for it
    # its weights lived on NVMe and went with it: wrapping the same module again says so, and
    # gives back what it took (the directory too)
    with pytest.raises(TierMemError, match="dropped without detach.*build the module again"):
        _build(model, tmp_path)
    _build(TinyGPT(), tmp_path).detach()  # same directory, right away


def test_rebuilding_in_a_loop_holds_one_model_at_a_time(tmp_path):
    before = _threads()
    for _ in range(3):
        tm = _build(TinyGPT(), tmp_path)
        train_steps(tm, 1)
        del tm  # a notebook user rebuilding the model
    deferred.collect()
    assert not {t for t in _threads() - before if t.name.startswith("tiermem")}
    assert _files(tmp_path) == []


def test_a_model_still_referenced_is_not_torn_down(tmp_path):
    holder = [_build(TinyGPT(), tmp_path)]
    losses = train_steps(holder[0], 1)
    gc.collect()
    with pytest.raises(ConfigError, match=f"pid {os.getpid()}.*del tm"):  # still the directory's owner
        _build(TinyGPT(), tmp_path)
    losses += train_steps(holder[0], 1, offset=1)
    assert all(l == l for l in losses)  # noqa: E741
    holder[0].detach()
    assert _files(tmp_path) == []


def test_a_scheduler_keeps_the_optimizer_not_the_model(tmp_path):
    tm = _build(TinyGPT(), tmp_path)
    sched = torch.optim.lr_scheduler.LambdaLR(tm.optimizer, lambda step: 0.5)
    train_steps(tm, 1)
    sched.step()
    dropped = weakref.ref(tm)
    del tm
    deferred.collect()
    assert dropped() is None and _files(tmp_path) == []
    with pytest.raises(TierMemError, match="TieredModel of this optimizer was dropped"):
        sched.optimizer.step()


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # a finalizer's error is only a warning
def test_dropped_on_a_tiermem_thread_gives_back_from_another(tmp_path):
    """A finalizer runs on the thread that dropped the last reference, or ran the collection: on a
    lane thread, closing the engine there would join the thread itself."""
    holder = [_build(TinyGPT(), tmp_path)]
    train_steps(holder[0], 1)
    engine = holder[0].engine
    engine.run_async(holder.clear).wait(timeout=60)  # the last reference goes on the engine's compute lane
    deferred.settle()
    assert _files(tmp_path) == []
    _build(TinyGPT(), tmp_path).detach()


def test_with_block_detaches_on_the_way_out(tmp_path):
    model = TinyGPT()
    with _build(model, tmp_path) as tm:
        train_steps(tm, 2)
        trained = tm.state_dict()
    assert tm.phase is Phase.DETACHED
    assert _files(tmp_path) == []
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), trained[name]), name


def test_with_block_that_raises_gives_back_and_keeps_its_error(tmp_path):
    model = TinyGPT()
    with pytest.raises(RuntimeError, match="boom"):
        with _build(model, tmp_path) as tm:
            train_steps(tm, 1)
            x, y = gpt_batch(5)
            tm.backward(gpt_loss(tm(x), y))  # grads wait for a step
            raise RuntimeError("boom")
    assert tm.phase is Phase.DETACHED and _files(tmp_path) == []
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())


def test_detach_returns_the_module_once_and_refuses_after(tmp_path):
    model = TinyGPT()
    tm = _build(model, tmp_path)
    train_steps(tm, 1)
    assert tm.detach() is model
    with pytest.raises(ConfigError, match="detached"):
        tm.detach()
    with tm:  # leaving a detached model's block changes nothing
        pass
    assert _files(tmp_path) == []


def test_a_module_has_one_live_tiered_model_at_a_time(tmp_path):
    model = TinyGPT()
    tm = TieredModel(model, precision="fp32")
    for wrap in (model, model.blocks[0], model.blocks):  # the module, a part of it
        with pytest.raises(ConfigError, match=r"a live TieredModel already wraps .*tm\.detach\(\).*del tm"):
            TieredModel(wrap, precision="fp32")
    outer = torch.nn.Sequential(model)  # or a module around it
    with pytest.raises(ConfigError, match=r"already wraps its submodule '0'"):
        TieredModel(outer, precision="fp32")
    train_steps(tm, 1)  # the refused ones changed nothing
    tm.detach()
    again = TieredModel(model, precision="fp32")
    del again  # dropped: the module is free again
    TieredModel(model, precision="fp32").detach()


def test_a_failed_construction_leaves_the_module_and_directory_as_they_were(tmp_path, monkeypatch):
    import errno

    from tiermem.memory.nvme import NvmeStore

    model = TinyGPT()
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    threads = _threads()

    def full(self, fd, bufs, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(NvmeStore, "_pwritev", full)
    with pytest.raises(TierMemError, match="No space left"):
        _build(model, tmp_path)  # writing the first weights to NVMe fails part way through construction
    for n, p in model.named_parameters():
        assert p is before[n][0] and p.dtype == torch.float32 and torch.equal(p.detach(), before[n][1]), n
        assert not p._post_accumulate_grad_hooks
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert not {t for t in _threads() - threads if t.name.startswith("tiermem")}
    assert _files(tmp_path) == []
    monkeypatch.undo()  # the disk has room again: the same module and directory build
    tm = _build(model, tmp_path)
    train_steps(tm, 1)
    tm.detach()


def _in_forked_child(body, timeout: float = 30.0) -> int:
    """Run ``body`` (returning an exit code) in a forked child; its exit code. A child still
    running after ``timeout`` seconds is killed and the test fails: it hung."""
    pid = os.fork()
    if pid == 0:
        code = 2
        try:
            code = body()
        finally:
            os._exit(code)  # no atexit, no pytest teardown in the child
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child did not finish within {timeout} s")


def test_a_forked_child_runs_none_of_the_parents_deferred_work(tmp_path):
    parent, gate, ran = os.getpid(), threading.Event(), tmp_path / "ran"
    deferred.start()
    deferred.defer(lambda: gate.wait(30) if os.getpid() == parent else None)  # the parent's worker is busy
    deferred.defer(lambda: ran.open("a").write(f"{os.getpid()}\n"))  # so this is still queued at the fork

    def child() -> int:
        deferred.start()
        deferred.settle(timeout=5)
        return 0

    try:
        status = _in_forked_child(child)
    finally:
        gate.set()
    deferred.settle()
    assert status == 0
    assert ran.read_text().split() == [str(parent)]  # run once, by the parent's worker


def test_a_forked_childs_copy_of_a_model_gives_back_nothing(tmp_path):
    """A forked child (a DataLoader worker, say) that drops its copy of the parent's model must
    not start tearing it down: its files and lock are the parent's, and the copy's I/O threads
    did not come along (a release there would wait on them for ever)."""
    model = TinyGPT()
    holder = [_build(model, tmp_path)]
    train_steps(holder[0], 1)
    files = _files(tmp_path)

    def child() -> int:
        holder.clear()
        gc.collect()  # the copy's finalizer runs here, in the child
        deferred.start()
        t0 = time.monotonic()
        deferred.settle(timeout=5)
        untouched = any(p._post_accumulate_grad_hooks for p in model.parameters())  # a release takes them off first
        return 0 if untouched and time.monotonic() - t0 < 2 else 1

    assert _in_forked_child(child) == 0
    assert _files(tmp_path) == files
    with open(tmp_path / "tiermem.lock") as f:
        assert f.read().strip() == str(os.getpid())
    assert all(l == l for l in train_steps(holder[0], 1, offset=1))  # noqa: E741 - its files are all there
    holder[0].detach()
    assert _files(tmp_path) == []


def test_a_model_dropped_as_a_script_ends_leaves_no_files(tmp_path):
    """The release worker finishes before the interpreter's thread pools stop taking work, so
    the store still deletes its files (a model living in ``main()`` is dropped at every end)."""
    run_python(
        f"""
        import os, time
        os.environ["TIERMEM_NO_COMPILE"] = "1"  # torch's fused AdamW: no kernel to load (~7 of 16 CPU s)
        from models import TinyGPT, train_steps
        from tiermem import TieredModel
        from tiermem.memory import deferred
        from tiermem.policies import ZeroInfinity

        def main():
            tm = TieredModel(TinyGPT(), ZeroInfinity(), nvme_dir={str(tmp_path)!r}, precision="bf16",
                             bucket_size=4096)
            train_steps(tm, 1)
            deferred.defer(time.sleep, 0.5)  # the worker is busy: the release below runs during the exit

        main()
    """,
        timeout=120,
        hang="a model dropped as the script ended kept the interpreter from exiting",
    )
    assert _files(tmp_path) == []


def _collect_a_model_inside_the_pools_lock(nvme_dir: str) -> list[str]:
    """In a child process: a trained model that only a GC pass collects, collected while this
    thread holds concurrent.futures' module-wide lock; the directory's files once released."""
    import concurrent.futures.thread

    os.environ["TIERMEM_NO_COMPILE"] = "1"  # torch's fused AdamW: no kernel to load
    holder: list = [TieredModel(TinyGPT(), ZeroInfinity(), nvme_dir=nvme_dir, precision="bf16", bucket_size=4096)]
    train_steps(holder[0], 1)
    holder.append(holder)  # only a GC pass collects it
    del holder
    with concurrent.futures.thread._global_shutdown_lock:  # what submit() holds
        gc.collect()  # the model's finalizer runs here, on this thread, inside that lock
    deferred.settle()
    return sorted(os.listdir(nvme_dir))


def test_a_model_collected_inside_a_thread_pools_lock_does_not_deadlock(tmp_path):
    """A GC pass can start inside ``ThreadPoolExecutor.submit``, which holds concurrent.futures'
    module-wide lock; a model collected there gives back on the release worker, not inline
    (NOTE [Finalizers only enqueue]). In a child process: a deadlock would wedge every pool."""
    child = forked.run(
        _collect_a_model_inside_the_pools_lock,
        str(tmp_path),
        deadline=90,
        hang="a model collected inside concurrent.futures' lock deadlocked",
    )
    assert child.exitcode == 0, child.error
    assert child.value == []  # released after all: files and lock gone
