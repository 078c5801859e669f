"""How many bytes a model's training state needs, per tensor class and per tier.

Pure arithmetic, no I/O: ``tiermem plan`` prints it, and policies or ``TieredModel`` may use it to
check a placement before allocating anything.

NOTE [Bytes per parameter]
The five parts of the training state, per trainable parameter, with Adam:

==========  ==================  =====
part        mixed (bf16/fp16)   fp32
==========  ==================  =====
params      2                   4
grads       2                   4
master      4                   4
momentum    4                   4
variance    4                   4
==========  ==================  =====

So 7.5e9 parameters in mixed precision are 15 + 15 + 30 + 30 + 30 = 120 GB (decimal GB), the
worked example of DESIGN.md. ``master`` is the fp32 copy that Adam updates; in fp32 it is still
counted as its own tensor, because it lives with the optimizer state, which a policy may place on a
different tier from the working params. Frozen parameters (``requires_grad=False``) only have params.

Where the grads live changes their size. Autograd produces them in the params' dtype, which is
what the table counts (2 B/param in flight). TieredModel accumulates them at their home in fp32
(4 B/param), on the device too, so the per-tier figures count grads at 4 B/param wherever they live:
ZeRO-Offload needs 4 + 12 = 16 B/param on the host for 7.5e9 params (120 GB), KeepOnDevice
2 + 4 + 12 = 18 B/param on the device (135 GB). Whatever lives on NVMe takes its bytes there once
(ZeroInfinity: 2 + 12 = 14 B/param): TieredModel's store keeps one value per key, and a failed step
is completed by retrying it rather than undone (NOTE [A failed step is rolled forward] in
tiermem/train/homes/nvme_state.py); the few writes in flight beside their key's value (the journal) are
working buffers, bounded by the bucket size, not counted here.

The per-tier figures are the training-state part of the footprint that TieredModel checks its
budgets with (tiermem/plan/footprint.py, NOTE [Footprint]), computed by the same function for a
bucket plan of one bucket. They leave out activations (they depend on batch and sequence length);
TieredModel's working buffers, which a parameter count does not determine: the grad of the largest
parameter in flight on the device, the weight staging buffers (up to two buckets at each tier off
the device where Adam runs), the NVMe pipelines' host buffers (three buckets each), the NVMe
journal (a few buckets), the overlap_step buffers, and the largest module's weights while it runs
when weights live off the device; the copy of frozen weights whose dtype is not the working
one, on the host or on NVMe beside a working copy homed there (NOTE [Frozen weights keep one
copy]), which the constructor counts but which is no part of the table above; and the host pool's
rounding of each buffer to whole pages (a few pages for one bucket). ``tiermem plan --policy auto`` prints the
whole footprint of its choice, those included: the bytes the constructor checks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cache
from typing import Any, Mapping, Optional

import torch

from tiermem.config.kinds import Kind
from tiermem.config.rules import is_int
from tiermem.config.specs import PRECISIONS as _WORKING_DTYPES, working_dtype
from tiermem.errors import ConfigError
from tiermem.optim.formats import ADAM, StateFormat, state_format
from tiermem.plan.buckets import Bucket
from tiermem.plan.footprint import TRAINING_STATE, footprint, totals
from tiermem.plan.placement import weights_sharded
from tiermem.types import TensorClass, Tier

#: The precisions, in the order plan prints them (declared with their dtypes in tiermem.config.specs).
PRECISIONS = tuple(_WORKING_DTYPES)

_FP32 = torch.float32.itemsize  # master, momentum and variance


# NOTE [Built-in placements]
# The home tier of each tensor class under each built-in policy, read off the policy classes
# themselves (their ``homes``), so this module never keeps a copy that could drift. Read when first
# asked for, not at import: tiermem.policies is built on tiermem, and the plan layer must not import it.
@cache
def builtin_placements() -> dict[str, Mapping[TensorClass, Tier]]:
    from tiermem.policies import KeepOnDevice, ZeroInfinity, ZeroOffload

    return {cls.__name__: dict(cls.homes) for cls in (ZeroOffload, KeepOnDevice, ZeroInfinity)}


def __getattr__(name: str) -> Any:
    if name == "BUILTIN_PLACEMENTS":  # the placements by policy name, as a module attribute
        return builtin_placements()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Which tensor class each part of the training state belongs to.
PART_CLASS: dict[str, TensorClass] = {
    "params": TensorClass.PARAM,
    "grads": TensorClass.GRAD,
    "master": TensorClass.OPTIM_STATE,
    "momentum": TensorClass.OPTIM_STATE,
    "variance": TensorClass.OPTIM_STATE,
}


@dataclass(frozen=True)
class StateBytes:
    """Bytes of each part of the training state (or bytes per parameter, from `bytes_per_param`)."""

    params: int
    grads: int
    master: int
    momentum: int
    variance: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.momentum + self.variance

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_precision(precision: str) -> str:
    if not (isinstance(precision, str) and precision in _WORKING_DTYPES):
        raise ConfigError(f"tiermem: precision={precision!r} is not one of {', '.join(PRECISIONS)}; pick one of those")
    return precision


def _check_count(what: str, n: int) -> int:
    if not is_int(n) or n < 0:
        raise ConfigError(f"tiermem: {what}={n!r} is not a parameter count; give a whole number >= 0")
    return n


def bytes_per_param(precision: str) -> StateBytes:
    """Bytes per trainable parameter of each part, grads counted in the params' dtype."""
    p = working_dtype(check_precision(precision)).itemsize
    return StateBytes(params=p, grads=p, master=_FP32, momentum=_FP32, variance=_FP32)


def state_bytes(trainable: int, precision: str, *, frozen: int = 0) -> StateBytes:
    """Bytes of each part for ``trainable`` parameters that Adam updates and ``frozen`` ones it does not."""
    _check_count("trainable", trainable)
    _check_count("frozen", frozen)
    per = bytes_per_param(precision)
    return StateBytes(
        params=per.params * (trainable + frozen),
        grads=per.grads * trainable,
        master=per.master * trainable,
        momentum=per.momentum * trainable,
        variance=per.variance * trainable,
    )


def placement_of(policy: str) -> Mapping[TensorClass, Tier]:
    """The home tier of each tensor class under a built-in policy (see NOTE [Built-in placements])."""
    try:
        return builtin_placements()[policy]
    except KeyError:
        raise ConfigError(
            f"tiermem: no built-in policy named {policy!r}; pick one of {', '.join(builtin_placements())}"
        ) from None


#: the optimizer state options ``tiermem plan`` compares (NOTE [State formats]): Adam's fp32 state,
#: 8-bit moments (tiermem.AdamW8bit), and 8-bit moments with bf16 master weights
#: (``bf16_stochastic_round=True``, bf16 precision only)
STATE_OPTIONS: dict[str, tuple[Kind, torch.dtype]] = {
    "fp32": (Kind.ADAMW, torch.float32),
    "8-bit": (Kind.ADAMW8BIT, torch.float32),
    "8-bit + bf16 master": (Kind.ADAMW8BIT, torch.bfloat16),
}


def state_option(option: str, trainable: int, precision: str) -> Optional[StateFormat]:
    """The state format of ``option`` (:data:`STATE_OPTIONS`) for ``trainable`` parameters in one
    bucket, or None where the precision does not allow it (bf16 master weights need bf16)."""
    kind, master = STATE_OPTIONS[option]
    if master == torch.bfloat16 and precision != "bf16":
        return None
    return state_format(kind, master_dtype=master, numel=trainable, min_8bit_size=1)


def tier_bytes(
    trainable: int,
    precision: str,
    placement: Mapping[TensorClass, Tier],
    *,
    frozen: int = 0,
    world: int = 1,
    shard_weights: bool = False,
    state: StateFormat = ADAM,
) -> dict[Tier, int]:
    """Bytes each tier holds for the training state under ``placement``: the training-state part
    of :func:`tiermem.plan.footprint.footprint` for one bucket of ``trainable`` parameters (see
    NOTE [Bytes per parameter] for what it leaves out). ``world``: the bytes of one of that many
    data-parallel ranks (its share of grads and optimizer state, and of the weights, frozen ones
    too, when they are sharded: off the device, or with ``shard_weights``); ``state``: the optimizer state's format
    (Adam's fp32 state by default; :func:`state_option`)."""
    _check_count("trainable", trainable)
    _check_count("frozen", frozen)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ConfigError(f"tiermem: world={world!r} is not a number of ranks; give a whole number >= 1")
    home = placement[TensorClass.PARAM]
    bucket = Bucket(
        0,
        grad_tier=placement[TensorClass.GRAD],
        state_tier=placement[TensorClass.OPTIM_STATE],
        group=0,
        param_tier=home,
        numel=trainable,
        state=state,
    )
    base = torch.empty(frozen, dtype=torch.float32, device="meta")  # no memory
    cold = Bucket(1, home, home, 0, home, frozen=True)  # NOTE [Frozen weights sharded over the ranks]
    if frozen and weights_sharded(cold, world, shard_weights):
        cold.add("frozen", torch.nn.Parameter(base, requires_grad=False), 0)
    need = footprint(
        [bucket],
        [] if cold.slots else [(base, home)],
        working_dtype(check_precision(precision)),
        world=world,
        shard_weights=shard_weights,
        sharded_frozen=[cold] if cold.slots else [],
    )
    return totals(need, TRAINING_STATE)


@dataclass(frozen=True)
class Limits:
    """What each tier can hold. ``device_shares_host``: no accelerator, so the device tier is
    carved out of the same RAM as the host tier and the two must fit in ``host`` together."""

    device: int
    host: int
    nvme: int
    device_shares_host: bool = False


@dataclass(frozen=True)
class Fit:
    fits: bool
    short: dict[Tier, int]  # bytes missing on each tier that does not fit (empty when it fits)
    device_headroom: int  # bytes left on the device for activations (negative when short)


def check_fit(need: Mapping[Tier, int], limits: Limits) -> Fit:
    """Whether ``need`` (bytes per tier) fits within ``limits``, and by how much it misses."""
    short: dict[Tier, int] = {}
    device_room = limits.device - need[Tier.DEVICE]
    # A device that shares host RAM and is allowed all of it is checked by the RAM sum below alone.
    if device_room < 0 and not (limits.device_shares_host and limits.device >= limits.host):
        short[Tier.DEVICE] = -device_room
    ram_need = need[Tier.HOST] + (need[Tier.DEVICE] if limits.device_shares_host else 0)
    if ram_need > limits.host:
        short[Tier.HOST] = ram_need - limits.host
    if limits.device_shares_host:
        device_room = min(device_room, limits.host - ram_need)
    if need[Tier.NVME] > limits.nvme:
        short[Tier.NVME] = need[Tier.NVME] - limits.nvme
    return Fit(fits=not short, short=short, device_headroom=device_room)


def policies(names: Optional[list[str]] = None) -> list[str]:
    """The built-in policy names, in the order plan prints them (or the validated subset asked for)."""
    if names is None:
        return list(builtin_placements())
    for n in names:
        placement_of(n)
    return list(names)
