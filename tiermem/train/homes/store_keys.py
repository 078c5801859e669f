"""Store keys as values: what the homes' buffers are called in the stores.

A key is an owner (a bucket's ``b.key``, or a parameter's qualified name) and a part (what of it:
its grads, its working weights, a part of its optimizer state, ...). Its text, ``<owner>:<part>``
(``bucket3:grad``, ``bucket3:param shard``, ``bucket3:exp_avg``, ``layers.0.weight:frozen``), is
what the stores, their ledgers, ``tm.report()``, the NVMe files and the tests have always read, so
it must not change. Each home makes its keys with the functions below, and a home that reads
another's buffer (a sharded chunk rounded from its master) makes that key with the same function
instead of writing its text again. The stores take ``str(key)``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Union

from tiermem.optim.formats import StateFormat, StatePart
from tiermem.plan.buckets import Bucket

__all__ = ["Part", "StoreKey", "bucket_key", "state_key", "master_key"]


class Part(enum.Enum):
    """What of its owner a buffer holds (a part of the optimizer state is its :class:`StatePart`)."""

    GRAD = "grad"  # a bucket's fp32 grads accumulating (in memory; on NVMe, NvmeGrads' one key)
    GRAD_ALT = "grad_alt"  # the second accumulation buffer, under overlap_step
    GRAD_IN = "grad_in"  # the grads brought where Adam runs, when that is another tier
    GRAD_LANDING = "grad landing"  # the device buffer a whole bucket's grads are reduce-scattered from
    GRAD_LANDING_COPY = "grad landing copy"  # its copy a first pass under update_in_backward sends instead
    PARAM = "param"  # working weights: a bucket's on the device, or a staging buffer's for uploads
    PARAM_OUT = "param_out"  # Adam's new weights of a bucket under overlap_step
    PARAM_SHARD = "param shard"  # this rank's chunk of a sharded bucket's working weights
    GATHERED = "gathered"  # a sharded bucket gathered whole on the device
    STATE = "state"  # a bucket's optimizer state, every part back to back, on NVMe
    FROZEN = "frozen"  # a frozen parameter's copy in its own dtype


@dataclass(frozen=True)
class StoreKey:
    """One buffer's key: ``owner`` (a bucket's key or a parameter's name) and its ``part``."""

    owner: str
    part: Union[Part, StatePart]

    def __str__(self) -> str:
        part = self.part.value if isinstance(self.part, Part) else self.part.name
        return f"{self.owner}:{part}"


def bucket_key(b: Bucket, part: Part) -> StoreKey:
    """The key of ``b``'s buffer ``part``."""
    return StoreKey(b.key, part)


def state_key(b: Bucket, part: StatePart) -> StoreKey:
    """The key of ``b``'s optimizer state part ``part`` in a memory tier (MemoryState's buffers)."""
    return StoreKey(b.key, part)


def master_part(fmt: StateFormat) -> StatePart:
    """``fmt``'s master weights: the part every StateFormat has (named ``master``: the checkpoint's
    ``master/<p>``), whatever the others are."""
    return next(p for p in fmt.parts if p.name == "master")


def master_key(b: Bucket) -> StoreKey:
    """The key of ``b``'s master weights in its state's memory tier (found through ``b``'s own
    state format, not by the place of the part)."""
    return state_key(b, master_part(b.state))
