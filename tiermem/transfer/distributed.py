"""The process group of many ranks (NOTE [Data parallel] in tiermem/transfer/collectives.py):
:class:`Distributed`, whose collectives run on a thread of their own and stop every rank at once
when one fails (NOTE [A failed step stops every rank at once]), and :func:`resolve_group`, which
picks it or :class:`~tiermem.transfer.collectives.Solo` from ``process_group=``."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch

from tiermem.errors import ConfigError, TierMemError
from tiermem.observe.trace import Tracer
from tiermem.transfer.collectives import POLL_S, Group, PeerFailed, Pending, Solo

_POLL = timedelta(seconds=POLL_S)


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
