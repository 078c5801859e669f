"""Buckets: trainable parameters packed into contiguous flat buffers, in reverse order of use.

Backward produces the last layers' gradients first, so buckets are filled from the end of the
model: bucket 0's grads are complete first and its transfer starts while backward goes on.
Parameters that share a placement (the tiers of their GRAD and OPTIM_STATE) share buckets.
A bucket only records layout (names, offsets, sizes); the buffers themselves belong to stores.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Sequence

import torch

from tiermem.optim.formats import ADAM, StateFormat
from tiermem.types import Tier

#: the three fp32 tensors of Adam's state (:data:`tiermem.optim.formats.ADAM`); a bucket's own are
#: ``bucket.state.names`` (NOTE [State formats])
STATE_PARTS = ADAM.names


@dataclass
class Slot:
    """One parameter's place in its bucket."""

    name: str
    param: torch.nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    order: int  # position in reverse order of use: the same whatever the placement
    first: int = 0  # index in the parameter of the slot's first element (a rank's chunk may start inside it)


@dataclass
class Bucket:
    index: int
    grad_tier: Tier
    state_tier: Tier
    group: int  # index of its parameters' optimizer param group in Plan.groups (and tm.optimizer.param_groups)
    param_tier: Tier = Tier.DEVICE  # home of the working weights
    slots: list[Slot] = field(default_factory=list)
    numel: int = 0
    state: StateFormat = ADAM  # its parameters' optimizer state (NOTE [State formats])
    frozen: bool = False  # frozen parameters' working weights, sharded over the ranks (no grads, no state)
    #: part_offsets() as last computed, for that many slots under that format (slots are only appended)
    _offsets: Optional[tuple[int, StateFormat, list[list[int]]]] = field(
        default=None, init=False, repr=False, compare=False
    )

    @property
    def key(self) -> str:
        return f"bucket{self.index}"

    def add(self, name: str, param: torch.nn.Parameter, order: int) -> None:
        self.slots.append(Slot(name, param, self.numel, param.numel(), param.shape, order))
        self.numel += param.numel()

    def slots_within(self, lo: int, hi: int) -> list[tuple[Slot, int, int]]:
        """Each slot that elements ``[lo, hi)`` of the bucket overlap, with the overlap's first
        and end element in its parameter."""
        out = []
        for s in self.slots:
            first, last = max(lo, s.offset) - s.offset, min(hi, s.offset + s.numel) - s.offset
            if first < last:
                out.append((s, first, last))
        return out

    # NOTE [Chunks cut where the state allows]
    # Under data parallelism each rank owns one chunk of every bucket, ``chunk_size(world)``
    # elements at ``rank * chunk_size`` (the last short or empty, every chunk padded to that size for
    # the collectives). A chunk edge that falls inside a parameter must leave that parameter's
    # state in whole pieces on either side: the state format says where (StateFormat.next_cut:
    # anywhere for elementwise state; at a multiple of 256 from the parameter's own element 0 for
    # 8-bit state, so each rank quantizes the very blocks one process does and the numbers stay
    # bit for bit those of one process; only at parameter edges for an indivisible state). The size
    # starts at the even share, ceil(numel / world), and grows until every edge inside the bucket
    # falls where allowed: for 8-bit state and 2 ranks by at most 255 elements. Elementwise
    # buckets keep the even share. The plan (footprint) and the homes both take this one size.
    def chunk_size(self, world: int) -> int:
        """Elements of each rank's chunk of this bucket under ``world`` ranks (NOTE [Chunks cut
        where the state allows])."""
        if world <= 1 or self.numel == 0:
            return self.numel
        size = -(-self.numel // world)
        if self.state.elementwise and self.state.divisible:
            return size
        slots = [s for s in self.slots if s.numel]  # the one that holds an edge
        starts = [s.offset for s in slots]
        r = 1
        while r < world and r * size < self.numel:
            edge = r * size
            if not slots:  # a plan's bucket of ``numel`` parameters: as one parameter
                allowed = self.state.next_cut(edge, self.numel)
            else:
                s = slots[bisect.bisect_right(starts, edge) - 1]
                allowed = s.offset + self.state.next_cut(edge - s.offset, s.numel)
            if allowed == edge:
                r += 1
                continue
            size = -(-allowed // r)  # every edge moves out with the size: check them all again
            r = 1
        return size

    def chunk_part_numels(self, world: int, rank: Optional[int] = None) -> list[int]:
        """Elements of each part of the state rank ``rank`` keeps of this bucket under ``world``
        ranks; without ``rank`` the most any rank keeps (NOTE [Chunks cut where the state allows]):
        elementwise parts the chunk's padded size; a blocked part one element per started block of
        each piece of a parameter in the chunk (a piece's last block may be short: ranks differ)."""
        size = self.chunk_size(world)
        counts = [p.numel(size) for p in self.state.parts]
        if self.state.elementwise or not self.slots:
            return counts
        most = [0 if p.block != 1 else n for p, n in zip(self.state.parts, counts)] if rank is not None else counts
        for r in range(world) if rank is None else [rank]:
            lo, hi = min(r * size, self.numel), min((r + 1) * size, self.numel)
            pieces = [min(s.offset + s.numel, hi) - max(s.offset, lo) for s in self.slots]
            pieces = [n for n in pieces if n > 0]
            for i, p in enumerate(self.state.parts):
                if p.block != 1:
                    most[i] = (
                        max(most[i], sum(p.numel(n) for n in pieces))
                        if rank is None
                        else sum(p.numel(n) for n in pieces)
                    )
        return most

    def part_numels(self) -> list[int]:
        """Elements of each part of the state (``state.parts``) for the whole bucket."""
        return [
            sum(p.numel(s.numel, s.shape) for s in self.slots)
            if not p.elementwise and self.slots
            else p.numel(self.numel)
            for p in self.state.parts
        ]  # (a bucket of no slots: a plan's one bucket of ``numel`` parameters)

    def part_offsets(self) -> list[list[int]]:
        """Per part of the state, where each slot's piece starts in that part's buffer."""
        if self.state.elementwise:
            return [[s.offset for s in self.slots]] * len(self.state.parts)
        cached = self._offsets  # each slot's piece asks for them: computed once, not once per slot
        if cached is None or cached[0] != len(self.slots) or cached[1] is not self.state:
            offsets = self.state.offsets([s.numel for s in self.slots], [s.shape for s in self.slots])
            self._offsets = cached = (len(self.slots), self.state, offsets)
        return cached[2]

    def joined_bytes(self) -> int:
        """Bytes of the whole state as one buffer (one NVMe value): :meth:`StateFormat.joined`."""
        return self.state.joined(self.part_numels())[1]

    def pieces(self, views: tuple[torch.Tensor, ...], slot_index: int) -> list[torch.Tensor]:
        """Slot ``slot_index``'s piece of each part, given the bucket's ``views`` (one per part)."""
        s = self.slots[slot_index]
        if self.state.elementwise:
            return [v[s.offset : s.offset + s.numel] for v in views]
        return [
            v[at[slot_index] : at[slot_index] + p.numel(s.numel, s.shape)]
            for v, p, at in zip(views, self.state.parts, self.part_offsets())
        ]


class Placed(NamedTuple):
    """A trainable parameter, its homes and its param group: what :func:`plan_buckets` packs."""

    name: str
    param: torch.nn.Parameter
    grad_tier: Tier
    state_tier: Tier
    group: int  # index in Plan.groups
    param_tier: Tier
    state: StateFormat = ADAM


def plan_buckets(
    params: Sequence[Placed], bucket_numel: int, *, first_index: int = 0, first_order: int = 0
) -> list[Bucket]:
    """Pack the parameters in the order given (already reverse order of use) into buckets of at
    most ``bucket_numel`` elements (a larger single parameter gets a bucket of its own). A bucket
    holds one placement, one param group and one state format, so each bucket is one kernel family.
    ``first_index``/``first_order``: where the buckets' indices and the slots' orders start (past
    a model's buckets, for parameters unfrozen later: NOTE [Freezing and unfreezing])."""
    buckets: list[Bucket] = []
    open_: dict[tuple[Any, ...], Bucket] = {}
    for order, (name, p, grad_tier, state_tier, group, param_tier, fmt) in enumerate(params, start=first_order):
        k = (grad_tier, state_tier, group, param_tier, fmt)
        b = open_.get(k)
        if b is None or (b.numel and b.numel + p.numel() > bucket_numel):
            b = open_[k] = Bucket(first_index + len(buckets), grad_tier, state_tier, group, param_tier, state=fmt)
            buckets.append(b)
        b.add(name, p, order)
    return buckets
