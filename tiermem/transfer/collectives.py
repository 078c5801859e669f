"""Collectives: the only code that calls ``torch.distributed``, on plain tensors.

# NOTE [Data parallel]
Under data parallelism (ZeRO-2 with offload) every bucket is cut into ``world`` equal chunks
(the last padded; edges where the state format allows: NOTE [Chunks cut where the state allows]
in tiermem/plan/buckets.py); rank r owns chunk r of every bucket: its gradients, its optimizer state,
its Adam. A bucket's gradients are reduce-scattered (averaged, as DDP does) into the chunks when
the bucket is complete; after Adam, the new low-precision weights of every chunk are
all-gathered into every rank's full device copy (ZeRO-2), unless the weights are sharded too
(ZeRO-3: off the device, or ``shard_weights=True``), when each rank keeps its chunk and a bucket
is gathered while it is read (NOTE [Weights sharded over the ranks] in
tiermem/train/weights/gathered.py). Whatever all ranks must decide alike (which
parameters got a gradient, the global norm, an fp16 overflow) is all-reduced first.

# NOTE [A failed step stops every rank at once]
A step that fails on one rank (an NVMe write, in the foreground or the background) leaves the
others in (or on their way to) a collective it will never join. Rather than let them wait for the
process group's timeout, the failing rank posts its error in the process group's store
(:meth:`Group.abort`: one key per model, the same on every rank) and issues no more collectives.
A rank's collective waits in slices of :data:`POLL_S` and looks for that key between them (gloo's
reduce-scatter, a composite that ignores a wait's timeout, only when it ends), and a collective
that fails (the failing rank's process closed its connections) looks for it too: when it is
there, the rank raises :class:`PeerFailed`, a ``tiermem:`` error naming the failing rank and its
error. So every rank stops within a fraction of a second of the failure, with the cause named.
Gloo only: an NCCL wait blocks the device's stream, not this thread, so under NCCL a stopped
rank is still seen at the group's timeout.

A :class:`Group` is that vocabulary. :class:`Solo` is the group of one process: every
collective is the identity, so the step has no "if distributed" anywhere; :class:`Distributed`
wraps a ``torch.distributed`` process group (gloo on the CPU, NCCL on GPUs), counts the bytes
each collective sends and receives, and turns a failed or timed-out collective into a
``tiermem:`` error that names the operation and the ranks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from tiermem.errors import TierMemError

#: seconds of a collective's wait between two looks for a failed rank's error
POLL_S = 0.2


class PeerFailed(TierMemError):
    """A collective stopped because another rank's step failed (NOTE [A failed step stops every
    rank at once]); the message names that rank and its error."""


@dataclass(frozen=True)
class Chunk:
    """Rank ``rank``'s piece of a bucket of ``numel`` elements cut in ``world`` chunks of ``size``
    (``chunk_size``, the bucket's choice: NOTE [Chunks cut where the state allows]; else the even
    share)."""

    numel: int
    world: int
    rank: int
    chunk_size: Optional[int] = None

    @property
    def size(self) -> int:
        if self.chunk_size is not None:
            return self.chunk_size
        return -(-self.numel // self.world) if self.numel else 0

    @property
    def start(self) -> int:
        return min(self.rank * self.size, self.numel)

    @property
    def end(self) -> int:
        return min((self.rank + 1) * self.size, self.numel)

    def overlap(self, offset: int, numel: int) -> tuple[int, int]:
        """The elements ``[lo, hi)`` of the bucket that both this chunk and the run of ``numel`` at
        ``offset`` (a parameter's slot) cover; ``lo >= hi`` when none."""
        return max(offset, self.start), min(offset + numel, self.end)

    @property
    def padded(self) -> int:
        return self.size * self.world


class Group:
    """The collectives the step needs; see NOTE [Data parallel]."""

    rank: int = 0
    world: int = 1
    #: the ``torch.distributed`` process group, for a library that runs its own collectives over it
    #: (torch.distributed.checkpoint); None with :class:`Solo`, and for the default group
    pg: Any = None

    def chunk(self, numel: int, size: Optional[int] = None) -> Chunk:
        """This rank's chunk of ``numel`` elements: chunks of ``size`` (default the even share)."""
        return Chunk(numel, self.world, self.rank, size)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over ranks, in place."""
        return t

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s elementwise maximum over ranks, in place."""
        return t

    def reduce_scatter_mean(self, out: torch.Tensor, full: torch.Tensor) -> None:
        """``out`` (``size`` elements) = this rank's chunk of the mean over ranks of ``full``
        (``padded`` elements)."""
        out.copy_(full[: out.numel()])

    def reduce_scatter_mean_async(self, out: torch.Tensor, full: torch.Tensor) -> "Pending":
        """:meth:`reduce_scatter_mean` started; ``.wait()`` finishes it (``full`` and ``out`` stay
        untouched by the caller until then)."""
        self.reduce_scatter_mean(out, full)
        return Pending(None, lambda: None)

    def all_gather(self, full: torch.Tensor, mine: torch.Tensor) -> None:
        """``full`` (``padded`` elements) = every rank's ``mine`` (``size`` elements), in rank order."""
        full[: mine.numel()].copy_(mine)

    def all_gather_async(self, full: torch.Tensor, mine: torch.Tensor) -> "Pending":
        """:meth:`all_gather` started; ``.wait()`` finishes it."""
        self.all_gather(full, mine)
        return Pending(None, lambda: None)

    def broadcast_(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` on every rank, in place."""
        return t

    def all_ok(self, ok: bool) -> bool:
        """True on every rank when ``ok`` was True on every rank."""
        return ok

    def norms(self, partial: torch.Tensor) -> torch.Tensor:
        """Per-parameter L2 norms from each rank's norms of its pieces."""
        return partial

    def check_same(self, what: str, fingerprint: str) -> None:
        """Every rank built the same thing (``fingerprint``), or a ``tiermem:`` error."""

    def agree(self, got: set[str], names: Sequence[str]) -> set[str]:
        """The names in ``got`` on any rank (``names``: all of them, in one order on every rank)."""
        return got

    def bytes_sent(self) -> int:
        return 0

    def exchange(self, header: Sequence[int]) -> list[list[int]]:
        """Every rank's ``header`` (a few ints, the same count on every rank), in rank order."""
        rows: list[list[int]] = self.exchange_async(header).wait()
        return rows

    def exchange_async(self, header: Sequence[int]) -> "Pending":
        """:meth:`exchange` started; ``.wait()`` returns every rank's header."""
        return Pending(None, lambda: [list(header)])

    def for_weights(self) -> "Group":
        """The group the weights' all-gathers use: collectives issued from two threads (grads from
        backward's, weights from the engine's under overlap_step) each need a group of their own,
        so that every rank sees each group's collectives in the same order."""
        return self

    def for_gathers(self) -> "Group":
        """The group that gathers sharded weights before their modules run (NOTE [Weights sharded
        over the ranks] in tiermem/train/weights/gathered.py): issued from the thread that runs forward and
        backward, beside the grads' reduce-scatters and the replicated weights' all-gathers."""
        return self

    def for_gather_headers(self) -> "Group":
        """The group that carries only the headers announcing those gathers (all of one size, so
        ranks out of step pair two headers, never a header with a bucket's bytes)."""
        return self

    def subdirectory(self, directory: str) -> str:
        """Where this rank keeps its own files under ``directory``."""
        return directory

    def close(self) -> None:
        """Nothing of the group's outlives the model."""

    def abort(self, error: BaseException) -> None:
        """This rank's step failed with ``error`` and it issues no more collectives: tell the other
        ranks, whose collectives then stop at once (NOTE [A failed step stops every rank at once])."""


class Pending:
    """A collective in flight: ``wait()`` blocks until it is done, then runs its finishing step
    and returns what that gave (every later ``wait()`` returns it again)."""

    def __init__(
        self, wait: Optional[Callable[[], object]], finish: Callable[[], Any], done: Optional[Callable[[], bool]] = None
    ):
        self._wait, self._finish, self._done, self._value = wait, finish, False, None
        self._ready = done  # whether ``wait()`` would return at once (None: it always would)

    def done(self) -> bool:
        """The collective has finished (``wait()`` returns without blocking); never blocks."""
        return self._done or self._ready is None or self._ready()

    def wait(self) -> Any:
        if not self._done:
            self._done = True
            if self._wait is not None:
                self._wait()
            self._value = self._finish()
        return self._value


class Solo(Group):
    """One process: every collective is the identity."""


def fingerprint(parts: Sequence[object]) -> str:
    return hashlib.sha256(repr(list(parts)).encode()).hexdigest()[:16]
