"""How a copy request between the device and the host is issued on its lane and finished once
it landed (NOTE [Issued, then done] in :mod:`tiermem.transfer.lanes`): plain copies go straight
to the side stream; a copy that converts or adds does it on the host, device->host on the
completion thread behind the copy (off the copy's critical path), host->device on the lane before
it, through pooled staging (one buffer per request); an add into device memory runs on the side stream. Only
:class:`~tiermem.transfer.engine.TransferEngine` uses this module.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional, Sequence

import torch

from tiermem.memory.resident import nbytes_of
from tiermem.spans import lazy_span
from tiermem.transfer.lanes import GpuWork, IssueResult, Lanes, Ready
from tiermem.transfer.lease import Lease
from tiermem.transfer.service import Copy
from tiermem.transfer.stats import TransferStats
from tiermem.types import TensorClass, Tier

_PIECE = 256  # bytes: each copy's part of a request's staging buffer starts on this boundary


class Copies:
    """Issues the engine's ``copy_async``/``copy_many`` requests; ``lease(nbytes, key)`` lends
    pooled host staging buffers."""

    def __init__(self, lanes: Lanes, stats: TransferStats, lease: Callable[[int, str], Lease]):
        self.lanes, self.stats, self.lease = lanes, stats, lease

    def one(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        lane: str,
        ready: Ready,
        accumulate: bool,
        src_tier: Tier,
        dst_tier: Tier,
        kind: Optional[TensorClass],
    ) -> IssueResult:
        """One copy_async request (NOTE [Issued, then done])."""
        gpu, _, finish = self.many([(dst, src, accumulate)], lane, ready, src_tier, dst_tier, kind)
        return gpu, dst, finish

    def many(
        self,
        copies: Sequence[Copy],
        lane: str,
        ready: Ready,
        src_tier: Tier,
        dst_tier: Tier,
        kind: Optional[TensorClass],
    ) -> IssueResult:
        """Issue copy requests on their lane, in order (NOTE [Issued, then done]); returns the GPU
        work that completes them all, and what is left for once it is done. The copies that go
        through host staging share one pooled buffer, leased for the whole request."""
        # NOTE [tiermem in the torch profiler]
        with lazy_span(lambda: f"copy {kind or 'tensor'} {src_tier}->{dst_tier}"):
            t0 = time.perf_counter()
            works: list[GpuWork] = []
            tails: list[Callable[[], None]] = []
            pieces, lease = self._staging(copies, lane)
            try:
                for copy, piece in zip(copies, pieces):
                    gpu, tail = self._issue(copy, lane, ready, piece)
                    works += [gpu] if gpu is not None else []
                    tails += [tail] if tail is not None else []
            except BaseException:
                self.stats.count(src_tier, dst_tier, t0=t0)
                with contextlib.suppress(BaseException):
                    for w in works[-1:]:
                        w.wait()  # ordering: staging goes back only once the copies issued so far are done
                    _run_tails(tails, lease)
                raise
            nbytes = sum(src.numel() * src.element_size() for _, src, _ in copies)
            last = works[-1] if works else None

            def finish(
                _held: object = copies,
            ) -> None:  # the caller may drop the sources: they live until the copies are done
                try:
                    if last is not None:
                        last.wait()  # one stream, in order: the last done means all done
                    _run_tails(tails, lease)
                except BaseException:
                    self.stats.count(src_tier, dst_tier, t0=t0)
                    raise
                # on a GPU busy for the copies' own time on their stream, elsewhere from t0 until now
                self.stats.count(
                    src_tier,
                    dst_tier,
                    t0=t0,
                    seconds=sum(w.seconds() for w in works) if works else None,
                    nbytes=nbytes,
                    kind=kind,
                )

            return last, None, finish

    def _staging(self, copies: Sequence[Copy], lane: str) -> tuple[list[Optional[torch.Tensor]], Optional[Lease]]:
        """Each copy's part of one pooled host buffer (None for a copy that needs none), and the
        lease of that buffer (None when no copy needs staging: always on the CPU)."""
        if not self.lanes.cuda:
            return [None] * len(copies), None
        sizes = [_staged_bytes(dst, src, accumulate, lane) for dst, src, accumulate in copies]
        starts, total = [], 0
        for n in sizes:
            starts.append(total)
            total += -(-n // _PIECE) * _PIECE
        if not total:
            return [None] * len(copies), None
        lease = self.lease(total, f"<staging {id(copies)}>")
        buf = lease.view()
        return [buf[a : a + n] if n else None for a, n in zip(starts, sizes)], lease

    def _issue(
        self, copy: Copy, lane: str, ready: Ready, piece: Optional[torch.Tensor]
    ) -> tuple[Optional[GpuWork], Optional[Callable[[], None]]]:
        """Queue ``copy``, ``dst <- src`` (or ``dst += src``), on ``lane``, through ``piece`` of host
        staging where :func:`_staged_bytes` says so; returns the GPU work and the host work left for
        once it is done (both None when nothing is left: the CPU)."""
        dst, src, accumulate = copy
        if not self.lanes.cuda:
            (dst.add_(src) if accumulate else dst.copy_(src))
            return None, None
        if lane == "d2h":  # device -> host: convert or add on the host, on the completion thread
            if piece is None:
                return self.lanes.memcpy(dst, src, lane, ready), None
            staged = piece.view(src.dtype).view(src.shape)
            gpu = self.lanes.memcpy(staged, src, lane, ready)

            def land() -> None:
                (dst.add_(staged) if accumulate else dst.copy_(staged))

            return gpu, land
        if accumulate:  # host -> device, added there: through a device temporary of src's dtype

            def add() -> None:
                tmp = torch.empty(src.shape, dtype=src.dtype, device=dst.device)  # on the side stream
                tmp.copy_(src, non_blocking=True)
                dst.add_(tmp)

            return self.lanes.on_stream(lane, ready, add, (dst,)), None
        if piece is None:
            return self.lanes.memcpy(dst, src, lane, ready), None
        # host -> device, converting: on the host into staging of dst's dtype (a converting copy
        # would allocate a temporary on the device), then one plain copy
        staged = piece.view(dst.dtype).view(src.shape)
        staged.copy_(src)
        return self.lanes.memcpy(dst, staged, lane, ready), None


def _run_tails(tails: Sequence[Callable[[], None]], lease: Optional[Lease]) -> None:
    """Run every tail of a request (the first error is raised once all ran), then give its
    staging back."""
    error = None
    try:
        for tail in tails:
            try:
                tail()
            except BaseException as e:  # noqa: BLE001 - the first is raised below
                error = error or e
    finally:
        if lease is not None:
            lease.release()
    if error is not None:
        raise error


def _staged_bytes(dst: torch.Tensor, src: torch.Tensor, accumulate: bool, lane: str) -> int:
    """Host staging one copy between the device and the host needs: device->host converting or
    adding, ``src``'s bytes (it lands there first); host->device converting, ``src`` in ``dst``'s
    dtype; else none."""
    if lane == "d2h":
        return 0 if not accumulate and src.dtype == dst.dtype else nbytes_of(src.shape, src.dtype)
    return nbytes_of(src.shape, dst.dtype) if not accumulate and src.dtype != dst.dtype else 0
