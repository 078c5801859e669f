"""Frozen parameters: their working copy at its home, and a copy in their own dtype only where needed.

# NOTE [Frozen weights keep one copy]
# A parameter without optimizer state (frozen: LoRA's base model, a frozen encoder) computes with
# its working copy, in the working precision, on the device or at its home off the device. The
# value the user gave is also what checkpoints, ``detach()``, ``state_dict()`` and a later unfreeze
# read, in the parameter's own dtype. When that dtype is the working one (a model loaded in bf16
# and trained in bf16, fp32 in fp32, or a parameter that is not floating point), the working copy
# *is* that value: nothing else is kept, and those reads fetch it from its home (NVMe included)
# one parameter at a time. Only a parameter whose dtype differs from the working precision (an
# fp32 model trained in bf16) keeps a second copy, in its own dtype, on the host: rounding it to
# the working precision cannot be undone. So a bf16 model fine-tuned with its base weights on NVMe
# holds none of them in host memory between uses; an fp32 one holds 4 bytes per frozen parameter
# there, which the footprint counts (``FROZEN_COPY``) and a log line names once. Trained weights
# with a bf16 master keep one copy the same way (NOTE [One copy of bf16 master weights] in
# tiermem/train/param_offload.py).

# NOTE [Frozen weights sharded over the ranks]
# Under data parallelism the frozen parameters whose working weights would be sharded if they
# trained (homed off the device; with ``shard_weights=True``, on it too: weights_sharded in
# tiermem/plan/placement.py) are sharded like trainable ones, so a LoRA base spread over N ranks
# costs each rank 1/N of it at home, not all of it. The plan packs them into buckets of their own
# (tiermem.plan.placement.frozen_buckets: ``Bucket.frozen``, no grads, no optimizer state, indices
# past the trainable buckets), and :class:`~tiermem.train.gathered.GatheredWeights` homes them
# with the trainable sharded buckets: a chunk per rank on the home tier (never rounded from a
# master: they have none), each parameter an OffDeviceWeight gathered by the same module hooks,
# schedule, lookahead and per-op reads (forward, a forward recomputed by checkpointing, backward's
# formulas), and freed after use. The chunks are cut from rank 0's values at construction (one
# broadcast per bucket), as the trainable masters are, or from a checkpoint's (``weights=``): the
# same on every rank, each reading its chunk, no broadcast (NOTE [Models on the meta device]). Their
# values are read by gathering (:meth:`FrozenParams.value`: collective, so every rank reads the
# same frozen parameters in the same order: a single-file checkpoint, ``state_dict()``,
# ``detach()``, ``sharded_state_dict()``),
# written by each rank into its own piece (:meth:`FrozenParams.write`, a single file's load). A
# DCP directory gathers nothing: each rank hands DCP its own pieces of them, read from its chunk
# at home one bucket at a time, and reads back into its chunk the pieces it keeps now
# (:meth:`FrozenParams.local_pieces`, NOTE [Sharded values for DCP]), so its save and load hold
# one chunk of the base at a time, never all of it. A host copy in the parameter's own dtype
# (above) stays whole on every rank (a DCP directory has it whole, from rank 0). Frozen weights
# on the device without ``shard_weights``, and frozen parameters that are not floating point,
# stay replicated (ZeRO-2); in one process nothing is sharded. Unfreezing one under data
# parallelism is refused (NOTE [Freezing and unfreezing]).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator, Optional

import torch

from tiermem.memory.resident import MemoryStore
from tiermem.plan.buckets import Bucket
from tiermem.plan.footprint import keeps_copy
from tiermem.train.gathered import GatheredWeights
from tiermem.train.materialize import Values
from tiermem.train.offdevice import point
from tiermem.train.param_offload import ParamOffload
from tiermem.transfer.collectives import Group
from tiermem.types import TensorClass, Tier

log = logging.getLogger("tiermem")

__all__ = ["FrozenParams"]


class FrozenParams:
    """The frozen parameters of a model by name (NOTE [Frozen weights keep one copy]): where their
    working copies live, and the host copies of those whose dtype differs from the working one.
    ``off_device``: the home of those off the device each on its own; ``sharded``: of those sharded
    over the ranks (NOTE [Frozen weights sharded over the ranks])."""

    def __init__(
        self,
        module: torch.nn.Module,
        off_device: Optional[ParamOffload],
        sharded: Optional[GatheredWeights] = None,
    ):
        self._module = module
        self._off = off_device
        self._sharded = sharded
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # in the order placed
        self.copies: dict[str, torch.Tensor] = {}  # name -> the host copy in the parameter's own dtype

    # -- building ------------------------------------------------------------------------------------
    def place(
        self,
        name: str,
        p: torch.nn.Parameter,
        stores: dict[Tier, MemoryStore],
        dtype: torch.dtype,
        device,
        value: Optional[Callable[[], torch.Tensor]] = None,
    ) -> None:
        """Take the frozen parameter ``p``: its working copy in ``dtype`` (floating point) to the
        device, or to its home off the device, and a host copy of its value where it keeps one.
        ``value``: gives its first value, called only where it is needed here (NOTE [Models on the
        meta device]); default: its own."""
        self._meta[name] = (tuple(p.shape), p.dtype)
        target = dtype if p.is_floating_point() else p.dtype
        copied = keeps_copy(p.dtype, target, p.is_floating_point())
        if self._in_shards(name) and not copied:
            return  # its bucket's chunk is cut by :meth:`shard`, once every frozen parameter is here
        first = (p.detach() if value is None else value()).to(p.dtype)
        if copied:
            copy = stores[Tier.HOST].allocate(f"{name}:frozen", p.shape, p.dtype, TensorClass.PARAM)
            copy.copy_(first)
            self.copies[name] = copy
        if self._in_shards(name):
            return
        if self._is_off(name):
            assert self._off is not None
            self._off.adopt(name, first.to(dtype=target, copy=True))
        else:
            point(
                p, stores[Tier.DEVICE].adopt(f"{name}:frozen", first.to(device=device, dtype=target), TensorClass.PARAM)
            )

    def shard(self, buckets: list[Bucket], group: Group, dtype: torch.dtype, given: Optional[Values] = None) -> None:
        """Each frozen bucket's chunk at home, from rank 0's values (NOTE [Frozen weights sharded
        over the ranks]); its parameters become OffDeviceWeights. Collective unless the values are
        the same on every rank (a checkpoint's): then each rank reads its chunk's elements alone.
        ``given``: where the values come from (NOTE [Models on the meta device]); default: the
        parameters' own."""
        for b in buckets:
            assert self._sharded is not None and b.frozen
            if given is not None and given.agreed:
                values = torch.zeros(b.numel, dtype=dtype)  # the chunk filled, the rest unread
                lo, hi = self._sharded.initial_span(b)
                for s in b.slots:
                    first, last = max(lo, s.offset), min(hi, s.offset + s.numel)
                    if first < last:
                        given.param_into(s.name, s.param, values[first:last], first - s.offset)
            else:
                read = (lambda s: s.param.detach()) if given is None else (lambda s: given.param(s.name, s.param))
                values = torch.cat([read(s).reshape(-1).to("cpu", dtype) for s in b.slots])
                group.broadcast_(values)  # every rank starts from rank 0's weights
            self._sharded.initialize(b, values)

    def log_copies(self) -> None:
        if self.copies:
            nbytes = sum(t.numel() * t.element_size() for t in self.copies.values())
            dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in self.copies.values()})
            log.info(
                "tiermem: %d frozen parameters keep a %s copy on the host beside their working copy "
                "(%.2f GiB): load the model in the working precision to keep one copy only",
                len(self.copies),
                "/".join(dtypes),
                nbytes / 2**30,
            )

    # -- as a collection -----------------------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        return name in self._meta

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._meta))

    def __len__(self) -> int:
        return len(self._meta)

    def pop(self, name: str) -> None:
        """``name`` trains from now on (NOTE [Freezing and unfreezing]); the caller deletes its
        host copy's key from the host store."""
        del self._meta[name]
        self.copies.pop(name, None)

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """The parameter's shape and its own dtype, reading nothing."""
        return self._meta[name]

    # -- values --------------------------------------------------------------------------------------
    def shown(self, name: str) -> torch.Tensor:
        """The tensor a param group shows for it: its host copy, or the parameter itself."""
        copy = self.copies.get(name)
        return copy if copy is not None else self._module.get_parameter(name)

    def value(self, name: str, *, own: bool = False) -> torch.Tensor:
        """Its value in its own dtype, on the host: the host copy itself, or the working copy (the
        parameter's data, copied from a GPU, or read from its home off the device; gathered when
        sharded over the ranks: then collective). With ``own``, a tensor nothing else holds (a live
        one is cloned; one read from home already is)."""
        copy = self.copies.get(name)
        if copy is not None:
            return copy.clone() if own else copy
        if self._in_shards(name):
            assert self._sharded is not None
            with self._sharded.holding([name], "a checkpoint or detach()") as (held,):
                return held.to("cpu", copy=True)
        if self._is_off(name):
            assert self._off is not None
            with self._off.holding([name], "a checkpoint or detach()") as (held,):
                return held.to("cpu", copy=True)
        data = self._module.get_parameter(name).data
        return data.to("cpu", copy=True) if own or data.device.type != "cpu" else data

    def target(self, name: str) -> torch.Tensor:
        """A host tensor to read a new value into, then :meth:`write`: the host copy, the
        parameter's data (the device is the CPU), or a new one."""
        copy = self.copies.get(name)
        if copy is not None:
            return copy
        data = self._module.get_parameter(name).data
        if self._is_off(name) or self._in_shards(name) or data.device.type != "cpu":
            shape, dtype = self._meta[name]
            return torch.empty(shape, dtype=dtype)
        return data

    def write(self, name: str, value: torch.Tensor) -> None:
        """``value`` (in the parameter's own dtype) becomes the parameter's: its host copy, and its
        working copy at its home."""
        copy = self.copies.get(name)
        if copy is not None and copy is not value:
            copy.copy_(value)
        p = self._module.get_parameter(name)
        if self._in_shards(name):
            assert self._sharded is not None
            self._sharded.write_home(name, value.to(p.dtype))
        elif self._is_off(name):
            assert self._off is not None
            self._off.write_home(name, value.to(p.dtype))
        elif p.data is not value:
            p.data.copy_(value)

    # -- this rank's pieces of the sharded ones (a DCP checkpoint: NOTE [Sharded values for DCP]) ---
    def local_pieces(self) -> list[tuple[int, list[tuple[str, tuple[int, ...], int, int, int]]]]:
        """Per frozen bucket sharded over the ranks, in bucket order: its index and, for each
        parameter whose value is its working copy (:meth:`collective`), the elements ``[lo, hi)``
        of the flattened parameter this rank's chunk holds and where they start in the chunk
        (``(name, shape, lo, hi, at)``; rank 0 names a parameter of no elements). Reads nothing."""
        g = self._sharded
        if g is None:
            return []
        out = []
        for b in g.full.values():
            if not b.frozen:
                continue
            c = g.chunks[b.index]
            mine = []
            for s in b.slots:
                if not self.collective(s.name):
                    continue  # its host copy is its value, whole on every rank: rank 0 writes it whole
                lo, hi = c.overlap(s.offset, s.numel)
                if lo < hi:
                    mine.append((s.name, tuple(s.shape), lo - s.offset, hi - s.offset, lo - c.start))
                elif s.numel == 0 and c.rank == 0:
                    mine.append((s.name, tuple(s.shape), 0, 0, 0))
            out.append((b.index, mine))
        return out

    def read_local(self, index: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """This rank's chunk of frozen bucket ``index`` as it rests at home (in the working dtype,
        padding included), and the function that frees it; no communication."""
        assert self._sharded is not None
        b, c = self._frozen_bucket(index), self._sharded.chunks[index]
        chunk, release = self._sharded.shards[index].read(b)
        return chunk[: c.size], release

    def write_local(self, index: int, chunk: torch.Tensor) -> None:
        """``chunk`` (on the host, in the working dtype) becomes this rank's chunk of frozen bucket
        ``index`` at home; gathered copies no one holds are dropped. No communication."""
        assert self._sharded is not None
        self._sharded.begin_update()
        for h in self._sharded.shards[index].write(self._frozen_bucket(index), chunk, Tier.HOST):
            h.wait()

    def _frozen_bucket(self, index: int) -> Bucket:
        assert self._sharded is not None
        b = next(b for b in self._sharded.full.values() if b.index == index)
        assert b.frozen
        return b

    def collective(self, name: str) -> bool:
        """Whether reading ``name``'s value gathers it over the ranks (every rank must read it)."""
        return name not in self.copies and self._in_shards(name)

    def _is_off(self, name: str) -> bool:
        return self._off is not None and name in self._off.homes

    def _in_shards(self, name: str) -> bool:
        return self._sharded is not None and name in self._sharded.homes
