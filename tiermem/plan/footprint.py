"""The bytes a training layout needs on each tier, and what for: the one rule for them.

``TieredModel`` checks this footprint against its budgets before allocating anything, and
``tiermem plan`` prints the training-state part of it for a parameter count (through
:func:`tiermem.plan.sizing.tier_bytes`), so the two cannot drift apart. Pure arithmetic on a
bucket plan (:mod:`tiermem.plan.buckets`): nothing is allocated, frozen parameters may be meta tensors.

NOTE [Footprint]
For a bucket of ``n`` trainable parameters, ``w`` bytes per element of the working precision,
and the compute tier where Adam runs for it (its state's tier; the host for state on NVMe):

- working weights: ``w*n`` at the PARAM tier;
- fp32 grads: ``4n`` at the GRAD tier (between steps, room the budget holds for them with no
  memory taken: NOTE [Grads come and go] in tiermem/train/homes/per_class.py); under ``update_in_backward``
  none, a window of a few buckets on the host instead, until a step first accumulates over
  micro-batches: that brings back the whole GRAD home, ``4n`` (with the grads for the step and the
  NVMe flushes' buffers and journal, as without the mode), checked against the budgets then
  (:func:`accumulation_footprint`; NOTE [Updates in backward] in tiermem/train/step/in_backward.py);
- optimizer state: the bytes of its state format at the OPTIM_STATE tier (NOTE [State formats]:
  ``12n`` for Adam's fp32 master, exp_avg and exp_avg_sq; ``4n`` for SGD without momentum; about
  ``4n`` for 8-bit Adam with bf16 master weights), one buffer per part; a bf16 master that is its
  weights (NOTE [One copy of bf16 master weights] in tiermem/train/weights/param_offload.py) is counted
  once: on the host with the state (the weights, views of it, take nothing more), on NVMe with
  the weights' keys (the state key holds the other parts);
- grads for the step: ``4n`` at the compute tier, when the grads live on another tier in memory;
- with ``overlap_step``: a second ``4n`` grad buffer at the GRAD tier, and Adam's output, ``w*n``,
  at the compute tier.

Anything on NVMe takes its bytes there once: TieredModel's store keeps one value per key and rolls
a failed step forward (NOTE [A failed step is rolled forward], tiermem/train/homes/nvme_state.py). For the
model as a whole:

- the NVMe journal: a write goes beside its key's value until it lands (the switch is atomic), so
  NVMe also needs room for the writes that can be in flight at once: three buckets of state (the
  pipeline's buffer sets), two buckets of weights (the staging buffers) and four buckets of grads
  (about three flushes and one read-modify-write), each of the largest such bucket; the store's
  spare files (NOTE [One value per key, and a few spare files]) give their room back when asked;

- weight staging: at each compute tier off the device, up to two buffers the size of its largest
  bucket in the working precision, which Adam writes the new weights into (not with
  ``overlap_step``, whose output buffers above take their place; none for weights on a CPU device,
  which the host's Adam writes in place: NOTE [A CPU device]);
- the NVMe pipelines, on the host: three of the largest bucket with grads on NVMe (4 B each),
  three of the largest bucket with state on NVMe (all its parts, as one buffer: 12 B each for Adam);
- NVMe staging, on a GPU only: weights moving between NVMe and the device pass through a host
  buffer of their own size (in the working precision; a frozen one in its own element size when
  not floating point), held for the length of the move on one of the engine's NVMe lane threads,
  so at most ``NVME_THREADS`` (4) are live at once: the host needs the largest four weights that
  live on NVMe (``nvme_staging``; on the CPU the store reads into the device buffer itself);
- frozen parameters: ``w`` bytes each at their PARAM home (their own element size when not
  floating point), and a copy in their own dtype when that is not the working precision, on
  NVMe when their PARAM home is NVMe, else on the host (NOTE [Frozen weights keep one copy] in
  tiermem/train/weights/frozen.py); under data
  parallelism those sharded over the ranks (NOTE [Frozen weights sharded over the ranks]) are
  buckets of their own (``sharded_frozen``): a rank keeps ``w*ceil(n/world)`` of each, one buffer
  on the host, and they are gathered like the trainable ones below (the host copy stays whole);
- grads in flight on the device: autograd makes each grad there, in the working precision, and it
  leaves for its home once complete; when the device budget is tight the next one waits until
  those in flight have landed, so the device needs room for at least the largest parameter's grad;
- the largest module's weights, while it runs, when weights live off the device (and are not
  sharded: see below);
- weights sharded over the ranks (NOTE [Weights sharded over the ranks] in
  tiermem/train/weights/gathered.py): each rank keeps ``w*ceil(n/world)`` of such a bucket at its PARAM
  tier (on the host, one buffer per bucket), and the device holds the buckets gathered whole while
  they are read: at most ``gathered_at_once`` of the largest (held by running modules and one op, a
  bound :func:`gathers_held` computes from the module tree) plus :func:`gather_ahead` bytes
  gathered ahead of use or kept after it; a gather of a chunk on NVMe reads it into a host buffer
  first, held until the gather is done (as many as gathered buckets can be in flight); a chunk
  whose master shares its memory (its tier; or the device that is the CPU, beside a master on the
  host) is not kept but rounded from the master into such a buffer for each gather
  (:func:`~tiermem.plan.placement.weights_from_master`), and the update writes no new weights for it;
- page rounding: the host pool hands out every buffer in whole pages (``round_up(max(n, 1))``
  bytes of 4 KiB pages, :func:`tiermem.memory.aligned.round_up`), and its budget counts what it
  hands out, so each buffer the layout takes on the host adds less than a page (an empty one, a
  whole page). The
  footprint counts each such buffer: per bucket its fp32 grads (two with ``overlap_step``), the
  grads for the step, the three parts of its state and Adam's output; per parameter whose weights
  live on the host its working weights (one buffer each: a model of many small parameters, such as
  LayerNorm biases, pays a page for each); per frozen parameter its host copy (and its working
  weights when they live on the host); and the staging, pipeline and whole-bucket buffers above
  (the NVMe staging buffers each rounded, as they are leased one by one).
  The device's store allocates exact sizes and the NVMe budget counts the bytes of each value
  (NOTE [What the NVMe budget counts] in tiermem/memory/nvme_keys.py), so neither rounds.

Working weights, fp32 grads, optimizer state and frozen weights (:data:`TRAINING_STATE`) are the
parts of NOTE [Bytes per parameter] (tiermem/plan/sizing.py): they grow with the parameter count
alone, and they are what ``tiermem plan`` counts. The rest are TieredModel's own buffers: the
working buffers sized by the bucket plan (``bucket_size``), the largest parameter or module and
``overlap_step``, which a parameter count does not determine, the host's copy of frozen weights,
and the page rounding (a few pages for a parameter count, however large).

Auto judges its candidates with this footprint as it is (tiermem/plan/choose.py): a layout it
accepts is one the constructor accepts, with no allowance of its own on any tier.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol, Sequence

import torch

from tiermem.errors import ConfigError, OutOfTierMemory, fmt_bytes
from tiermem.plan.buckets import Bucket
from tiermem.plan.placement import (
    accumulation_tier,
    compute_tier,
    frozen_buckets,
    master_is_weights,
    split_weights,
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

_FP32 = torch.float32.itemsize  # grads at their home

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

#: Buckets' bytes gathered ahead of use, or kept after it, besides the held ones: this many of
#: the largest sharded bucket (NOTE [A gather schedule every rank takes alike]).
GATHER_AHEAD = 2

#: The host pool's page (tiermem.memory.aligned.ALIGN; the plan layer does not import the memory layer).
HOST_PAGE = 4096


def host_buffer_bytes(nbytes: int) -> int:
    """What the host pool takes for a buffer of ``nbytes``: whole pages, and at least one
    (``round_up(max(nbytes, 1))`` of tiermem/memory/aligned.py; a test holds the two equal)."""
    return -(-max(nbytes, 1) // HOST_PAGE) * HOST_PAGE


#: The purposes that are the training state itself (see NOTE [Footprint]).
TRAINING_STATE = frozenset({WORKING_WEIGHTS, GRADS, OPTIM_STATE, OPTIM_STATE_NVME, FROZEN_WEIGHTS})


def keeps_copy(dtype: torch.dtype, working: torch.dtype, floating: bool) -> bool:
    """Whether a frozen parameter of ``dtype`` keeps a host copy beside its working copy in
    ``working`` (NOTE [Frozen weights keep one copy] in tiermem/train/weights/frozen.py)."""
    return floating and dtype != working


def copy_tier(home: Tier) -> Tier:
    """Where a frozen parameter whose working copy is homed on ``home`` keeps the copy
    :func:`keeps_copy` asks for: on NVMe beside a working copy there, else on the host (NOTE
    [Frozen weights keep one copy] in tiermem/train/weights/frozen.py)."""
    return Tier.NVME if home == Tier.NVME else Tier.HOST


#: Buckets whose grads the host holds at once under update_in_backward, at most: one landing, one
#: being updated, and parameters of the next arriving before the last of this one
#: (NOTE [Updates in backward] in tiermem/train/step/in_backward.py)
WINDOW_BUCKETS = 4

#: Buckets whose writes can be in flight on NVMe at once, by what they write (NOTE [Footprint]).
JOURNAL_BUCKETS = {"state": 3, "weights": 2, "grads": 4}


class _Adder:
    """Adds bytes to a footprint: ``add(tier, purpose, nbytes, buffers=...)``."""

    def __init__(self, need: Footprint):
        self.need = need

    def __call__(self, tier: Tier, purpose: str, nbytes: int, *, buffers: Sequence[int] = ()) -> None:
        """``nbytes`` for ``purpose`` on ``tier``; ``buffers``: the sizes of the buffers they
        are allocated as, when on the host (NOTE [Footprint]: page rounding)."""
        parts = self.need.setdefault(tier, {})
        parts[purpose] = parts.get(purpose, 0) + nbytes
        if tier == Tier.HOST and buffers:
            assert sum(buffers) == nbytes, (purpose, nbytes, buffers)
            parts[PAGE_ROUNDING] = parts.get(PAGE_ROUNDING, 0) + sum(host_buffer_bytes(n) - n for n in buffers)


def _each(nbytes: int, count: int = 1) -> dict[str, Any]:
    """``count`` buffers of ``nbytes`` each, as :class:`_Adder` takes them."""
    return {"nbytes": count * nbytes, "buffers": [nbytes] * count}


def _grads(add: _Adder, b: Bucket, n: int, tier: Tier) -> None:
    """The default step's GRAD home of bucket ``b`` (``n``: this rank's elements of it) on ``tier``: its
    fp32 grads, and the grads for the step where Adam runs on another tier in memory."""
    add(tier, GRADS, **_each(n * _FP32))
    if compute_tier(b) != tier and tier != Tier.NVME:
        add(compute_tier(b), GRADS_FOR_STEP, **_each(n * _FP32))


def _grads_to_nvme(add: _Adder, largest: int) -> None:
    """The host buffers of the flushes of grads to NVMe (``largest``: the largest such bucket's
    elements, 0 for none)."""
    if largest:
        add(Tier.HOST, GRADS_TO_NVME, **_each(_FP32 * largest, 3))


def accumulation_footprint(buckets: Sequence[Bucket]) -> Footprint:
    """What gradient accumulation over micro-batches adds under update_in_backward, in one process: the
    whole GRAD home of the default step (4 B/param, at :func:`~tiermem.plan.placement.accumulation_tier`),
    made (and checked against the budgets with this) when a step first accumulates (NOTE [Updates in
    backward] in tiermem/train/step/in_backward.py); the construction's footprint counts a window instead."""
    need: Footprint = {}
    add = _Adder(need)
    for b in buckets:
        _grads(add, b, b.numel, accumulation_tier(b))
    largest = max((b.numel for b in buckets if accumulation_tier(b) == Tier.NVME), default=0)
    _grads_to_nvme(add, largest)
    if largest:
        add(Tier.NVME, NVME_JOURNAL, JOURNAL_BUCKETS["grads"] * _FP32 * largest)
    return need


def footprint(
    buckets: Sequence[Bucket],
    frozen: Sequence[tuple[torch.Tensor, Tier]],
    dtype: torch.dtype,
    *,
    overlap: bool = False,
    largest_module: int = 0,
    world: int = 1,
    nvme_staging: bool = False,
    shard_weights: bool = False,
    gathered_at_once: int = 0,
    device_is_host: bool = False,
    sharded_frozen: Sequence[Bucket] = (),
    update_in_backward: bool = False,
) -> Footprint:
    """Bytes each tier must hold, by purpose, for the layout of ``buckets`` to be built and a step
    to run (NOTE [Footprint]). ``frozen``: each parameter that needs no grad, with its PARAM home;
    ``dtype``: the working precision; ``largest_module``: bytes of the off-device weights one module
    makes resident while it runs (:func:`largest_module_bytes`), 0 when all weights are on the device;
    ``world``: ranks sharing the grads and optimizer state (NOTE [Data parallel]): each holds a chunk
    of every bucket, the weights whole unless sharded (:func:`~tiermem.plan.placement.weights_sharded`
    with ``shard_weights``; ``gathered_at_once``: :func:`gathers_held` of the module);
    ``nvme_staging``: whether weights moving between NVMe and the device stage through the host (on
    a GPU: ``device.type == "cuda"``); ``device_is_host``: whether the device is the CPU (its memory
    the host's: :func:`~tiermem.plan.placement.weights_from_master`); ``sharded_frozen``: the
    frozen parameters sharded over the ranks (:func:`~tiermem.plan.placement.frozen_buckets`),
    which ``frozen`` does not list; ``update_in_backward``: no grads at rest, a few buckets' in
    flight on the host instead (NOTE [Updates in backward] in tiermem/train/step/in_backward.py)."""
    need: Footprint = {}
    add, each = _Adder(need), _each

    def chunk(b: Bucket) -> int:
        return b.chunk_size(world)  # NOTE [Chunks cut where the state allows]

    def state_parts(b: Bucket) -> list[int]:
        """Bytes of each part of this rank's state of ``b`` (under DP its chunk's, the most any rank keeps)."""
        return [n * p.itemsize for p, n in zip(b.state.parts, part_numels(b))]

    def part_numels(b: Bucket) -> list[int]:
        """Elements of each part of this rank's state of ``b``: its chunk's under DP."""
        return b.chunk_part_numels(world) if world > 1 else b.part_numels()

    def state_joined(b: Bucket) -> int:
        """Bytes of this rank's state of ``b`` as one buffer (one NVMe value)."""
        return b.state.joined(part_numels(b))[1]

    w = dtype.itemsize
    sharded = {b.index for b in buckets if weights_sharded(b, world, shard_weights)}
    rounded = [b for b in buckets if weights_from_master(b, b.index in sharded, overlap, device_is_host=device_is_host)]
    from_master = {b.index for b in rounded}
    kept = sharded - from_master  # rounded: no chunk kept (NOTE [A chunk rounded from its master])
    # NOTE [One copy of bf16 master weights]: the master and the weights, one copy (the host's counted
    # as the master, NVMe's as the weights' keys, the state key holding the other parts)
    one_copy = {b.index for b in buckets if master_is_weights(b, b.index in sharded, overlap)}
    for b in buckets:
        ct, n = compute_tier(b), chunk(b)
        if b.index in kept:  # this rank's chunk, one buffer
            add(b.param_tier, WORKING_WEIGHTS, n * w, buffers=[n * w] if b.param_tier == Tier.HOST else ())
        elif b.index in one_copy and b.param_tier == Tier.HOST:
            pass  # views of the master, counted with the optimizer state
        elif b.index not in sharded:
            add(
                b.param_tier,
                WORKING_WEIGHTS,
                b.numel * w,
                buffers=[s.numel * w for s in b.slots] if b.param_tier != Tier.DEVICE else (),
            )  # off the device: one buffer per parameter
        if not update_in_backward:  # its grads' home is made when a step first accumulates (accumulation_footprint)
            _grads(add, b, n, b.grad_tier)
        if b.state_tier == Tier.NVME:
            master = b.state.joined(part_numels(b))[0][1] if b.index in one_copy else 0  # in the weights' keys
            add(Tier.NVME, OPTIM_STATE_NVME, state_joined(b) - master)
        else:
            parts = state_parts(b)
            add(b.state_tier, OPTIM_STATE, sum(parts), buffers=parts)
        if overlap:
            add(b.grad_tier, SECOND_GRADS, **each(n * _FP32))
            add(ct, UPDATED_WEIGHTS, **each(n * w))
    grads_largest = max((chunk(b) for b in buckets if b.grad_tier == Tier.NVME and not update_in_backward), default=0)
    if update_in_backward:
        add(Tier.HOST, GRADS_IN_BACKWARD, **each(_FP32 * max(b.numel for b in buckets), WINDOW_BUCKETS))
    _grads_to_nvme(add, grads_largest)
    state_largest = max((state_joined(b) for b in buckets if b.state_tier == Tier.NVME), default=0)
    if state_largest:
        add(Tier.HOST, STATE_PIPELINE, **each(state_largest, 3))  # each set: a bucket's parts, back to back
    weights_largest = max(
        (
            chunk(b) if b.index in sharded or b.frozen else b.numel
            for b in [*buckets, *sharded_frozen]
            if b.param_tier == Tier.NVME
        ),
        default=0,
    )
    journal = (
        JOURNAL_BUCKETS["state"] * state_largest
        + JOURNAL_BUCKETS["weights"] * w * weights_largest
        + JOURNAL_BUCKETS["grads"] * _FP32 * grads_largest
    )
    if journal:
        add(Tier.NVME, NVME_JOURNAL, journal)
    if world > 1:
        padded = max((chunk(b) * world for b in buckets), default=0)
        add(Tier.DEVICE, GRADS_TO_REDUCE, 4 * _FP32 * padded)  # a few buckets in flight, and one accumulating
        whole = {(p.name, p.dtype): p.itemsize * padded for b in buckets for p in b.state.parts}
        add(Tier.HOST, WHOLE_BUCKET, sum(whole.values()), buffers=list(whole.values()))  # while a checkpoint reads it
    if not overlap:
        staged: dict[Tier, list[int]] = {}
        for b in buckets:
            if (
                compute_tier(b) != Tier.DEVICE
                and not writes_weights_in_place(b, b.index in sharded, device_is_host=device_is_host)
                and b.index not in from_master
                and b.index not in one_copy
            ):
                staged.setdefault(compute_tier(b), []).append(chunk(b))
        for tier, numels in staged.items():
            add(tier, WEIGHT_STAGING, **each(max(numels) * w, min(2, len(numels))))  # a single bucket needs one
    for b in sharded_frozen:  # NOTE [Frozen weights sharded over the ranks]: this rank's chunk, one buffer
        n = chunk(b) * w
        add(b.param_tier, FROZEN_WEIGHTS, n, buffers=[n] if b.param_tier == Tier.HOST else ())
        for s in b.slots:
            if keeps_copy(s.param.dtype, dtype, True):  # NOTE [Frozen weights keep one copy]: whole, on each rank
                add(Tier.HOST, FROZEN_COPY, **each(s.numel * s.param.element_size()))
    gathers = [b for b in [*buckets, *sharded_frozen] if b.index in sharded or b.frozen]
    if gathers:
        gathered = [chunk(b) * world * w for b in gathers]
        add(Tier.DEVICE, GATHERED, min(sum(gathered), gathered_at_once * max(gathered) + gather_ahead(gathered)))
        on_disk = [chunk(b) * w for b in gathers if b.param_tier == Tier.NVME]
        if on_disk:
            add(Tier.HOST, GATHER_STAGING, **each(max(on_disk), min(len(on_disk), gathered_at_once + GATHER_AHEAD)))
        for tier in dict.fromkeys(b.param_tier for b in rounded):
            largest = max(chunk(b) * w for b in rounded if b.param_tier == tier)
            count = min(sum(b.param_tier == tier for b in rounded), gathered_at_once + GATHER_AHEAD)
            add(tier, GATHER_ROUNDED, count * largest, buffers=[largest] * count if tier == Tier.HOST else ())
    on_nvme = [s.numel * w for b in buckets if b.param_tier == Tier.NVME and b.index not in sharded for s in b.slots]
    for p, home in frozen:
        size = p.numel() * (w if p.is_floating_point() else p.element_size())
        add(home, FROZEN_WEIGHTS, **(each(size) if home != Tier.DEVICE else {"nbytes": size}))
        if keeps_copy(p.dtype, dtype, p.is_floating_point()):  # NOTE [Frozen weights keep one copy]
            copy = p.numel() * p.element_size()
            on = copy_tier(home)
            add(on, FROZEN_COPY, **(each(copy) if on == Tier.HOST else {"nbytes": copy}))
        on_nvme += [size] if home == Tier.NVME else []
    if nvme_staging and on_nvme:
        lane_buffers = sorted(on_nvme, reverse=True)[:NVME_THREADS]  # one per NVMe lane thread, the largest
        add(Tier.HOST, NVME_STAGING, sum(lane_buffers), buffers=lane_buffers)
    add(Tier.DEVICE, GRADS_IN_FLIGHT, max((s.numel for b in buckets for s in b.slots), default=0) * w)
    if largest_module:
        add(Tier.DEVICE, LARGEST_MODULE, largest_module)
    return need


def model_footprint(
    module: torch.nn.Module,
    buckets: Sequence[Bucket],
    param_homes: Mapping[str, Tier],
    dtype: torch.dtype,
    *,
    overlap: bool = False,
    world: int = 1,
    shard_weights: bool = False,
    nvme_staging: bool = False,
    device_is_host: bool = False,
    bucket_numel: Optional[int] = None,
    update_in_backward: bool = False,
) -> Footprint:
    """:func:`footprint` of ``module`` planned as ``buckets`` (``param_homes``: the parameters whose
    weights live off the device, as :func:`tiermem.plan.placement.plan` returns them), with what
    the module's shape decides (its frozen parameters, its largest module, how many sharded buckets
    its modules hold at once): what TieredModel checks its budgets with, and Auto judges by.
    ``bucket_numel``: the model's bucket size, which packs its sharded frozen parameters
    (:func:`~tiermem.plan.placement.frozen_buckets`; None: a bucket per parameter)."""
    cold = frozen_buckets(module, param_homes, world, shard_weights, bucket_numel, first_index=len(buckets))
    sharded, offloaded = split_weights(buckets, param_homes, world, shard_weights, cold)
    in_cold = {s.name for b in cold for s in b.slots}
    frozen = [
        (p, param_homes.get(n, Tier.DEVICE))
        for n, p in module.named_parameters()
        if not p.requires_grad and n not in in_cold
    ]
    gathers = {b.index for b in [*sharded, *cold]}
    return footprint(
        buckets,
        frozen,
        dtype,
        overlap=overlap,
        world=world,
        nvme_staging=nvme_staging,
        device_is_host=device_is_host,
        largest_module=largest_module_bytes(module, offloaded, dtype),
        shard_weights=shard_weights,
        gathered_at_once=gathers_held(module, [*buckets, *cold], gathers) if gathers else 0,
        sharded_frozen=cold,
        update_in_backward=update_in_backward,
    )


def gather_ahead(padded: Sequence[int]) -> int:
    """The bytes of sharded buckets gathered ahead of use or kept after it, besides the held ones
    (``padded``: each sharded bucket's bytes gathered): the same on every rank."""
    return GATHER_AHEAD * max(padded, default=0)


def gathers_held(module: torch.nn.Module, buckets: Sequence[Bucket], sharded: set[int]) -> int:
    """How many sharded buckets (``sharded``: their indices) can be held gathered at once: those
    of the parameters of every module along a chain of modules running inside one another (each
    holds its own parameters' buckets while it runs), plus those one op may read besides (as many
    as one module's)."""
    bucket_of = {id(s.param): b.index for b in buckets if b.index in sharded for s in b.slots}

    def own(m: torch.nn.Module) -> frozenset[int]:
        return frozenset(bucket_of[id(p)] for p in m.parameters(recurse=False) if id(p) in bucket_of)

    def chain(m: torch.nn.Module, above: frozenset[int]) -> int:
        mine = above | own(m)
        return max([len(mine), *(chain(c, mine) for c in m.children())])

    return chain(module, frozenset()) + max((len(own(m)) for m in module.modules()), default=0)


def totals(need: Footprint, purposes: frozenset[str] | None = None) -> dict[Tier, int]:
    """Bytes on every tier (0 where nothing is placed): of every purpose, or of ``purposes`` only."""
    return {
        tier: sum(n for what, n in need.get(tier, {}).items() if purposes is None or what in purposes) for tier in Tier
    }


def largest_module_bytes(module: torch.nn.Module, param_homes: Mapping[str, Tier], dtype: torch.dtype) -> int:
    """The off-device weights one module makes resident while it runs (the device's minimum).
    ``param_homes``: the parameters whose working weights live off the device, by name."""
    best = 0
    for mod_name, mod in module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        best = max(
            best,
            sum(
                p.numel() * dtype.itemsize for n, p in mod.named_parameters(recurse=False) if prefix + n in param_homes
            ),
        )
    return best


class Budgeted(Protocol):
    """What :func:`check_fits` reads of a store: the bytes it holds and the bytes it may hold."""

    @property
    def used(self) -> int: ...

    @property
    def allowed(self) -> int: ...


def check_fits(need: Footprint, stores: Mapping[Tier, Budgeted], *, what: str = "<model working set>") -> None:
    """Raise unless every tier's store has room for its part of ``need``: :class:`ConfigError` for
    a tier with no store, :class:`OutOfTierMemory` naming what the bytes are for otherwise
    (``what``: the key the error shows)."""
    for tier, parts in need.items():
        total = sum(parts.values())
        if tier not in stores:
            raise ConfigError(
                f"tiermem: the policy places tensors on {tier} but no {tier} store is "
                f"configured; pass nvme_dir=... to TieredModel"
            )
        store = stores[tier]
        if store.used + total > store.allowed:
            detail = " + ".join(f"{what} {fmt_bytes(n)}" for what, n in parts.items() if n)
            raise OutOfTierMemory(
                tier=tier,
                key=what,
                asked=total,
                used=store.used,
                allowed=store.allowed,
                hint=f"it needs {fmt_bytes(total)} there ({detail}); raise Budgets({tier.value}=...) to "
                f"at least {fmt_bytes(store.used + total)} or choose a policy that places less on {tier}",
            )
