"""What a checkpoint, ``state_dict()`` and ``detach()`` see of a TieredModel: one narrow interface.

:class:`ModelState` names every tensor by parameter (``<part>/<param>`` for each part of its state
format: ``master/<param>``, ``exp_avg/<param>``, ``exp_avg_sq/<param>`` for Adam, NOTE [State
formats]; ``frozen/<param>``, ``buffers/<buffer>``), never by bucket, and reaches the
bytes through the homes (NOTE [Homes]): optimizer state on NVMe passes through one host buffer
set at a time, so it never has to fit in memory. :mod:`tiermem.checkpoint.file` reads and writes
through it and knows nothing else of the model.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from tiermem.config.rules import ALL_GROUP_HYPER
from tiermem.config.specs import PRECISIONS
from tiermem.errors import TierMemError
from tiermem.optim.formats import StatePart
from tiermem.plan.buckets import Bucket
from tiermem.train.homes.sharded import chunk_of
from tiermem.train.layout import Layout
from tiermem.train.step.scaler import LossScaler
from tiermem.train.step.stepper import Stepper
from tiermem.transfer.collectives import Group, Solo

log = logging.getLogger(__name__)

HYPER = (*ALL_GROUP_HYPER, "initial_lr")  # what a checkpoint keeps of each param group
#: and which group it is: its name and its parameters' names (NOTE [Param groups]); checkpoints
#: written before groups could be given have neither, and are matched by the number of groups
MEMBERS = ("name", "params")


@dataclass(frozen=True)
class Piece:
    """The part of one parameter's fp32 state this process keeps: elements ``[lo, hi)`` of the
    flattened parameter (of shape ``shape``), at ``at`` in this process's views of its bucket
    (NOTE [Sharded values for DCP])."""

    name: str
    shape: tuple[int, ...]
    lo: int
    hi: int
    at: int


class ModelState:
    def __init__(
        self,
        module: torch.nn.Module,
        layout: Layout,
        stepper: Stepper,
        scaler: LossScaler,
        param_groups: list[dict],
        precision: str,
        dtype: torch.dtype,
        group: Group = Solo(),
    ):
        self.module, self.layout, self.stepper, self.scaler = module, layout, stepper, scaler
        self.param_groups, self.precision, self.dtype = param_groups, precision, dtype
        self.group = group
        self._bucket = {b.index: b for b in layout.buckets}
        self.writes_files = group.rank == 0  # under data parallelism rank 0 writes; every rank takes part
        self._frozen_release: Callable[[], None] | None = None  # frees the frozen chunk :meth:`read_frozen` gave
        self.failed_load: str | None = (
            None  # the error of a load that failed part way (NOTE [A failed load is guarded])
        )

    def all_ok(self, ok: bool) -> bool:
        """True on every rank when ``ok`` is True on every rank (one process: ``ok``)."""
        return self.group.all_ok(ok)

    # -- reading ------------------------------------------------------------------------------------
    def _bucket_state(self) -> Iterator[tuple[Bucket, tuple[torch.Tensor, ...]]]:
        """(bucket, its state's parts), each valid until the next item."""
        try:
            for b in self.layout.buckets:
                yield b, self.layout.homes.state[b.index].read(b)
        finally:
            self._release()

    def _bucket_masters(self) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """(bucket, its master), each valid until the next item: the moments are not read."""
        homes = self.layout.homes.state
        try:
            for home, run in itertools.groupby(self.layout.buckets, key=lambda b: homes[b.index]):
                yield from home.read_masters(list(run))  # a disk home reads the next bucket meanwhile
        finally:
            self._release()

    def _release(self) -> None:
        for home in self.layout.homes.state_homes():
            home.release_views()
        self._release_frozen()

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor a checkpoint holds, by name; each valid until the next."""
        for b, state in self._bucket_state():
            for i, part in enumerate(b.state.parts):
                for j, s in enumerate(b.slots):
                    yield f"{part.name}/{s.name}", _shaped(b.pieces(state, j)[i], part, s.shape)
        for name in self.layout.frozen:
            yield f"frozen/{name}", self.layout.frozen.value(name)
        for name, t in self.module.named_buffers():
            yield f"buffers/{name}", t

    def specs(self, precision: str) -> Iterator[tuple[str, tuple[int, ...], tuple[torch.dtype, ...]]]:
        """The name, shape and the dtypes accepted of every tensor a checkpoint saved at
        ``precision`` may hold for this model, reading none. Optimizer state is in its format's
        dtypes and frozen parameters keep their dtype, whatever the precision; a buffer may be in its dtype as the
        module gave it or, floating-point, in the working dtype of ``precision`` (as this version
        writes it): loading converts either (``t.copy_``), and nothing else is taken."""
        for b in self.layout.buckets:
            for part in b.state.parts:
                for s in b.slots:
                    shape = tuple(s.shape) if part.elementwise else (part.numel(s.numel, s.shape),)
                    yield f"{part.name}/{s.name}", shape, (part.dtype,)
        for n in self.layout.frozen:
            shape, dtype = self.layout.frozen.meta(n)
            yield f"frozen/{n}", shape, (dtype,)
        given = self.layout.buffer_dtypes
        for n, t in self.module.named_buffers():
            dtypes: tuple[torch.dtype, ...] = (given.get(n, t.dtype),)
            if t.is_floating_point():
                dtypes += (PRECISIONS[precision],)
            yield f"buffers/{n}", tuple(t.shape), dtypes

    def meta(self) -> dict:
        return {
            "precision": self.precision,
            "step": self.stepper.steps,
            "param_step": self.stepper.param_steps(),
            "scaler": self.scaler.state_dict(),
            "groups": [
                {**{k: g[k] for k in HYPER if k in g}, "name": g["name"], "params": list(g["param_names"])}
                for g in self.param_groups
            ],
        }

    def check_groups(self, saved: list[dict], what: str) -> None:
        """A checkpoint's param groups (``saved``, its meta's) are this model's: as many, and
        (written by a version that records them: MEMBERS) the same names with the same
        parameters, in the same order; else a ``tiermem:`` error naming ``what``."""
        fix = "build the same param groups (the optimizer's, and tm.optimizer.add_param_group) before loading"
        if len(saved) != len(self.param_groups):
            raise TierMemError(
                f"tiermem: {what} has {len(saved)} param groups, this model {len(self.param_groups)}; "
                f"nothing was loaded: {fix}"
            )
        for i, (theirs, ours) in enumerate(zip(saved, self.param_groups)):
            if "name" not in theirs:
                continue  # written before groups were recorded: matched by their number
            extra = sorted(set(theirs.get("params", ())) - set(ours["param_names"]))
            lacking = sorted(set(ours["param_names"]) - set(theirs.get("params", ())))
            if theirs["name"] != ours["name"] or extra or lacking:
                raise TierMemError(
                    f"tiermem: {what} has other param groups than this model: group {i} is "
                    f"{theirs['name']!r} there, {ours['name']!r} here (only there: {extra[:3]}, only "
                    f"here: {lacking[:3]}); nothing was loaded: {fix}"
                )

    def fp32_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter name (tied aliases included) -> a CPU copy of its fp32 value."""
        return {alias: value for names, value in self.stream_weights() for alias in names}

    def stream_weights(
        self,
        *,
        frozen: bool = True,
        dtype: torch.dtype = torch.float32,
        alloc: Optional[Callable[[torch.Size, torch.dtype], torch.Tensor]] = None,
    ) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
        """Each parameter's names (tied aliases included, the module's own name first) and a CPU copy of
        its value, the master rounded to ``dtype`` (default fp32: exact; frozen ones in their own dtype;
        ``frozen=False``: trained ones only), one at a time, bucket by bucket: what a caller does not
        keep is all the memory it costs (NOTE [Weights read one tensor at a time]). ``alloc(shape,
        dtype)``: where each copy goes (default: a new tensor)."""
        for b, master in self._bucket_masters():
            for s in b.slots:
                value = master[s.offset : s.offset + s.numel].view(s.shape).detach()
                out = alloc(s.shape, dtype) if alloc is not None else torch.empty(s.shape, dtype=dtype)
                yield self.layout.names[id(s.param)], out.copy_(value)
        if not frozen:
            return
        params = dict(self.module.named_parameters())
        for name in self.layout.frozen:
            yield self.layout.names[id(params[name])], self.layout.frozen.value(name, own=True)

    def buffer_values(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The buffers ``module.state_dict()`` holds (persistent ones), in their original dtypes."""
        kept, params = self.layout.buffers, {n for n, _ in self.module.named_parameters(remove_duplicate=False)}
        for k, v in self.module.state_dict().items():
            if k not in params:
                yield k, kept.value(k, v)

    def module_state(self) -> dict[str, torch.Tensor]:
        """``module.state_dict()``'s keys: fp32 weights, buffers in their original dtypes."""
        weights = self.fp32_weights()
        kept = self.layout.buffers  # NOTE [Buffers keep their values]
        return {k: weights[k] if k in weights else kept.value(k, v) for k, v in self.module.state_dict().items()}

    # -- this process's part of the state (a sharded checkpoint) ----------------------------------------
    def pieces(self) -> list[tuple[int, list[Piece]]]:
        """Each bucket's index and the pieces of its parameters this process keeps, in bucket
        order (every piece of a parameter lies in one bucket); reads nothing."""
        steps = {sb.index: sb for sb in self.layout.step_buckets}
        out = []
        for b in self.layout.buckets:
            start = chunk_of(self.group, b).start  # where this process's part begins in the bucket
            whole = {s.name: s for s in b.slots}
            mine = []
            for p in steps[b.index].slots:
                s = whole[p.name]
                lo = start + p.offset - s.offset
                mine.append(Piece(p.name, tuple(s.shape), lo, lo + p.numel, p.offset))
            if self.group.rank == 0:  # a parameter of no elements is in no rank's chunk: rank 0 keeps its name
                kept = {p.name for p in mine}
                mine += [Piece(s.name, tuple(s.shape), 0, 0, 0) for s in b.slots if s.numel == 0 and s.name not in kept]
            out.append((b.index, mine))
        return out

    def part_pieces(self, index: int, pieces: list[Piece]) -> list[tuple[str, torch.dtype, list[Piece]]]:
        """Per part of bucket ``index``'s state format: its name, dtype and this process's pieces of
        it, given :meth:`pieces`' ``pieces`` of the bucket. An elementwise part's are ``pieces``; a
        blocked part's (8-bit state's absmax) count blocks: a parameter of n elements has
        ceil(n / block), its piece [lo, hi) (lo on a block: NOTE [Chunks cut where the state
        allows]) the blocks [lo / block, ceil(hi / block)), at its place in the part's buffer."""
        sb = next(b for b in self.layout.step_buckets if b.index == index)
        where = {s.name: j for j, s in enumerate(sb.slots)}
        offsets = sb.part_offsets()
        out = []
        for i, part in enumerate(self._bucket[index].state.parts):
            if part.block == 1:
                out.append((part.name, part.dtype, pieces))
                continue
            mine = []
            for p in pieces:
                assert p.lo % part.block == 0, "a chunk cut a parameter off its blocks"
                numel = math.prod(p.shape)
                at = offsets[i][where[p.name]] if p.hi > p.lo else 0
                mine.append(Piece(p.name, (part.numel(numel),), p.lo // part.block, part.numel(p.hi), at))
            out.append((part.name, part.dtype, mine))
        return out

    def resident(self, index: int) -> bool:
        """Whether :meth:`read_local` of bucket ``index`` gives the live state, not a staging copy."""
        return self.layout.homes.state[index].resident

    def read_local(self, index: int) -> tuple[torch.Tensor, ...]:
        """This process's part of bucket ``index``'s state (each part of its format), no
        communication; valid until the next read (then :meth:`release`)."""
        return self.layout.homes.state[index].read_local(self._bucket[index])

    def release(self) -> None:
        """Done reading or writing buckets: whole-bucket buffers kept for that go."""
        self._release()

    # NOTE [A failed load is guarded]
    # A load checks everything before it changes anything, but a read can still fail part way
    # (an I/O error, a file that changed after its checksum passed): some buckets then hold the
    # checkpoint's state and the rest the run's. :meth:`updating` records the failure, and until a
    # load succeeds a forward, ``tm.step()``, ``tm.save()`` and ``tm.sharded_state_dict()`` raise a
    # ``tiermem:`` error naming it, as after a step that failed part way (NOTE [A failed step is
    # rolled forward]). Under data parallelism every rank learns of the failure after the last
    # bucket (the buckets' collectives kept in step) and raises the same error.
    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """The weights are about to be replaced (a checkpoint load): cached copies are stale. If
        the load raises part way, the model holds some of the state and not the rest: it refuses
        to compute until a load succeeds (NOTE [A failed load is guarded])."""
        homes = self.layout.homes
        for home in homes.weight_homes():
            home.begin_update()
        try:
            yield
        except BaseException as e:
            self.failed_load = f"{type(e).__name__}: {e}"
            raise
        self.failed_load = None
        for home in homes.weight_homes():
            home.end_update()

    def check_loaded(self, call: str) -> None:
        """Refuse ``call`` (a forward, step or checkpoint) while a failed load left the model half
        loaded (NOTE [A failed load is guarded])."""
        if self.failed_load is not None:
            raise TierMemError(
                f"tiermem: {call} would use a half-loaded model: the last load failed part way, after "
                f"replacing some of the state ({self.failed_load}); tm.load() a checkpoint (one that "
                f"loads whole lifts this)"
            )

    def load_local(self, index: int, fill: Callable[[tuple[torch.Tensor, ...]], None]) -> None:
        """Replace this process's part of bucket ``index``'s state with what ``fill(views)`` writes
        into ``views`` (zeros elsewhere), then send the bucket's weights home (under data
        parallelism a collective: every rank calls it for every bucket, in order)."""
        b = self._bucket[index]
        homes = self.layout.homes
        home = homes.state[index]
        views = home.local_views(b)
        fill(views)
        home.store_local(b, views)
        homes.weights[index].load(b, home.whole_master(b, views[0]), homes.compute_tier(b))

    def frozen_pieces(self) -> list[tuple[int, list[Piece]]]:
        """Like :meth:`pieces`, for the frozen buckets sharded over the ranks (NOTE [Frozen weights
        sharded over the ranks]): the pieces of the frozen parameters whose value is their working
        copy this process keeps (``at``: in its chunk); none in one process or under ZeRO-2."""
        return [(index, [Piece(*p) for p in mine]) for index, mine in self.layout.frozen.local_pieces()]

    def read_frozen(self, index: int) -> torch.Tensor:
        """This process's chunk of frozen bucket ``index`` as it rests at home; no communication;
        valid until the next read (then :meth:`release`)."""
        self._release_frozen()
        chunk, self._frozen_release = self.layout.frozen.read_local(index)
        return chunk

    def load_frozen(self, index: int, fill: Callable[[torch.Tensor], None]) -> None:
        """Replace this process's pieces of frozen bucket ``index`` (:meth:`frozen_pieces`) with
        what ``fill(chunk)`` writes into a host copy of its chunk; no communication."""
        chunk = self.read_frozen(index).to("cpu", copy=True)
        self._release_frozen()
        fill(chunk)
        self.layout.frozen.write_local(index, chunk)

    def _release_frozen(self) -> None:
        release, self._frozen_release = self._frozen_release, None
        if release is not None:
            release()

    def rest(self, *, load: bool = False, pieces: bool = False) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint holds besides the optimizer state, by name: ``frozen/<param>``
        in the parameter's own dtype (NOTE [Frozen weights keep one copy]: its copy, or its
        working copy read from home), ``buffers/<buffer>`` the module's. With ``load``, tensors to
        fill in place instead (a working copy off the device is not read), then
        :meth:`commit_rest` with them. With ``pieces``, the frozen parameters sharded over the
        ranks are left out: the caller reads and writes them as :meth:`frozen_pieces` (NOTE
        [Frozen weights sharded over the ranks]); without, reading them gathers (collective)."""
        frozen = self.layout.frozen
        names = [n for n in frozen if not (pieces and frozen.collective(n))]
        out = {f"frozen/{n}": frozen.target(n) if load else frozen.value(n) for n in names}
        out.update((f"buffers/{name}", t) for name, t in self.module.named_buffers())
        return out

    def commit_rest(self, rest: dict[str, torch.Tensor]) -> None:
        """Frozen parameters take the values filled into ``rest`` (:meth:`rest` with ``load``), at their home."""
        for name in self.layout.frozen:
            if f"frozen/{name}" in rest:  # else loaded as pieces (:meth:`load_frozen`)
                self.layout.frozen.write(name, rest[f"frozen/{name}"])

    # -- writing ------------------------------------------------------------------------------------
    def load(self, read_into: Callable[[str, torch.Tensor], None], meta: dict) -> None:
        """Fill every tensor through ``read_into(name, target)`` (the caller has validated the
        whole checkpoint first), send the weights home, then take the step counts, loss scale
        (only from a checkpoint of this precision) and hyperparameters from ``meta``."""
        homes = self.layout.homes
        with self.updating():
            for b in self.layout.buckets:
                views = homes.state[b.index].load_views(b)
                for i, part in enumerate(b.state.parts):
                    for j, s in enumerate(b.slots):
                        read_into(f"{part.name}/{s.name}", b.pieces(views, j)[i])
                homes.state[b.index].store(b, views)
                homes.weights[b.index].load(b, views[0], homes.compute_tier(b))
            self._release()
            frozen = self.layout.frozen
            for name in frozen:  # one at a time: a working copy off the device is read from no further
                t = frozen.target(name)
                read_into(f"frozen/{name}", t)
                frozen.write(name, t)
            for name, t in self.module.named_buffers():
                read_into(f"buffers/{name}", t)
        self.take_meta(meta)

    def take_meta(self, meta: dict) -> None:
        """The step counts, loss scale (only from a checkpoint of this precision) and
        hyperparameters of a validated checkpoint's ``meta``."""
        for group, saved in zip(self.param_groups, meta["groups"]):
            group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in HYPER})
        if meta["precision"] == self.precision:
            self.scaler.load_state_dict(meta["scaler"])
        else:  # another precision's scale means nothing here (fp32's 1.0 would defeat fp16's scaling)
            log.info(
                "tiermem: a %s checkpoint loaded at %s: the loss scale stays %s",
                meta["precision"],
                self.precision,
                self.scaler.scale,
            )
        self.stepper.load_param_steps({k: int(v) for k, v in meta["param_step"].items()}, meta["step"])

    def take_weights(self, values: dict[str, torch.Tensor]) -> None:
        """User code wrote into weights (``tm.resident(...)``): name -> the working-precision value
        now. Each element that differs from its fp32 master rounded to the working precision (what
        it held before) becomes the master (or the frozen parameter's fp32 copy); the others keep
        their fp32 value."""
        slots = {s.name: (b, s) for b in self.layout.buckets for s in b.slots}
        by_bucket: dict[int, list] = {}
        for name, value in values.items():
            if name in slots:
                b, s = slots[name]
                by_bucket.setdefault(b.index, [b]).append((s, value))
            elif self.layout.frozen.keeps_copy(name):  # else the working copy is its value: already home
                copy = self.layout.frozen.value(name)  # the host copy itself, or read from NVMe
                if _take(copy, value):
                    self.layout.frozen.write_copy(name, copy)
        homes = self.layout.homes
        try:
            for b, *entries in by_bucket.values():
                views = homes.state[b.index].read(b)
                if any([_take(views[0][s.offset : s.offset + s.numel].view(s.shape), value) for s, value in entries]):
                    homes.state[b.index].store(b, views)
        finally:
            self._release()


def _shaped(t: torch.Tensor, part: StatePart, shape: torch.Size) -> torch.Tensor:
    """A parameter's piece of a part as a checkpoint holds it: the parameter's shape for an
    elementwise part, flat for a blocked one (one value per block) or a factored one (one per row
    or column)."""
    return t.view(shape) if part.elementwise else t


def _take(master: torch.Tensor, value: torch.Tensor) -> bool:
    """Copy into ``master`` the elements of ``value`` that differ from ``master`` in ``value``'s
    dtype; whether any did."""
    value = value.detach().to(master.device)
    changed = value != master.to(value.dtype)
    if not changed.any():
        return False
    master[changed] = value[changed].to(master.dtype)
    return True
