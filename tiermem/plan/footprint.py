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
  memory taken: NOTE [Grads come and go] in tiermem/train/homes/grad_homes.py); under ``update_in_backward``
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
  on the host, and they are gathered like the trainable ones below (a copy in their own dtype is
  sharded too: a rank keeps its chunk's elements of it, a buffer each, on the copy's tier);
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

from typing import Mapping, Optional, Protocol, Sequence

import torch

from tiermem.errors import ConfigError, OutOfTierMemory, fmt_bytes
from tiermem.plan import footprint_parts as part
from tiermem.plan.buckets import Bucket
from tiermem.plan.footprint_parts import (
    FP32,
    FROZEN_COPY,
    FROZEN_WEIGHTS,
    GATHER_AHEAD,
    GATHER_ROUNDED,
    GATHER_STAGING,
    GATHERED,
    GRADS,
    GRADS_FOR_STEP,
    GRADS_IN_BACKWARD,
    GRADS_IN_FLIGHT,
    GRADS_TO_NVME,
    GRADS_TO_REDUCE,
    HOST_PAGE,
    JOURNAL_BUCKETS,
    LARGEST_MODULE,
    NVME_JOURNAL,
    NVME_STAGING,
    NVME_THREADS,
    OPTIM_STATE,
    OPTIM_STATE_NVME,
    PAGE_ROUNDING,
    SECOND_GRADS,
    STATE_PIPELINE,
    TRAINING_STATE,
    UPDATED_WEIGHTS,
    WEIGHT_STAGING,
    WHOLE_BUCKET,
    WINDOW_BUCKETS,
    WORKING_WEIGHTS,
    Footprint,
    Layout,
    add,
    copy_tier,
    gather_ahead,
    host_buffer_bytes,
    keeps_copy,
)
from tiermem.plan.placement import accumulation_tier, frozen_buckets, split_weights
from tiermem.types import Tier

__all__ = [
    "FROZEN_COPY",
    "FROZEN_WEIGHTS",
    "GATHER_AHEAD",
    "GATHER_ROUNDED",
    "GATHER_STAGING",
    "GATHERED",
    "GRADS",
    "GRADS_FOR_STEP",
    "GRADS_IN_BACKWARD",
    "GRADS_IN_FLIGHT",
    "GRADS_TO_NVME",
    "GRADS_TO_REDUCE",
    "HOST_PAGE",
    "JOURNAL_BUCKETS",
    "LARGEST_MODULE",
    "NVME_JOURNAL",
    "NVME_STAGING",
    "NVME_THREADS",
    "OPTIM_STATE",
    "OPTIM_STATE_NVME",
    "PAGE_ROUNDING",
    "SECOND_GRADS",
    "STATE_PIPELINE",
    "TRAINING_STATE",
    "UPDATED_WEIGHTS",
    "WEIGHT_STAGING",
    "WHOLE_BUCKET",
    "WINDOW_BUCKETS",
    "WORKING_WEIGHTS",
    "Budgeted",
    "Footprint",
    "accumulation_footprint",
    "check_fits",
    "copy_tier",
    "footprint",
    "gather_ahead",
    "gathers_held",
    "host_buffer_bytes",
    "keeps_copy",
    "largest_module_bytes",
    "model_footprint",
    "totals",
]


def accumulation_footprint(buckets: Sequence[Bucket]) -> Footprint:
    """What gradient accumulation over micro-batches adds under update_in_backward, in one process: the
    whole GRAD home of the default step (4 B/param, at :func:`~tiermem.plan.placement.accumulation_tier`),
    made (and checked against the budgets with this) when a step first accumulates (NOTE [Updates in
    backward] in tiermem/train/step/in_backward.py); the construction's footprint counts a window instead."""
    need: Footprint = {}
    for b in buckets:
        part.grads(need, b, b.numel, accumulation_tier(b))
    largest = max((b.numel for b in buckets if accumulation_tier(b) == Tier.NVME), default=0)
    part.grads_to_nvme(need, largest)
    if largest:
        add(need, Tier.NVME, NVME_JOURNAL, JOURNAL_BUCKETS["grads"] * FP32 * largest)
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
    lay = Layout.of(buckets, dtype, world, shard=shard_weights, overlap=overlap, on_host=device_is_host)
    for b in buckets:
        part.bucket(need, lay, b, update_in_backward)
    part.nvme_buffers(need, lay, buckets, sharded_frozen, update_in_backward)
    if world > 1:
        part.data_parallel(need, lay, buckets)
    if not overlap:
        part.weight_staging(need, lay, buckets)
    part.sharded_frozen_weights(need, lay, sharded_frozen)
    part.gathers(need, lay, buckets, sharded_frozen, gathered_at_once)
    on_nvme = [
        s.numel * lay.w for b in buckets if b.param_tier == Tier.NVME and b.index not in lay.sharded for s in b.slots
    ]
    on_nvme += part.frozen_weights(need, lay, frozen)
    if nvme_staging:
        part.nvme_staging(need, on_nvme)
    add(need, Tier.DEVICE, GRADS_IN_FLIGHT, max((s.numel for b in buckets for s in b.slots), default=0) * lay.w)
    if largest_module:
        add(need, Tier.DEVICE, LARGEST_MODULE, largest_module)
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
