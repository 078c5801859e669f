"""A rank's chunk of each sharded bucket's working weights, at home, and the gathers that rebuild
whole buckets from every rank's chunk (NOTE [Weights sharded over the ranks] in
:mod:`tiermem.train.weights.gathered`).

- :class:`ShardHome`: where this rank's chunks rest, one interface whatever the tier:
  :class:`MemoryShards` (one buffer per bucket in the device's or the host's store; Adam running
  on that tier writes the new weights into it directly), :class:`MasterShards` (no buffer: each
  gather rounds the chunk from the fp32 master in the same memory, NOTE [A chunk rounded from its
  master])
  and :class:`NvmeShards` (one NVMe key per bucket, read into a pooled host buffer for each gather).
- :class:`Gatherer`: the protocol on the gathers' own process group. Every collective there is
  announced by a small header (what it is, which bucket, its size) that every rank checks against
  the others' before any data moves: ranks about to pair different buckets (a forward that read
  another weight on one rank) stop at once with an error that names both, instead of mixing two
  buckets' bytes or hanging until the group's timeout.
"""

from __future__ import annotations

import hashlib
import itertools
from abc import ABC, abstractmethod
from typing import Callable, Optional, Sequence

import torch

from tiermem.errors import TierMemError
from tiermem.handles import Handle
from tiermem.plan.buckets import Bucket
from tiermem.train.homes.store_keys import Part, bucket_key, master_key
from tiermem.transfer.collectives import Group, Pending
from tiermem.transfer.service import CopyService
from tiermem.types import TensorClass, Tier


def _nothing() -> None:
    return None


def shard_key(b: Bucket) -> str:
    """The key of this rank's chunk of ``b``'s working weights, in the store of its tier."""
    return str(bucket_key(b, Part.PARAM_SHARD))


class ShardHome(ABC):
    """This rank's chunk (``group.chunk(b.numel).size`` elements, the working precision) of the
    working weights of some buckets; a bucket's chunk and the bucket share ``b.index``."""

    tier: Tier
    #: the chunks are rounded from the master whenever read: the update need not write them
    from_master: bool = False

    @abstractmethod
    def write(self, b: Bucket, src: torch.Tensor, src_tier: Tier) -> list[Handle]:
        """Store ``src`` (the chunk's elements, any float dtype, on ``src_tier``) as ``b``'s chunk;
        ``src`` stays unchanged until the handles are done."""

    @abstractmethod
    def read(self, b: Bucket) -> tuple[torch.Tensor, Callable[[], None]]:
        """``b``'s chunk in memory for a gather to send, and the function that frees it (once the
        gather has read it)."""

    def in_place(self, b: Bucket, compute_tier: Tier) -> Optional[torch.Tensor]:
        """The chunk's own buffer, when Adam running on ``compute_tier`` can write into it."""
        return None


class MemoryShards(ShardHome):
    """Chunks in buffers of a memory tier (the device's: ``shard_weights=True``; the host's)."""

    def __init__(
        self, store, engine: CopyService, buckets: Sequence[Bucket], sizes: dict[int, int], dtype: torch.dtype
    ):
        self.tier, self.engine = store.tier, engine
        self._chunk = {
            b.index: store.allocate(shard_key(b), (sizes[b.index],), dtype, TensorClass.PARAM) for b in buckets
        }

    def write(self, b: Bucket, src: torch.Tensor, src_tier: Tier) -> list[Handle]:
        chunk = self._chunk[b.index]
        return [
            self.engine.copy_async(
                chunk, src[: chunk.numel()], src_tier=src_tier, dst_tier=self.tier, kind=TensorClass.PARAM
            )
        ]

    def read(self, b: Bucket) -> tuple[torch.Tensor, Callable[[], None]]:
        return self._chunk[b.index], _nothing

    def in_place(self, b: Bucket, compute_tier: Tier) -> Optional[torch.Tensor]:
        return self._chunk[b.index] if compute_tier == self.tier else None


# NOTE [A chunk rounded from its master]
# A rank's chunk of a bucket's working weights is, at every moment a gather can read it, its fp32
# master chunk (same rank, same chunk of the same bucket: ShardedState's) rounded to the working
# precision: the update writes ``out = master.to(out.dtype)`` for the whole chunk (BucketUpdates._adam
# in tiermem/train/step/updates.py fills the parameters it skips from the master too), a failed
# step sends the masters again, a checkpoint loads the master and the weights from the same
# values, and ``tm.resident`` writes become the master (ModelState.take_weights) before the next
# gather (the block's buckets stay gathered while they are written). Frozen parameters have no
# chunk here (they are in no bucket).
# So when the chunk's home is the memory that holds the master the chunk is not stored at all:
# each gather casts the master chunk into a buffer that lives until the gather has sent it, bit
# for bit what the stored chunk held, and the rank keeps 4 bytes of fp32 master per parameter
# instead of 4 + 2. That memory is the master's own tier (weights and optimizer state on the host;
# on the device with shard_weights and KeepOnDevice), or the device beside a master on the host
# when the device is the CPU itself: there the two tiers are the same DRAM, no bus lies between
# them, and a gather rounding the chunk from the master moves 6 bytes per parameter of the chunk
# in memory (4 read, 2 written) where the kept chunk cost each update as many (Adam's 2 bytes of
# output, then 2 + 2 to copy them into the chunk), so the 2 bytes per parameter kept on the
# "device" would buy nothing. On a GPU the chunk stays on the device beside a host master: each
# gather would otherwise move the master's 4 bytes per parameter over PCIe instead of the chunk's
# 2. Not under overlap_step (the update rewrites
# the master while the next forward gathers), and not on NVMe (a gather would read the master's 4
# bytes per parameter instead of the chunk's 2): tiermem.plan.placement.weights_from_master. The
# update writes no new weights for these chunks (out=None: WeightHome.from_master), which saves
# the kernel 2 bytes of writes per parameter and the buffer they would go to. Weights off the
# device in one process whose master is bf16 are that master itself, on the host and on NVMe
# (NOTE [One copy of bf16 master weights] in tiermem/train/weights/param_offload.py).
class MasterShards(ShardHome):
    """Chunks never stored: rounded from the master in ``master_store`` (the optimizer state's
    tier) for each gather, into a buffer of ``store`` (the chunks' tier) as large as the largest
    chunk (so a host pool reuses one size)."""

    from_master = True

    def __init__(self, store, master_store, buckets: Sequence[Bucket], sizes: dict[int, int], dtype: torch.dtype):
        self.tier, self.store, self.master_store, self.sizes, self.dtype = store.tier, store, master_store, sizes, dtype
        self._largest = max(sizes[b.index] for b in buckets)
        self._reads = itertools.count()

    def write(self, b: Bucket, src: torch.Tensor, src_tier: Tier) -> list[Handle]:
        return []  # the master has the values already (NOTE [A chunk rounded from its master])

    def read(self, b: Bucket) -> tuple[torch.Tensor, Callable[[], None]]:
        n = self.sizes[b.index]
        master = self.master_store.get(str(master_key(b)))[:n]  # ShardedState's chunk of the master
        key = f"<gather {b.key} #{next(self._reads)}>"
        buf = self.store.allocate(key, (self._largest,), self.dtype, TensorClass.PARAM)[:n]
        buf.copy_(master)  # rounded to nearest, as the update's `out` would be
        return buf, lambda: self.store.delete(key)


class NvmeShards(ShardHome):
    """Chunks under one NVMe key per bucket; a gather reads its chunk into a pooled host buffer."""

    tier = Tier.NVME

    def __init__(self, engine: CopyService, sizes: dict[int, int], dtype: torch.dtype):
        self.engine, self.sizes, self.dtype = engine, sizes, dtype

    def write(self, b: Bucket, src: torch.Tensor, src_tier: Tier) -> list[Handle]:
        src = src[: self.sizes[b.index]]
        if src.dtype != self.dtype:  # an fp32 master (a checkpoint, the first weights): rounded, written, waited
            self.engine.store_write(
                Tier.NVME, shard_key(b), src.to(self.dtype), src_tier=src_tier, kind=TensorClass.PARAM
            ).wait()
            return []
        return [self.engine.store_write(Tier.NVME, shard_key(b), src, src_tier=src_tier, kind=TensorClass.PARAM)]

    def read(self, b: Bucket) -> tuple[torch.Tensor, Callable[[], None]]:
        n = self.sizes[b.index]
        lease = self.engine.lease(n * self.dtype.itemsize, f"<gather {b.key}>", TensorClass.PARAM)
        try:
            t = lease.view(self.dtype)
            self.engine.store_read(Tier.NVME, shard_key(b), t, kind=TensorClass.PARAM).wait()
        except BaseException:
            lease.release()
            raise
        return t, lease.release


# -- the protocol on the gathers' group ----------------------------------------------------------
GATHER, END = 1, 2


class Gatherer:
    """Gathers announced by a header every rank checks (see the module's docstring). The headers
    travel on a group of their own (``headers``), all of one size, so ranks out of step pair two
    headers and find out, never a header with a bucket's bytes; a gather's data goes out on
    ``group`` only once every rank announced the same bucket, in the order announced, so the k-th
    data collective is the same bucket on every rank. ``names``: a few parameter names of each
    bucket, by index, for the errors."""

    def __init__(self, group: Group, headers: Group, names: dict[int, list[str]]):
        self.group, self.headers, self.names = group, headers, names

    def announce(self, b: Bucket, at: int) -> Pending:
        """Tell every rank that this one gathers ``b`` next (for its access ``at``); returns at once."""
        return self.headers.exchange_async([GATHER, b.index, b.numel, at])

    def launch(self, announced: Pending, full: torch.Tensor, mine: torch.Tensor) -> Pending:
        """Once every rank announced the same bucket (else a ``tiermem:`` error naming what each
        announced), start gathering it into ``full`` (``padded`` elements) from every rank's ``mine``."""
        self._check(announced.wait())
        return self.group.all_gather_async(full, mine)

    def end(self, accesses: Sequence[str]) -> bool:
        """The iteration ended on every rank; whether every rank made the same ``accesses``."""
        digest = int.from_bytes(hashlib.sha256("\n".join(accesses).encode()).digest()[:7], "little")
        told = self.headers.exchange([END, digest, len(accesses), len(accesses)])
        self._check(told)
        return all(h[1:3] == told[0][1:3] for h in told)

    def _check(self, told: list[list[int]]) -> None:
        rank = self.headers.rank
        mine = told[rank]
        differ = [r for r, h in enumerate(told) if h[0] != mine[0] or (mine[0] == GATHER and h[:3] != mine[:3])]
        if differ:
            said = "; ".join(f"rank {r} {self._what(h)}" for r, h in enumerate(told))
            raise TierMemError(
                f"tiermem: rank {rank} of {self.headers.world}: the ranks are out of step on their sharded "
                f"weights: {said}. Every rank must read the same weights in the same order (a branch that depends "
                f"on the data or the rank reads another weight on some ranks?): read the same weights on every "
                f"rank, or place PARAM on the device without shard_weights (NOTE [Weights sharded over the ranks])"
            )

    def _what(self, h: list[int]) -> str:
        if h[0] == END:
            return f"ended the iteration after {h[3]} accesses"
        shown = self.names.get(h[1], [])
        return f"gathers bucket {h[1]} ({', '.join(shown[:3])}{', ...' if len(shown) > 3 else ''}) for access {h[3]}"
