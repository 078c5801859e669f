"""The parts of a footprint (NOTE [Footprint] in :mod:`tiermem.plan.footprint`): what the bytes are
for, and one function per class of buffer that adds its bytes (the working weights, grads and
optimizer state of a bucket; the NVMe buffers and journal; the data-parallel, staging, gather and
frozen-weight buffers). :func:`tiermem.plan.footprint.footprint` composes them; nothing here is
called from elsewhere, and the names a caller uses are exported there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tiermem.plan.buckets import Bucket
from tiermem.plan.placement import (
    compute_tier,
    master_is_weights,
    weights_from_master,
    weights_sharded,
    writes_weights_in_place,
)
from tiermem.types import Tier

#: Bytes per tier, by purpose: ``{tier: {purpose: bytes}}``; a tier is present only when
#: something is placed on it (the device always: grads are made there).
Footprint = dict[Tier, dict[str, int]]

#: The engine's NVMe lane threads (tiermem/transfer/lanes.py makes that many). On a GPU each
#: request between NVMe and the device holds one host staging buffer for its length
#: (TransferEngine._copy), so at most this many are live at once (NOTE [Footprint]).
NVME_THREADS = 4

FP32 = torch.float32.itemsize  # grads at their home

# What the bytes are for: the keys of a Footprint's inner dicts, as OutOfTierMemory prints them.
WORKING_WEIGHTS = "working weights"
GRADS = "fp32 grads"
OPTIM_STATE = "optimizer state"
OPTIM_STATE_NVME = "optimizer state (one value per key)"
NVME_JOURNAL = "writes in flight beside their key's value (the journal)"
FROZEN_WEIGHTS = "frozen weights"
GRADS_FOR_STEP = "grads for the step"
SECOND_GRADS = "second grad buffer (overlap_step)"
UPDATED_WEIGHTS = "updated weights (overlap_step)"
GRADS_TO_NVME = "grads on their way to NVMe (about 3 buckets)"
GRADS_IN_BACKWARD = "grads of the buckets being updated in backward (a few buckets)"
STATE_PIPELINE = "optimizer state pipeline (3 buckets)"
WEIGHT_STAGING = "weight staging (up to 2 buckets)"
FROZEN_COPY = "fp32 copy of frozen weights"
GRADS_IN_FLIGHT = "grads in flight (largest parameter)"
LARGEST_MODULE = "weights of the largest module, while it runs"
GRADS_TO_REDUCE = "grads on their way to be reduce-scattered (about 4 buckets)"
WHOLE_BUCKET = "one whole bucket of optimizer state, gathered to be read"
PAGE_ROUNDING = "host buffers rounded up to whole pages"
NVME_STAGING = f"staging between NVMe and the device (up to {NVME_THREADS} weights)"
GATHERED = "sharded weights gathered on the device (held, and gathered ahead)"
GATHER_STAGING = "sharded weights' chunks read from NVMe for their gathers"
GATHER_ROUNDED = "sharded weights' chunks rounded from their masters for their gathers"

#: The purposes that are the training state itself (see NOTE [Footprint]).
TRAINING_STATE = frozenset({WORKING_WEIGHTS, GRADS, OPTIM_STATE, OPTIM_STATE_NVME, FROZEN_WEIGHTS})

#: Buckets' bytes gathered ahead of use, or kept after it, besides the held ones: this many of
#: the largest sharded bucket (NOTE [A gather schedule every rank takes alike]).
GATHER_AHEAD = 2

#: The host pool's page (tiermem.memory.aligned.ALIGN; the plan layer does not import the memory layer).
HOST_PAGE = 4096

#: Buckets whose grads the host holds at once under update_in_backward, at most: one landing, one
#: being updated, and parameters of the next arriving before the last of this one
#: (NOTE [Updates in backward] in tiermem/train/step/in_backward.py)
WINDOW_BUCKETS = 4

#: Buckets whose writes can be in flight on NVMe at once, by what they write (NOTE [Footprint]).
JOURNAL_BUCKETS = {"state": 3, "weights": 2, "grads": 4}


def host_buffer_bytes(nbytes: int) -> int:
    """What the host pool takes for a buffer of ``nbytes``: whole pages, and at least one
    (``round_up(max(nbytes, 1))`` of tiermem/memory/aligned.py; a test holds the two equal)."""
    return -(-max(nbytes, 1) // HOST_PAGE) * HOST_PAGE


def keeps_copy(dtype: torch.dtype, working: torch.dtype, floating: bool) -> bool:
    """Whether a frozen parameter of ``dtype`` keeps a host copy beside its working copy in
    ``working`` (NOTE [Frozen weights keep one copy] in tiermem/train/weights/frozen.py)."""
    return floating and dtype != working


def copy_tier(home: Tier) -> Tier:
    """Where a frozen parameter whose working copy is homed on ``home`` keeps the copy
    :func:`keeps_copy` asks for: on NVMe beside a working copy there, else on the host (NOTE
    [Frozen weights keep one copy] in tiermem/train/weights/frozen.py)."""
    return Tier.NVME if home == Tier.NVME else Tier.HOST


def gather_ahead(padded: Sequence[int]) -> int:
    """The bytes of sharded buckets gathered ahead of use or kept after it, besides the held ones
    (``padded``: each sharded bucket's bytes gathered): the same on every rank."""
    return GATHER_AHEAD * max(padded, default=0)


def add(need: Footprint, tier: Tier, purpose: str, nbytes: int, *, buffers: Sequence[int] = ()) -> None:
    """Add ``nbytes`` for ``purpose`` on ``tier`` to ``need``; ``buffers``: the sizes of the buffers
    they are allocated as, when on the host (NOTE [Footprint]: page rounding)."""
    parts = need.setdefault(tier, {})
    parts[purpose] = parts.get(purpose, 0) + nbytes
    if tier == Tier.HOST and buffers:
        assert sum(buffers) == nbytes, (purpose, nbytes, buffers)
        parts[PAGE_ROUNDING] = parts.get(PAGE_ROUNDING, 0) + sum(host_buffer_bytes(n) - n for n in buffers)


def add_each(need: Footprint, tier: Tier, purpose: str, nbytes: int, count: int = 1) -> None:
    """:func:`add` ``count`` buffers of ``nbytes`` each."""
    add(need, tier, purpose, count * nbytes, buffers=[nbytes] * count)


@dataclass(frozen=True)
class Layout:
    """What the parts read of a layout besides its buckets: the working precision ``dtype``, the
    ``world`` of ranks, ``overlap_step``, whether the device is the CPU, and which buckets keep
    their weights how (by bucket index): ``sharded`` over the ranks, ``from_master`` (a chunk
    rounded from its master for each gather: NOTE [A chunk rounded from its master]), and
    ``one_copy`` (a bf16 master that is its weights: NOTE [One copy of bf16 master weights])."""

    dtype: torch.dtype
    world: int
    overlap: bool
    device_is_host: bool
    sharded: frozenset[int]
    from_master: frozenset[int]
    one_copy: frozenset[int]

    @classmethod
    def of(
        cls, buckets: Sequence[Bucket], dtype: torch.dtype, world: int, *, shard: bool, overlap: bool, on_host: bool
    ) -> Layout:
        """The layout of ``buckets`` (``shard``: ``shard_weights``; ``on_host``: ``device_is_host``)."""
        sharded = frozenset(b.index for b in buckets if weights_sharded(b, world, shard))
        from_master = frozenset(
            b.index for b in buckets if weights_from_master(b, b.index in sharded, overlap, device_is_host=on_host)
        )
        one_copy = frozenset(b.index for b in buckets if master_is_weights(b, b.index in sharded, overlap))
        return cls(dtype, world, overlap, on_host, sharded, from_master, one_copy)

    @property
    def w(self) -> int:
        """Bytes per element of the working precision."""
        return self.dtype.itemsize

    def chunk(self, b: Bucket) -> int:
        """Elements of this rank's chunk of ``b`` (NOTE [Chunks cut where the state allows])."""
        return b.chunk_size(self.world)

    def part_numels(self, b: Bucket) -> list[int]:
        """Elements of each part of this rank's state of ``b``: its chunk's under DP."""
        return b.chunk_part_numels(self.world) if self.world > 1 else b.part_numels()

    def state_joined(self, b: Bucket) -> int:
        """Bytes of this rank's state of ``b`` as one buffer (one NVMe value)."""
        return b.state.joined(self.part_numels(b))[1]


# -- the parts of each bucket ------------------------------------------------------------------
def working_weights(need: Footprint, lay: Layout, b: Bucket) -> None:
    """Bucket ``b``'s working weights at its PARAM tier: this rank's chunk (one buffer) where kept
    sharded, nothing where they are views of a master on the host, else one buffer per parameter."""
    w, n = lay.w, lay.chunk(b)
    if b.index in lay.sharded - lay.from_master:  # rounded from the master: no chunk kept
        add(need, b.param_tier, WORKING_WEIGHTS, n * w, buffers=[n * w] if b.param_tier == Tier.HOST else ())
    elif b.index in lay.one_copy and b.param_tier == Tier.HOST:
        pass  # views of the master, counted with the optimizer state
    elif b.index not in lay.sharded:
        off_device = b.param_tier != Tier.DEVICE
        add(
            need,
            b.param_tier,
            WORKING_WEIGHTS,
            b.numel * w,
            buffers=[s.numel * w for s in b.slots] if off_device else (),
        )


def grads(need: Footprint, b: Bucket, n: int, tier: Tier) -> None:
    """The default step's GRAD home of bucket ``b`` (``n``: this rank's elements of it) on ``tier``: its
    fp32 grads, and the grads for the step where Adam runs on another tier in memory."""
    add_each(need, tier, GRADS, n * FP32)
    if compute_tier(b) != tier and tier != Tier.NVME:
        add_each(need, compute_tier(b), GRADS_FOR_STEP, n * FP32)


def optimizer_state(need: Footprint, lay: Layout, b: Bucket) -> None:
    """Bucket ``b``'s optimizer state: one NVMe value (less a master that is the weights, which the
    weights' keys hold), or one buffer per part in memory."""
    if b.state_tier == Tier.NVME:
        master = b.state.joined(lay.part_numels(b))[0][1] if b.index in lay.one_copy else 0
        add(need, Tier.NVME, OPTIM_STATE_NVME, lay.state_joined(b) - master)
    else:
        parts = [n * p.itemsize for p, n in zip(b.state.parts, lay.part_numels(b))]
        add(need, b.state_tier, OPTIM_STATE, sum(parts), buffers=parts)


def bucket(need: Footprint, lay: Layout, b: Bucket, update_in_backward: bool) -> None:
    """Everything bucket ``b`` holds itself: its weights, grads (none at rest under
    ``update_in_backward``), state, and ``overlap_step``'s second grads and updated weights."""
    n = lay.chunk(b)
    working_weights(need, lay, b)
    if not update_in_backward:  # its grads' home is made when a step first accumulates (accumulation_footprint)
        grads(need, b, n, b.grad_tier)
    optimizer_state(need, lay, b)
    if lay.overlap:
        add_each(need, b.grad_tier, SECOND_GRADS, n * FP32)
        add_each(need, compute_tier(b), UPDATED_WEIGHTS, n * lay.w)


# -- the model's buffers -----------------------------------------------------------------------
def grads_to_nvme(need: Footprint, largest: int) -> None:
    """The host buffers of the flushes of grads to NVMe (``largest``: the largest such bucket's
    elements, 0 for none)."""
    if largest:
        add_each(need, Tier.HOST, GRADS_TO_NVME, FP32 * largest, 3)


def nvme_buffers(
    need: Footprint, lay: Layout, buckets: Sequence[Bucket], sharded_frozen: Sequence[Bucket], update_in_backward: bool
) -> None:
    """The grads' window under ``update_in_backward``, the NVMe pipelines on the host, and the
    journal on NVMe (the writes in flight beside their keys' values)."""
    grads_largest = max(
        (lay.chunk(b) for b in buckets if b.grad_tier == Tier.NVME and not update_in_backward), default=0
    )
    if update_in_backward:
        add_each(need, Tier.HOST, GRADS_IN_BACKWARD, FP32 * max(b.numel for b in buckets), WINDOW_BUCKETS)
    grads_to_nvme(need, grads_largest)
    state_largest = max((lay.state_joined(b) for b in buckets if b.state_tier == Tier.NVME), default=0)
    if state_largest:
        add_each(need, Tier.HOST, STATE_PIPELINE, state_largest, 3)  # each set: a bucket's parts, back to back
    weights_largest = max(
        (
            lay.chunk(b) if b.index in lay.sharded or b.frozen else b.numel
            for b in [*buckets, *sharded_frozen]
            if b.param_tier == Tier.NVME
        ),
        default=0,
    )
    journal = (
        JOURNAL_BUCKETS["state"] * state_largest
        + JOURNAL_BUCKETS["weights"] * lay.w * weights_largest
        + JOURNAL_BUCKETS["grads"] * FP32 * grads_largest
    )
    if journal:
        add(need, Tier.NVME, NVME_JOURNAL, journal)


def data_parallel(need: Footprint, lay: Layout, buckets: Sequence[Bucket]) -> None:
    """Under DP: the grads on their way to be reduce-scattered, on the device, and one whole bucket
    of state on the host, while a checkpoint reads it."""
    padded = max((lay.chunk(b) * lay.world for b in buckets), default=0)
    add(need, Tier.DEVICE, GRADS_TO_REDUCE, 4 * FP32 * padded)  # a few buckets in flight, and one accumulating
    whole = {(p.name, p.dtype): p.itemsize * padded for b in buckets for p in b.state.parts}
    add(need, Tier.HOST, WHOLE_BUCKET, sum(whole.values()), buffers=list(whole.values()))


def weight_staging(need: Footprint, lay: Layout, buckets: Sequence[Bucket]) -> None:
    """Without ``overlap_step``: at each compute tier off the device, up to two buffers of its
    largest bucket that Adam writes the new weights into (none where it writes them in place)."""
    staged: dict[Tier, list[int]] = {}
    for b in buckets:
        if (
            compute_tier(b) != Tier.DEVICE
            and not writes_weights_in_place(b, b.index in lay.sharded, device_is_host=lay.device_is_host)
            and b.index not in lay.from_master
            and b.index not in lay.one_copy
        ):
            staged.setdefault(compute_tier(b), []).append(lay.chunk(b))
    for tier, numels in staged.items():
        add_each(need, tier, WEIGHT_STAGING, max(numels) * lay.w, min(2, len(numels)))  # a single bucket needs one


def sharded_frozen_weights(need: Footprint, lay: Layout, sharded_frozen: Sequence[Bucket]) -> None:
    """NOTE [Frozen weights sharded over the ranks]: this rank's chunk, one buffer, and where a
    parameter keeps a copy in its own dtype (NOTE [Frozen weights keep one copy]) this rank's
    piece of it, the chunk's elements, one buffer each, on the copy's tier (the pieces of the
    rank that keeps the most: the same figure on every rank)."""
    for b in sharded_frozen:
        n = lay.chunk(b) * lay.w
        add(need, b.param_tier, FROZEN_WEIGHTS, n, buffers=[n] if b.param_tier == Tier.HOST else ())
        copied = [s for s in b.slots if keeps_copy(s.param.dtype, lay.dtype, True)]
        if not copied:
            continue
        size, tier = lay.chunk(b), copy_tier(b.param_tier)
        ranks = []
        for r in range(lay.world):
            lo, hi = min(r * size, b.numel), min((r + 1) * size, b.numel)  # rank r's chunk
            spans = [(max(lo, s.offset), min(hi, s.offset + s.numel), s.param.element_size()) for s in copied]
            ranks.append([(last - first) * each for first, last, each in spans if first < last])
        pieces = max(ranks, key=lambda p: sum(map(host_buffer_bytes, p)) if tier == Tier.HOST else sum(p))
        add(need, tier, FROZEN_COPY, sum(pieces), buffers=pieces if tier == Tier.HOST else ())


def gathers(
    need: Footprint, lay: Layout, buckets: Sequence[Bucket], sharded_frozen: Sequence[Bucket], gathered_at_once: int
) -> None:
    """Sharded weights gathered on the device, with the host buffers their chunks on NVMe are read
    into and the buffers chunks rounded from their masters go through."""
    held = [b for b in [*buckets, *sharded_frozen] if b.index in lay.sharded or b.frozen]
    if not held:
        return
    w, in_flight = lay.w, gathered_at_once + GATHER_AHEAD
    gathered = [lay.chunk(b) * lay.world * w for b in held]
    add(need, Tier.DEVICE, GATHERED, min(sum(gathered), gathered_at_once * max(gathered) + gather_ahead(gathered)))
    on_disk = [lay.chunk(b) * w for b in held if b.param_tier == Tier.NVME]
    if on_disk:
        add_each(need, Tier.HOST, GATHER_STAGING, max(on_disk), min(len(on_disk), in_flight))
    rounded = [b for b in buckets if b.index in lay.from_master]
    for tier in dict.fromkeys(b.param_tier for b in rounded):
        largest = max(lay.chunk(b) * w for b in rounded if b.param_tier == tier)
        count = min(sum(b.param_tier == tier for b in rounded), in_flight)
        add(need, tier, GATHER_ROUNDED, count * largest, buffers=[largest] * count if tier == Tier.HOST else ())


def frozen_weights(need: Footprint, lay: Layout, frozen: Sequence[tuple[torch.Tensor, Tier]]) -> list[int]:
    """Each frozen parameter at its PARAM home, and its copy where it keeps one (NOTE [Frozen
    weights keep one copy]). Returns the bytes of those homed on NVMe."""
    on_nvme = []
    for p, home in frozen:
        size = p.numel() * (lay.w if p.is_floating_point() else p.element_size())
        add_each(need, home, FROZEN_WEIGHTS, size)  # (buffers count on the host only)
        if keeps_copy(p.dtype, lay.dtype, p.is_floating_point()):
            add_each(need, copy_tier(home), FROZEN_COPY, p.numel() * p.element_size())
        on_nvme += [size] if home == Tier.NVME else []
    return on_nvme


def nvme_staging(need: Footprint, on_nvme: Sequence[int]) -> None:
    """On a GPU: a host buffer per NVMe lane thread, of the largest weights on NVMe (``on_nvme``)."""
    if on_nvme:
        lane_buffers = sorted(on_nvme, reverse=True)[:NVME_THREADS]  # one per NVMe lane thread, the largest
        add(need, Tier.HOST, NVME_STAGING, sum(lane_buffers), buffers=lane_buffers)
