"""Where a model's bytes live: the placement plan turned into homes that own real buffers.

For each bucket (see :mod:`tiermem.plan.buckets`), :func:`make_homes` picks one home per class
(NOTE [Homes]): the gradient accumulation, the optimizer state and the working weights, each
from the tier the policy chose. :func:`build` then fills them with the module's weights: the fp32
master from the parameters, the working weights rounded from it, the moments zero. Frozen
parameters move to the device in the working precision (or to their home, when it is off the
device), floating-point buffers too, as ``module.half()`` would, their values as given kept
(NOTE [Buffers keep their values]).

NOTE [Initial writes in flight]
Building a model bigger than the machine is reading its checkpoint (or initializing it) and
writing each bucket to its NVMe homes. Waiting for each bucket's writes before filling the next
would leave the disk idle while the next bucket is read and cast, and the CPU idle while the disk
writes. So the homes leave their initial writes in flight: the optimizer state on NVMe fills host
sets 0 and 1 by turns, a set reused only once the writes from it have landed; the weights' home
keeps two buckets' copies in flight at most. The window is two buckets, whatever the model's
size. ``Homes.built()`` waits for all of them once every bucket is filled, and raises the first
error: construction fails there as it would have at the bucket (the homes are removed). A failure
elsewhere first drains them, then propagates. Any later use of a home settles them first.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, TypeVar

import torch

from tiermem.config.kinds import Kind
from tiermem.errors import ConfigError
from tiermem.observe.progress import Progress
from tiermem.plan.buckets import Bucket, Slot
from tiermem.plan.footprint import accumulation_footprint, check_fits
from tiermem.plan.placement import ParamGroup, accumulation_tier, compute_tier
from tiermem.train.homes.bucket_homes import Homes
from tiermem.train.homes.grad_homes import GradHome, MemoryGrads
from tiermem.train.homes.nvme_grads import NvmeGrads
from tiermem.train.homes.nvme_state import NvmeState
from tiermem.train.homes.sharded import ShardedGrads, ShardedState, ShardedWeights, shard_buckets
from tiermem.train.homes.state_homes import MemoryState, StateHome
from tiermem.train.homes.weight_homes import DeviceWeights, WeightHome
from tiermem.train.step.in_backward import WindowGrads
from tiermem.train.weights.buffers import KeptBuffers
from tiermem.train.weights.frozen import FrozenParams
from tiermem.train.weights.gathered import GatheredWeights
from tiermem.train.weights.materialize import Given, Values
from tiermem.train.weights.param_offload import ParamOffload
from tiermem.transfer.collectives import Group, Solo
from tiermem.transfer.service import CopyService
from tiermem.types import Tier


@dataclass(frozen=True)
class Layout:
    """The buckets and their homes, and what the module's own tensors became."""

    buckets: list[Bucket]
    step_buckets: list[Bucket]  # what grads and state homes hold: ``buckets``, or this rank's chunks of them
    homes: Homes
    groups: tuple[ParamGroup, ...]  # the optimizer param groups (Bucket.group indexes them)
    names: Mapping[int, tuple[str, ...]]  # id(param) -> every name it has (tied weights have several)
    slot_of: dict[int, tuple[Bucket, Slot]]  # id(param) -> its place
    frozen: FrozenParams  # parameters without optimizer state (NOTE [Frozen weights keep one copy])
    buffers: KeptBuffers  # NOTE [Buffers keep their values]

    @property
    def n_params(self) -> int:
        """Parameters with optimizer state (trainable, or frozen after they trained)."""
        return sum(b.numel for b in self.buckets)

    @property
    def buffer_dtypes(self) -> dict[str, torch.dtype]:
        """The module's buffers' dtypes as given."""
        return self.buffers.dtypes

    def grow(self, buckets: list[Bucket], step_buckets: list[Bucket], homes: Homes) -> None:
        """Buckets appended for parameters unfrozen since (NOTE [Freezing and unfreezing]): the one
        place the layout changes after it is built; their parameters leave ``frozen``."""
        self.homes.add(homes)
        if self.step_buckets is not self.buckets:  # one process: one list, the buckets themselves
            self.step_buckets.extend(step_buckets)
        self.buckets.extend(buckets)
        for b in buckets:
            for s in b.slots:
                self.slot_of[id(s.param)] = (b, s)
                self.frozen.pop(s.name)


H = TypeVar("H")  # a kind of home


def _by_tier(buckets: list[Bucket], tier_of) -> dict[Tier, list[Bucket]]:
    out: dict[Tier, list[Bucket]] = {}
    for b in buckets:
        out.setdefault(tier_of(b), []).append(b)
    return out


def _grad_homes(
    buckets: list[Bucket],
    stores: dict,
    engine: CopyService,
    compute: dict[int, Tier],
    overlap: bool,
    tier_of: Callable[[Bucket], Tier] = lambda b: b.grad_tier,
) -> dict[Tier, tuple[GradHome, list[Bucket]]]:
    out: dict[Tier, tuple[GradHome, list[Bucket]]] = {}
    for tier, bs in _by_tier(buckets, tier_of).items():
        home: GradHome = (
            NvmeGrads(bs, engine, stores[Tier.HOST])
            if tier == Tier.NVME
            else MemoryGrads(stores[tier], bs, compute, stores, engine, buffers=2 if overlap else 1)
        )
        out[tier] = (home, bs)
    return out


def accumulation_homes(buckets: list[Bucket], stores: dict, engine: CopyService) -> dict[int, GradHome]:
    """The GRAD homes ``buckets``' grads accumulate in over a step's micro-batches under
    update_in_backward, by bucket index: the default step's, at each bucket's
    :func:`~tiermem.plan.placement.accumulation_tier` (NOTE [Updates in backward]). Made when a step first
    accumulates; raises :class:`~tiermem.OutOfTierMemory` before taking anything when the budgets
    have no room for them (:func:`~tiermem.plan.footprint.accumulation_footprint`)."""
    check_fits(accumulation_footprint(buckets), stores, what="<grads accumulated over micro-batches>")
    compute = {b.index: compute_tier(b) for b in buckets}
    return _per_bucket(_grad_homes(buckets, stores, engine, compute, False, accumulation_tier))


def _state_homes(
    buckets: list[Bucket],
    stores: dict,
    engine: CopyService,
    compute: dict[int, Tier],
    masters: Optional[ParamOffload] = None,
) -> dict[Tier, tuple[StateHome, list[Bucket]]]:
    """``masters``: the weights' home that keeps the master of buckets whose weights are their
    master (NOTE [One copy of bf16 master weights]), in one process."""
    out: dict[Tier, tuple[StateHome, list[Bucket]]] = {}
    for tier, bs in _by_tier(buckets, lambda b: b.state_tier).items():
        home: StateHome = (
            NvmeState(bs, engine, stores[Tier.HOST], masters) if tier == Tier.NVME else MemoryState(stores[tier], bs)
        )
        assert all(home.compute_tier == compute[b.index] for b in bs), "homes and plan disagree on where Adam runs"
        out[tier] = (home, bs)
    return out


def _weight_homes(
    buckets: list[Bucket],
    stores: dict,
    engine: CopyService,
    dtype: torch.dtype,
    weights_off_device: Optional[ParamOffload],
    gathered: Optional[GatheredWeights],
) -> dict[int, WeightHome]:
    weights: dict[int, WeightHome] = {}
    sharded = set() if gathered is None else {b.index for b in gathered.full.values()}
    on_device = [b for b in buckets if b.param_tier == Tier.DEVICE and b.index not in sharded]
    if on_device:
        dw = DeviceWeights(stores[Tier.DEVICE], on_device, dtype, engine)
        weights.update({b.index: dw for b in on_device})
    for b in buckets:
        if b.index in sharded:
            assert gathered is not None
            weights[b.index] = gathered
        elif b.param_tier != Tier.DEVICE:
            assert weights_off_device is not None, "weights off the device without their home"
            weights[b.index] = weights_off_device
    return weights


def _per_bucket(homes: Mapping[Tier, tuple[H, list[Bucket]]]) -> dict[int, H]:
    return {b.index: home for home, bs in homes.values() for b in bs}


def _window_or_grad_homes(
    buckets: list[Bucket],
    stores: dict,
    engine: CopyService,
    compute: dict[int, Tier],
    overlap: bool,
    window: Optional[WindowGrads],
    *,
    sharded: bool,
) -> dict[Tier, tuple[GradHome, list[Bucket]]]:
    """The GRAD homes of ``buckets`` (``sharded``: this rank's chunks, NOTE [Data parallel]): the
    window under update_in_backward (NOTE [Updates in backward]), else one per tier."""
    if window is None:
        return _grad_homes(buckets, stores, engine, compute, overlap)
    window.add(buckets, sharded=sharded)
    return {Tier.HOST: (window, buckets)}


def _sharded_grads(
    buckets: list[Bucket],
    shards: list[Bucket],
    inner: GradHome,
    group: Group,
    device_store,
    engine: CopyService,
    window: Optional[WindowGrads],
) -> ShardedGrads:
    """A rank's GRAD home over ``inner``; under update_in_backward (``window``), told by the window
    where a chunk adds to grads already landed and when a pass must leave no_sync()'s sums be."""
    if window is None:
        return ShardedGrads(buckets, shards, inner, group, device_store, engine)
    return ShardedGrads(buckets, shards, inner, group, device_store, engine, holds=window.holds, keeps=window.keeps)


def make_homes(
    buckets: list[Bucket],
    stores: dict,
    engine: CopyService,
    dtype: torch.dtype,
    *,
    overlap: bool,
    weights_off_device: Optional[ParamOffload],
    group: Group = Solo(),
    gathered: Optional[GatheredWeights] = None,
    window: Optional[WindowGrads] = None,
) -> tuple[Homes, list[Bucket]]:
    """One home per class and tier, shared by the buckets placed there: the only code that maps
    a tier (or a rank's shard, NOTE [Data parallel]) to the class that homes it. Returns the
    homes and the buckets the step runs on (each rank's chunks, under data parallelism).
    ``gathered``: the home of the buckets whose weights are sharded over the ranks (NOTE
    [Weights sharded over the ranks]), already built (its chunks are on their tiers). ``window``:
    the GRAD home of every bucket under update_in_backward (NOTE [Updates in backward]); under
    data parallelism, of this rank's chunks, inside the ShardedGrads that reduce-scatter into it."""
    compute = {b.index: compute_tier(b) for b in buckets}
    weights = _weight_homes(buckets, stores, engine, dtype, weights_off_device, gathered)
    also = () if gathered is None else (gathered,)  # it may home frozen buckets alone
    assert window is None or not overlap, "update_in_backward is refused with overlap_step (options.py)"
    if group.world == 1:
        return Homes(
            _per_bucket(_window_or_grad_homes(buckets, stores, engine, compute, overlap, window, sharded=False)),
            _per_bucket(_state_homes(buckets, stores, engine, compute, weights_off_device)),
            weights,
            also,
        ), buckets
    uncut = sorted({b.state.kind for b in buckets if not b.state.divisible})  # NOTE [Chunks cut where the state allows]
    if uncut:
        what = (
            "a generic optimizer's state (its own step() takes whole parameters: NOTE [Generic optimizers])"
            if Kind.GENERIC in uncut
            else "factored state (row and column factors of each matrix, updated a whole parameter at a time)"
        )
        raise ConfigError(
            f"tiermem: under data parallelism this version shards elementwise and block-wise 8-bit optimizer "
            f"state only; {uncut} keeps {what}: a rank's chunk would cut parameters; pass process_group=False "
            f"(a full replica per process), or an elementwise optimizer (AdamW, SGD, Adagrad, Lion, AdamW8bit)"
        )
    shards = shard_buckets(buckets, group)
    full = {b.index: b for b in buckets}
    grads = {
        t: (_sharded_grads([full[b.index] for b in bs], bs, home, group, stores[Tier.DEVICE], engine, window), bs)
        for t, (home, bs) in _window_or_grad_homes(
            shards, stores, engine, compute, overlap, window, sharded=True
        ).items()
    }
    state = {
        t: (ShardedState([full[b.index] for b in bs], bs, home, group, stores[Tier.HOST]), bs)
        for t, (home, bs) in _state_homes(shards, stores, engine, compute).items()
    }
    whole = {id(h): h for h in weights.values() if h is not gathered}  # replicated: gathered after each step
    wgroup = group.for_weights() if whole else group
    wrapped = {i: ShardedWeights(buckets, h, wgroup, engine) for i, h in whole.items()}
    return Homes(
        _per_bucket(grads), _per_bucket(state), {i: wrapped.get(id(h), h) for i, h in weights.items()}, also
    ), shards


def build(
    module: torch.nn.Module,
    buckets: list[Bucket],
    step_buckets: list[Bucket],
    groups: tuple[ParamGroup, ...],
    names: Mapping[int, tuple[str, ...]],
    homes: Homes,
    stores: dict,
    dtype: torch.dtype,
    device: torch.device,
    weights_off_device: Optional[ParamOffload],
    *,
    gathered: Optional[GatheredWeights] = None,
    group: Group = Solo(),
    values: Optional[Values] = None,
    inference: bool = False,
) -> Layout:
    """Fill the homes from the module's weights and point its parameters at their working copies.
    ``gathered``: the home of the weights sharded over the ranks (``group``'s), frozen ones too
    (NOTE [Frozen weights sharded over the ranks]). ``values``: where each parameter's first value
    comes from, read as its bucket is built (NOTE [Models on the meta device]). ``inference``: the
    module's computed buffers keep their dtype (NOTE [Buffers keep their values])."""
    values = values if values is not None else Given()
    progress = Progress(values.building, 4 * sum(b.numel for b in buckets)) if values.building else None  # fp32 bytes
    agreed = values.agreed
    values.expect([(s.name, s.param, lo, hi) for b in buckets for s, lo, hi in initial_pieces(homes, b, agreed)])

    def fill(s: Slot, at: int, out: torch.Tensor) -> None:
        values.param_into(s.name, s.param, out, at)

    fill_homes(homes, buckets, fill, progress, agreed=agreed)
    slot_of = {id(s.param): (b, s) for b in buckets for s in b.slots}
    if progress is not None:
        progress.close()
    for home in homes.state_homes():
        home.release_views()
    if step_buckets is not buckets:  # under data parallelism, the whole buckets' masters only building used
        stores[Tier.HOST].trim()  # go back to the system, not to the pool's cache (the step takes chunks)
    frozen = _place_frozen(module, stores, dtype, device, weights_off_device, gathered, group, values)
    values.fill_buffers(module)
    return Layout(
        buckets,
        step_buckets,
        homes,
        groups,
        names,
        slot_of,
        frozen,
        KeptBuffers(module, dtype, device, inference=inference),
    )


def initial_pieces(homes: Homes, b: Bucket, agreed: bool) -> list[tuple[Slot, int, int]]:
    """The pieces of ``b``'s initial master that building fills: each slot with the elements
    ``[lo, hi)`` of its parameter. All of the bucket; when every rank fills the same values
    (``agreed``, a checkpoint's), only the span its homes keep (a rank's chunk when its weights are
    sharded over the ranks too: NOTE [Models on the meta device])."""
    lo, hi = 0, b.numel
    if agreed:
        spans = (homes.state[b.index].initial_span(b), homes.weights[b.index].initial_span(b))
        lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
    return b.slots_within(lo, hi)


def fill_homes(
    homes: Homes,
    buckets: list[Bucket],
    fill: Callable[[Slot, int, torch.Tensor], object],
    progress: Optional[Progress] = None,
    *,
    agreed: bool = False,
) -> None:
    """Each bucket's master filled slot by slot (``fill(slot, first element, its flat view)``: the
    pieces :func:`initial_pieces` gives), made rank 0's on every rank unless ``agreed`` (every rank
    filled the same values), then its state and weights initialized from it; the writes they leave
    in flight (NOTE [Initial writes in flight]) have landed on return, and a failure drains them
    before it propagates."""
    try:
        for b in buckets:
            state = homes.state[b.index]
            master = state.initial_master(b)
            for s, lo, hi in initial_pieces(homes, b, agreed):
                fill(s, lo, master[s.offset + lo : s.offset + hi])
            if not agreed:
                state.agree(b)
            state.initialize(b)
            homes.weights[b.index].initialize(b, master)
            if progress is not None:
                progress.advance(4 * b.numel)
    except BaseException:
        with contextlib.suppress(BaseException):
            homes.built()  # drained before the caller removes the homes
        raise
    homes.built()


def _place_frozen(
    module: torch.nn.Module,
    stores: dict,
    dtype: torch.dtype,
    device: torch.device,
    weights_off_device: Optional[ParamOffload],
    gathered: Optional[GatheredWeights],
    group: Group,
    values: Values,
) -> FrozenParams:
    """Frozen parameters: the working copy on the device or at its home off the device (under
    data parallelism, maybe sharded: NOTE [Frozen weights sharded over the ranks]), and a copy in
    their own dtype where that differs, on the host or on NVMe (NOTE [Frozen weights keep one copy])."""
    frozen = FrozenParams(module, weights_off_device, gathered)
    for name, p in module.named_parameters():
        if not p.requires_grad:
            frozen.place(name, p, stores, dtype, device, functools.partial(values.param, name, p))
    if gathered is not None:
        frozen.shard([b for b in gathered.full.values() if b.frozen], group, dtype, values)
    frozen.log_copies()
    return frozen
