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
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch

from tiermem.errors import ConfigError, TierMemError
from tiermem.observe.trace import Tracer

#: seconds of a collective's wait between two looks for a failed rank's error
POLL_S = 0.2
_POLL = timedelta(seconds=POLL_S)


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


class Distributed(Group):
    """A ``torch.distributed`` process group. Collectives run on the calling thread and wait (the
    reduce-scatter of gradients returns at once and is waited for later). Tensors that are not
    where the backend works (host tensors under NCCL) go through a copy on its device."""

    _serials: dict[str, int] = {}  # process group -> models built on it so far (the same on every rank)

    def __init__(
        self,
        pg: Any = None,
        *,
        timeout: Optional[float] = None,
        tracer: Optional[Tracer] = None,
        failed_key: Optional[str] = None,
    ):
        import torch.distributed as dist  # imported only when a process group exists

        self.dist, self.pg, self.tracer = dist, pg, tracer
        if failed_key is None:  # a model's group; its siblings share its key
            name = getattr(pg, "group_name", None) or "default"
            serial = Distributed._serials[name] = Distributed._serials.get(name, 0) + 1
            failed_key = f"tiermem/failed/{name}/{serial}"
        self._failed_key = failed_key
        self._store = _store(dist)
        # torch 2.13 renamed the flat-tensor collectives; older versions have only the first names
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.rank, self.world = dist.get_rank(pg), dist.get_world_size(pg)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pg) == "nccl" else torch.device("cpu")
        )
        self._timeout_s = timeout
        self.timeout = None if timeout is None else timedelta(seconds=timeout)
        self._sent = 0
        self._lock = threading.Lock()
        self.seconds = 0.0
        self._siblings: dict[str, Distributed] = {}

    def _here(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.device else t.to(self.device)

    def _call(self, op: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:
            raise self._failed(op, e) from e

    def _failed(self, op: str, e: BaseException) -> TierMemError:
        posted = self._posted()  # the collective failed because a rank stopped: say why it did
        if posted:
            return PeerFailed(self._stopped(op, posted))
        first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        return TierMemError(
            f"tiermem: rank {self.rank} of {self.world}: {op} failed ({type(e).__name__}: {first}); "
            f"another rank probably stopped or raised: see its error"
        )

    def _run(self, op: str, fn: Callable[[], Any], nbytes: int) -> None:
        t0 = time.perf_counter()
        try:
            work = fn()
            if work is not None:
                self._wait(op, work, t0)
        except PeerFailed:
            raise
        except Exception as e:
            raise self._failed(op, e) from e
        t1 = time.perf_counter()
        with self._lock:
            self._sent += nbytes
            self.seconds += t1 - t0
        if self.tracer is not None:
            self.tracer.add(op, "collective", t0, t1)

    def _wait(self, op: str, work: Any, t0: float) -> None:
        """``work.wait()``; under gloo, in slices of :data:`POLL_S`, looking for a failed rank's
        error between them (NOTE [A failed step stops every rank at once])."""
        if self._store is None or self.device.type != "cpu":
            work.wait(self.timeout) if self.timeout is not None else work.wait()
            return
        while True:
            try:
                work.wait(_POLL)
                return
            except RuntimeError as e:
                if "Operation timed out" not in str(e):  # gloo's words for a slice that ran out: go on
                    raise
            if self._timeout_s is not None and time.perf_counter() - t0 > self._timeout_s:
                raise TimeoutError(f"no answer within {self._timeout_s} s")
            posted = self._posted()
            if posted:
                raise PeerFailed(self._stopped(op, posted))

    def _posted(self) -> Optional[str]:
        """What a rank whose step failed posted, or None."""
        if self._store is None:
            return None
        try:
            return self._store.get(self._failed_key).decode() if self._store.check([self._failed_key]) else None
        except Exception:  # noqa: BLE001 - a store that cannot answer: the group's timeout still applies
            return None

    def _stopped(self, op: str, posted: str) -> str:
        return (
            f"tiermem: rank {self.rank} of {self.world}: {op} stopped: {posted}; under data parallelism a "
            f"failed step stops every rank: restart them and tm.load() the last checkpoint"
        )

    def abort(self, error: BaseException) -> None:
        if self._store is None or isinstance(error, PeerFailed):  # a peer's failure is posted already
            return
        first = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        try:
            self._store.set(self._failed_key, f"rank {self.rank} failed its step ({type(error).__name__}: {first})")
        except Exception:  # noqa: BLE001 - the group's timeout still stops the other ranks
            pass

    def _in_place(self, op: str, t: torch.Tensor, call: Callable[[torch.Tensor], Any]) -> torch.Tensor:
        here = self._here(t)
        self._run(op, lambda: call(here), t.nbytes)
        if here is not t:
            t.copy_(here)
        return t

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        return self._in_place("all_reduce(sum)", t, lambda x: self.dist.all_reduce(x, group=self.pg, async_op=True))

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        return self._in_place(
            "all_reduce(max)",
            t,
            lambda x: self.dist.all_reduce(x, op=self.dist.ReduceOp.MAX, group=self.pg, async_op=True),
        )

    def broadcast_(self, t: torch.Tensor) -> torch.Tensor:
        src = self.dist.get_global_rank(self.pg, 0) if self.pg is not None else 0
        return self._in_place("broadcast", t, lambda x: self.dist.broadcast(x, src, group=self.pg, async_op=True))

    def reduce_scatter_mean(self, out: torch.Tensor, full: torch.Tensor) -> None:
        self.reduce_scatter_mean_async(out, full).wait()

    def reduce_scatter_mean_async(self, out: torch.Tensor, full: torch.Tensor) -> Pending:
        full_here, out_here = self._here(full), self._here(out)
        work = self._call(
            "reduce_scatter", lambda: self._reduce_scatter(out_here, full_here, group=self.pg, async_op=True)
        )

        def finish() -> None:
            out_here.div_(self.world)  # gloo has no AVG; dividing by a power of two is exact
            if out_here is not out:
                out.copy_(out_here)

        return Pending(lambda: self._run("reduce_scatter", lambda: work, full.nbytes), finish)

    def all_ok(self, ok: bool) -> bool:
        flag = torch.tensor([0.0 if ok else 1.0])
        self.sum_(flag)
        return flag.item() == 0

    def all_gather(self, full: torch.Tensor, mine: torch.Tensor) -> None:
        self.all_gather_async(full, mine).wait()

    def all_gather_async(self, full: torch.Tensor, mine: torch.Tensor) -> Pending:
        full_here, mine_here = self._here(full), self._here(mine)
        work = self._call("all_gather", lambda: self._all_gather(full_here, mine_here, group=self.pg, async_op=True))

        def finish() -> None:
            if full_here is not full:
                full.copy_(full_here)

        return Pending(lambda: self._run("all_gather", lambda: work, mine.nbytes * self.world), finish)

    def exchange_async(self, header: Sequence[int]) -> Pending:
        mine = self._here(torch.tensor(list(header), dtype=torch.int64))
        every = torch.empty(self.world * mine.numel(), dtype=torch.int64, device=mine.device)
        work = self._call("all_gather(header)", lambda: self._all_gather(every, mine, group=self.pg, async_op=True))
        return Pending(
            lambda: self._run("all_gather(header)", lambda: work, mine.nbytes * self.world),
            lambda: every.view(self.world, -1).tolist(),
            done=work.is_completed,
        )

    def agree(self, got: set[str], names: Sequence[str]) -> set[str]:
        mask = self.max_(torch.tensor([float(name in got) for name in names]))
        return {name for name, m in zip(names, mask.tolist()) if m}

    def norms(self, partial: torch.Tensor) -> torch.Tensor:
        squares = partial.double().square()
        self.sum_(squares)
        return squares.sqrt().float()

    def check_same(self, what: str, fingerprint: str) -> None:
        prints: list[Optional[str]] = [None] * self.world
        self._run("all_gather_object", lambda: self.dist.all_gather_object(prints, fingerprint, group=self.pg), 0)
        differ = [r for r, p in enumerate(prints) if p != prints[0]]
        if differ:
            raise ConfigError(
                f"tiermem: ranks {differ} built a different {what} from rank 0 (fingerprints "
                f"{sorted(set(map(str, prints)))}); give every rank the same model, policy and options"
            )

    def bytes_sent(self) -> int:
        with self._lock:
            sent = self._sent
        return sent + sum(s.bytes_sent() for s in self._siblings.values())

    def _sibling(self, what: str) -> "Distributed":
        """A group of the same ranks for ``what``'s collectives alone, made once."""
        if what not in self._siblings:  # collective: every rank builds its model, so every rank gets here
            ranks = [self.dist.get_global_rank(self.pg, r) if self.pg is not None else r for r in range(self.world)]
            self._siblings[what] = Distributed(
                self.dist.new_group(ranks), timeout=self._timeout_s, tracer=self.tracer, failed_key=self._failed_key
            )
        return self._siblings[what]

    def for_weights(self) -> "Distributed":
        return self._sibling("weights")

    def for_gathers(self) -> "Distributed":
        return self._sibling("gathers")

    def for_gather_headers(self) -> "Distributed":
        return self._sibling("gather headers")

    def subdirectory(self, directory: str) -> str:
        """Named by the global rank (rank in the default group), unique across every group and node
        (a rank of ``pg`` may be rank 0 of another group too)."""
        import os

        return os.path.join(directory, f"rank{self.dist.get_rank()}")


def _store(dist: Any) -> Any:
    """The default process group's store (where ranks post a failed step), or None."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: failures are seen at the group's timeout, as before
        return None


def resolve_group(process_group: Any, *, timeout: Optional[float] = None, tracer: Optional[Tracer] = None) -> Group:
    """``process_group=None``: the default group when ``torch.distributed`` is initialized, else one
    process; ``False``: one full replica per process; a process group: that one."""
    if process_group is False:
        return Solo()
    if process_group is None:
        import sys

        loaded = sys.modules.get("torch.distributed")  # never imported here: no cost without it
        if loaded is None or not loaded.is_available() or not loaded.is_initialized():
            return Solo()
        return Distributed(None, timeout=timeout, tracer=tracer) if loaded.get_world_size() > 1 else Solo()
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ConfigError(
            "tiermem: process_group= was given but torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) first, or pass process_group=False"
        )
    return (
        Distributed(process_group, timeout=timeout, tracer=tracer) if dist.get_world_size(process_group) > 1 else Solo()
    )


def fingerprint(parts: Sequence[object]) -> str:
    return hashlib.sha256(repr(list(parts)).encode()).hexdigest()[:16]
