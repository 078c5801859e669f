"""The engine's lanes: the worker threads that issue its requests, and on a GPU the side streams
they issue copies on and the threads that see those copies land.

Only :class:`~tiermem.transfer.engine.TransferEngine` uses this module.

# NOTE [Issued, then done]
On a GPU a request between the device and the host has two moments. *Issued*: its lane queued
the copy on the direction's side stream, behind the ``ready`` event taken on the caller's stream
at the call, and recorded a ``done`` event behind it; the lane is then free to issue the next
copy, so several copies of one direction are in flight at once (each with its own pooled staging
buffer, taken from the host pool). *Done*: the direction's completion thread, in the order the
copies were issued, blocks on ``done`` (created ``blocking=True``: the thread sleeps instead of
spinning on a core that CPU Adam needs), then runs the request's host-side tail (a bf16->fp32
conversion into the gradient buffer, giving the staging buffer back, the registry's bookkeeping)
and completes the handle. Host work therefore never sits between two copies of a direction.

A consumer on the host (CPU Adam reading gradients, an NVMe write of a staging buffer) waits for
*done* with ``handle.wait()``. A consumer on the GPU joins at *issued* with
``TransferEngine.join(handle)``: its current stream waits on ``done`` with ``wait_event`` and the
host goes on queueing work. A request that has no GPU stage (the CPU, NVMe legs, chains) is
joined by waiting for it, which is always correct.

A copy into a freshly allocated device buffer still waits for everything the caller's stream
queued before the call (the allocator may have handed out a block that stream's kernels still
read), but nobody waits for it on the host: a prefetch miss makes the consumer's stream wait on
the GPU, and the host goes on queueing work, so the GPU's queue does not drain.

Every lane thread is bound to the engine's device (``torch.cuda.set_device``), so work a lane
issues on ``cuda:N`` never creates a context on GPU 0. On the CPU the lanes do each copy
themselves and a request is issued and done at once, so every path but the stream calls runs on
a machine without an accelerator.

# NOTE [A CPU device]
Without an accelerator the device tier is host memory too, and a copy between the two tiers is
work for the same cores that run the model: nothing moves the bytes but a CPU thread. Two rules
follow. The host's Adam writes a bucket's new weights straight into the device buffer the
parameters view (``DeviceWeights.in_place``; ``placement.writes_weights_in_place`` with
``device_is_host``): no staging buffer, no host->device copy. And a device->host request (a
gradient going home as backward produces it, an activation evicted) runs on the caller's thread
instead of the d2h lane's: on a lane thread it ran beside backward, whose ops already use every
core through torch's OpenMP team, so the two teams took turns on the cores and both slowed. On a
2-core machine, a transformers Llama of 374M parameters under ZeroOffload (bench/step.py --llama
374m, medians of 8 steps), backward went from 1.37 s to 1.27 s with the copies on the caller's
thread, and the step from 1.00x to 0.94x of the plain loop's (bench/RESULTS.md, 2026-12-06). Host->device requests keep
their lane: a prefetch is issued ahead of its use, and its copy runs while the caller goes on.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Optional

import torch

from tiermem.handles import Handle, Issued, StallSink
from tiermem.plan.footprint import NVME_THREADS  # the footprint counts a staging buffer per NVMe thread
from tiermem.spans import lazy_span, span

LANES = ("d2h", "h2d", "nvme", "compute")
STREAM_LANES = ("d2h", "h2d", "compute")  # lanes that own a side stream on a GPU
DONE_LANES = ("d2h", "h2d")  # lanes whose copies complete on a completion thread

# issue() -> (gpu work or None, the request's value, finish or None). finish() runs once the GPU
# work is done (it waits for it itself), on the completion thread; it may raise.
IssueResult = tuple[Optional["GpuWork"], Any, Optional[Callable[[], None]]]
Issue = Callable[[], IssueResult]
#: what a request waits for before it starts on a GPU: an event on the caller's stream (None on the CPU)
Ready = Optional[torch.cuda.Event]


class GpuWork:
    """Work queued on a side stream between two events: ``done`` completes it, ``start`` and
    ``done`` time it (the copy alone, not the wait for ``ready`` before it)."""

    __slots__ = ("start", "done")

    def __init__(self, start: torch.cuda.Event, done: torch.cuda.Event):
        self.start, self.done = start, done

    def wait(self) -> None:
        self.done.synchronize()  # ordering: the bytes have landed (a blocking event: no spinning)

    def seconds(self) -> float:
        """GPU time between the events (call after :meth:`wait`)."""
        return float(self.start.elapsed_time(self.done)) / 1000.0


def event(*, timing: bool = False) -> torch.cuda.Event:
    """Every event the engine makes: blocking, so a host wait on it sleeps."""
    return torch.cuda.Event(enable_timing=timing, blocking=True)  # type: ignore[no-untyped-call]  # torch: untyped


class Lanes:
    """Worker threads per lane (one per direction keeps requests in order, like a stream; the
    NVMe lane has several, since each request there mostly waits on the store's I/O threads),
    and on a GPU a side stream per lane and a completion thread per direction."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        #: lanes whose requests run on the caller's thread (NOTE [A CPU device]); ``run`` and
        #: ``behind`` keep to the pools, which these lanes leave empty
        self.inline = frozenset() if self.cuda else frozenset({"d2h"})
        init = None
        if self.cuda:
            index = device.index if device.index is not None else torch.cuda.current_device()
            init = lambda: torch.cuda.set_device(index)  # noqa: E731 - lanes run on the model's device
        self.pools = {
            name: ThreadPoolExecutor(
                NVME_THREADS if name == "nvme" else 1, thread_name_prefix=f"tiermem-{name}", initializer=init
            )
            for name in LANES
        }
        self.done = (
            {
                name: ThreadPoolExecutor(1, thread_name_prefix=f"tiermem-{name}-done", initializer=init)
                for name in DONE_LANES
            }
            if self.cuda
            else {}
        )
        self.streams = (
            {name: torch.cuda.Stream(device) for name in STREAM_LANES}  # type: ignore[no-untyped-call]
            if self.cuda
            else {}
        )

    # -- ordering against the caller ------------------------------------------------------------
    def ready(self) -> Optional[torch.cuda.Event]:
        """On a GPU, an event on the calling thread's current stream: work that waits on it starts
        after what that stream has queued so far (None on the CPU)."""
        if not self.cuda:
            return None
        ready = event()
        ready.record(torch.cuda.current_stream(self.device))
        return ready

    def on_stream(
        self, lane: str, ready: Optional[torch.cuda.Event], op: Callable[[], None], tensors: Iterable[torch.Tensor] = ()
    ) -> Optional[GpuWork]:
        """Run ``op`` (which queues GPU work) on ``lane``'s side stream after ``ready``; the CUDA
        ``tensors`` it touches are marked used by that stream. Returns the work (None on the CPU,
        where ``op`` ran to the end)."""
        stream = self.streams.get(lane)
        if stream is None:
            op()
            return None
        with torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)  # ordering: after the caller's writes to src and its use of dst
            start = event(timing=True)
            start.record(stream)
            op()
            for t in tensors:
                if t.is_cuda:
                    t.record_stream(stream)  # ordering: the allocator must not reuse t before the copy ends
            done = event(timing=True)
            done.record(stream)
        return GpuWork(start, done)

    def memcpy(self, dst: torch.Tensor, src: torch.Tensor, lane: str, ready: Ready) -> Optional[GpuWork]:
        """``dst.copy_(src)`` on ``lane``'s stream after ``ready`` (NOTE [Issued, then done])."""

        def copy() -> None:
            dst.copy_(src, non_blocking=True)

        return self.on_stream(lane, ready, copy, (src, dst))

    # -- requests ---------------------------------------------------------------------------------
    def request(self, lane: str, issue: Issue, on_stall: Optional[StallSink]) -> Handle:
        """Run ``issue`` on ``lane``; the handle completes with its value once its GPU work is done
        and ``finish`` ran (NOTE [Issued, then done])."""
        future: Future[Any] = Future()
        issued = Issued() if self.cuda else None
        done = self.done.get(lane)

        def job() -> None:
            try:
                with span(lane):  # NOTE [tiermem in the torch profiler]
                    gpu, value, finish = issue()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the handle
                if issued is not None:
                    issued.fail()
                future.set_exception(e)
                return
            if issued is not None:
                issued.set(gpu.done if gpu is not None else None, value)
            if gpu is None or done is None:
                _settle(future, value, finish)
            else:
                done.submit(_settle, future, value, finish, lane)

        if lane in self.inline:  # NOTE [A CPU device]
            job()
        else:
            self.pools[lane].submit(job)
        return Handle(future, on_stall=on_stall, issued=issued)

    def run(self, lane: str, fn: Callable[[], Any], on_stall: Optional[StallSink]) -> Handle:
        """Run ``fn`` on ``lane``; on a GPU on the lane's stream after the caller's stream as it is
        now, and the handle completes once the GPU work ``fn`` queued is done too. A GPU consumer
        may join at the end of ``fn`` instead (NOTE [Issued, then done])."""
        if not self.cuda:
            return Handle(self.pools[lane].submit(_spanned, lane, fn), on_stall=on_stall)
        ready, stream = self.ready(), self.streams.get(lane)
        issued = Issued()

        def job() -> Any:
            try:
                with span(lane), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    current = torch.cuda.current_stream(self.device)
                    if ready is not None:  # (always, on a GPU)
                        current.wait_event(ready)  # ordering: after what the caller queued (grads written)
                    value = fn()
                    done = event()
                    done.record(current)
            except BaseException:
                issued.fail()
                raise
            issued.set(done, value)
            done.synchronize()  # the handle completes once fn's GPU work is done
            return value

        return Handle(self.pools[lane].submit(job), on_stall=on_stall, issued=issued)

    def behind(self, lane: str) -> Future[Any]:
        """Done once every request queued on ``lane`` so far is done (landed, on a GPU too)."""
        future: Future[Any] = Future()
        done = self.done.get(lane)

        def job() -> None:
            if done is None:
                future.set_result(None)
            else:  # the completion thread takes requests in the lane's order
                done.submit(future.set_result, None)

        self.pools[lane].submit(job)
        return future

    def close(self) -> None:
        for pool in self.pools.values():
            pool.shutdown(wait=True)
        for pool in self.done.values():  # after the lanes: they hand work to these
            pool.shutdown(wait=True)


def _spanned(lane: str, fn: Callable[[], Any]) -> Any:
    with span(lane):  # NOTE [tiermem in the torch profiler]
        return fn()


def _settle(future: Future[Any], value: Any, finish: Optional[Callable[[], None]], lane: Optional[str] = None) -> None:
    """Complete ``future`` after ``finish`` ran; ``lane``: it runs on that lane's completion thread
    (a ``tiermem::<lane> landed`` span; on the lane itself it is inside the lane's own span)."""
    try:
        if finish is not None:
            with lazy_span(lambda: f"{lane} landed") if lane is not None else contextlib.nullcontext():
                finish()
    except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the handle
        future.set_exception(e)
        return
    future.set_result(value)
