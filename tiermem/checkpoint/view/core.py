"""What the reader and the writer of a TieredModel's state share: :class:`StateCore`, the model's
parts a checkpoint reaches (its module, layout, step counts, loss scale, param groups, process
group) and what they are made of (the pieces of each bucket this process keeps), reading and
writing no tensor; and whether the last load failed part way (NOTE [A failed load is guarded]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from tiermem.config.rules import ALL_GROUP_HYPER
from tiermem.errors import TierMemError
from tiermem.plan.buckets import Bucket
from tiermem.train.homes.sharded import chunk_of
from tiermem.train.layout import Layout
from tiermem.train.step.scaler import LossScaler
from tiermem.train.step.stepper import Stepper
from tiermem.transfer.collectives import Group, Solo

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


class PartPieces(NamedTuple):
    """One part of a bucket's state format (its name and dtype) and this process's pieces of it."""

    part: str
    dtype: torch.dtype
    pieces: list[Piece]


class StateCore:
    """The model's parts a checkpoint reaches, and this process's share of them; reads nothing."""

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
        #: the error of a load that failed part way (NOTE [A failed load is guarded])
        self.failed_load: Optional[str] = None
        self.loads = 0  # loads begun (a state dict taken before one does not go with the state after it)

    def bucket(self, index: int) -> Bucket:
        return self._bucket[index]

    def all_ok(self, ok: bool) -> bool:
        """True on every rank when ``ok`` is True on every rank (one process: ``ok``)."""
        return self.group.all_ok(ok)

    def release_views(self) -> None:
        """Done reading or writing buckets: the whole-bucket buffers the state homes kept for that go."""
        for home in self.layout.homes.state_homes():
            home.release_views()

    def check_loaded(self, call: str) -> None:
        """Refuse ``call`` (a forward, step or checkpoint) while a failed load left the model half
        loaded (NOTE [A failed load is guarded])."""
        if self.failed_load is not None:
            raise TierMemError(
                f"tiermem: {call} would use a half-loaded model: the last load failed part way, after "
                f"replacing some of the state ({self.failed_load}); tm.load() a checkpoint (one that "
                f"loads whole lifts this)"
            )

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

    def part_pieces(self, index: int, pieces: list[Piece]) -> list[PartPieces]:
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
                out.append(PartPieces(part.name, part.dtype, pieces))
                continue
            mine = []
            for p in pieces:
                assert p.lo % part.block == 0, "a chunk cut a parameter off its blocks"
                numel = math.prod(p.shape)
                at = offsets[i][where[p.name]] if p.hi > p.lo else 0
                mine.append(Piece(p.name, (part.numel(numel),), p.lo // part.block, part.numel(p.hi), at))
            out.append(PartPieces(part.name, part.dtype, mine))
        return out

    def frozen_pieces(self) -> list[tuple[int, list[Piece]]]:
        """Like :meth:`pieces`, for the frozen buckets sharded over the ranks (NOTE [Frozen weights
        sharded over the ranks]): the pieces of their parameters this process keeps (``at``: in
        its chunk; a parameter that keeps a copy in its own dtype keeps the same piece of it,
        which is its value: :meth:`frozen_dtype`); none in one process or under ZeRO-2."""
        return [(index, [Piece(*p) for p in mine]) for index, mine in self.layout.frozen.local_pieces()]

    def frozen_dtype(self, name: str) -> torch.dtype:
        """The dtype a checkpoint holds frozen parameter ``name`` in: its own (NOTE [Frozen weights
        keep one copy]: its working copy's where they agree, else its copy's)."""
        return self.layout.frozen.meta(name)[1]

    def whole_frozen(self, *, pieces: bool) -> list[str]:
        """The frozen parameters a checkpoint holds whole, by name (``frozen/<param>``): with
        ``pieces``, those sharded over the ranks are left out (read and written as
        :meth:`frozen_pieces`, their copies in their own dtype too: NOTE [Frozen weights sharded
        over the ranks])."""
        frozen = self.layout.frozen
        return [n for n in frozen if not (pieces and frozen.collective(n))]
