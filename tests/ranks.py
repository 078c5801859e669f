"""Run a function on N gloo ranks in fresh processes, with a deadline, and report every rank's
failure: the harness of the data-parallel tests. A rank's function gets ``(rank, world, *args)``
after the process group is up, and returns something picklable.

The ranks are forked from a forkserver that imported torch and tiermem once per test session
(PRELOAD), not spawned: a spawned rank imports torch again, ~3 CPU seconds each on this 2-core
machine, for every rank of every run. The forkserver is a fresh process of its own (it has run
nothing, started no thread), so a rank starts as clean as a spawned one; the environment is the
caller's at the call, as with spawn (the forkserver's is that of its start, so it is sent along)."""

from __future__ import annotations

import io
import os
import queue
import socket
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp

DEADLINE = 120.0  # seconds for a whole run; a hang fails the test instead of the suite
# what every rank imports first, once in the forkserver. torch._dynamo too: torch.optim's
# Optimizer methods and tiermem's eager hooks import it at their first call (~1.8 CPU s a process);
# transformers and peft (~4 CPU s, once a worker) for the ranks and the scripts (tests/fresh.py)
# that train Hugging Face models: ~8 processes in the suite, ~3.5 CPU s each
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "tiermem", "transformers", "peft"]


def free_port() -> int:
    """A TCP port free on this machine now (the OS picks it), for a rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn, args, results, backend: str, env: dict[str, str]) -> None:
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)  # the caller's environment at the call, not the forkserver's at its start
    # torch's fused AdamW instead of compiling tiermem's kernel in every fresh process (seconds each,
    # on two cores); the compiled kernel is tested in one process, where it compiles once
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TIERMEM_NO_COMPILE="1")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=30))
        try:
            value = io.BytesIO()
            torch.save(fn(rank, world, *args), value)  # bytes: tensors would be shared with a process about to exit
            results.put((rank, "ok", value.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - sent to the parent, which raises it
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class RankFailed(AssertionError):
    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        super().__init__("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))


def forkserver():
    """The forkserver context every second process of the suite comes from: ranks here, scripts
    (tests/fresh.py), children (tests/forked.py). One server per test process, started at the first
    use, with PRELOAD imported."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the forkserver starts
    return ctx


def run_ranks(fn, *args, world: int = 2, deadline: float = DEADLINE, allow_errors: bool = False, backend: str = "gloo"):
    """``[fn(0, world, *args), ..., fn(world-1, world, *args)]``, each on its own rank. Raises
    :class:`RankFailed` with every rank's error (or returns them, ``allow_errors=True``: a dict
    rank -> result or error text); a rank not done by ``deadline`` is killed and reported."""
    ctx = forkserver()
    results = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, fn, args, results, backend, env)) for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, object]] = {}
    try:
        while len(got) < world:
            try:
                rank, status, value = results.get(timeout=deadline)
            except queue.Empty:
                break
            got[rank] = (status, torch.load(io.BytesIO(value), weights_only=False) if status == "ok" else value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: v for r, (s, v) in got.items() if s == "error"}
    errors.update({r: f"no answer within {deadline:.0f} s (hung or died)" for r in range(world) if r not in got})
    if allow_errors:
        return {r: (v if s == "ok" else None) for r, (s, v) in got.items()}, errors
    if errors:
        raise RankFailed(errors)
    return [got[r][1] for r in range(world)]
