"""Frozen parameters: their working copy at its home, and a copy in their own dtype only where needed.

# NOTE [Frozen weights keep one copy]
# A parameter without optimizer state (frozen: LoRA's base model, a frozen encoder) computes with
# its working copy, in the working precision, on the device or at its home off the device. The
# value the user gave is also what checkpoints, ``detach()``, ``state_dict()`` and a later unfreeze
# read, in the parameter's own dtype. When that dtype is the working one (a model loaded in bf16
# and trained in bf16, fp32 in fp32, or a parameter that is not floating point), the working copy
# *is* that value: nothing else is kept, and those reads fetch it from its home (NVMe included)
# one parameter at a time. Only a parameter whose dtype differs from the working precision (an
# fp32 model trained in bf16) keeps a second copy, in its own dtype: rounding it to the working
# precision cannot be undone. That copy lives where the working copy's home says
# (tiermem.plan.footprint.copy_tier): beside a working copy homed on NVMe (ZeroInfinity), on NVMe
# too, under a key of its own (``<name>:frozen``) written at construction and read back one
# parameter at a time into a fresh tensor by those reads; beside one on the host or the device, on
# the host. So a model fine-tuned with its base weights on NVMe holds none of them in host memory
# between uses, bf16 or fp32; an fp32 one homed on the host or the device holds 4 bytes per frozen
# parameter there (under data parallelism, 4/N where the working copy is sharded over the N ranks:
# the copy is sharded with it, NOTE [Frozen weights sharded over the ranks]). The copies live in
# tiermem/train/weights/frozen_copies.py. The footprint counts the copies on their tier
# (``FROZEN_COPY``) and a log line names them once, with where they are. Trained weights with a
# bf16 master keep one copy the same way (NOTE [One copy of bf16 master weights] in
# tiermem/train/weights/param_offload.py).

# NOTE [Frozen weights sharded over the ranks]
# Under data parallelism the frozen parameters whose working weights would be sharded if they
# trained (homed off the device; with ``shard_weights=True``, on it too: weights_sharded in
# tiermem/plan/placement.py) are sharded like trainable ones, so a LoRA base spread over N ranks
# costs each rank 1/N of it at home, not all of it. The plan packs them into buckets of their own
# (tiermem.plan.placement.frozen_buckets: ``Bucket.frozen``, no grads, no optimizer state, indices
# past the trainable buckets), and :class:`~tiermem.train.weights.gathered.GatheredWeights` homes them
# with the trainable sharded buckets: a chunk per rank on the home tier (never rounded from a
# master: they have none), each parameter an OffDeviceWeight gathered by the same module hooks,
# schedule, lookahead and per-op reads (forward, a forward recomputed by checkpointing, backward's
# formulas), and freed after use. The chunks are cut from rank 0's values at construction (one
# broadcast per bucket), as the trainable masters are, or from a checkpoint's (``weights=``): the
# same on every rank, each reading its chunk, no broadcast (NOTE [Models on the meta device]).
# A parameter that keeps a copy in its own dtype (above: an fp32 base trained in bf16) keeps it
# sharded the same way (:class:`~tiermem.train.weights.frozen_copies.ShardedCopy`): each rank its
# chunk's elements of it, in that dtype, on the copy's tier (copy_tier of its chunk's home: NVMe
# beside a chunk on NVMe, else the host), cut from the same values (rank 0's, broadcast bit for bit
# in that dtype, or the checkpoint's, each rank reading its piece), the chunk's elements rounded
# from them; nothing of it stays whole on a rank. Their values are read by gathering
# (:meth:`FrozenParams.value`: the working copy's bucket, or the copy's pieces, as bytes: collective,
# so every rank reads the same frozen parameters in the same order: a single-file checkpoint,
# ``state_dict()``, ``detach()``, ``sharded_state_dict()``), written by each rank into its own
# pieces (:meth:`FrozenParams.write`, a single file's load; a resident block's write, into its piece
# of the copy: :meth:`FrozenParams.copy_piece`). A DCP directory gathers nothing: each rank hands DCP
# its own pieces of them, read from its chunk at home one bucket at a time, or from its piece of
# the copy, in the parameter's own dtype, and reads back the pieces it keeps now into its chunk and
# its pieces of the copies (:meth:`FrozenParams.local_pieces`, NOTE [Sharded values for DCP]), so
# its save and load hold one chunk of the base at a time, never all of it. Frozen weights
# on the device without ``shard_weights``, and frozen parameters that are not floating point,
# stay replicated (ZeRO-2); in one process nothing is sharded. Unfreezing one under data
# parallelism is refused (NOTE [Freezing and unfreezing]).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Iterator, Mapping, Optional

import torch

from tiermem.memory.base import Store
from tiermem.memory.resident import MemoryStore
from tiermem.plan.buckets import Bucket, Slot
from tiermem.plan.footprint import copy_tier, keeps_copy
from tiermem.train.weights.frozen_copies import HostCopy, NvmeCopy, ShardedCopy, copy_key
from tiermem.train.weights.gathered import GatheredWeights
from tiermem.train.weights.materialize import Values
from tiermem.train.weights.offdevice import point
from tiermem.train.weights.param_offload import ParamOffload
from tiermem.transfer.collectives import Group
from tiermem.types import TensorClass, Tier

log = logging.getLogger("tiermem")

__all__ = ["FrozenParams", "copy_key"]


class FrozenParams:
    """The frozen parameters of a model by name (NOTE [Frozen weights keep one copy]): where their
    working copies live, and the copies of those whose dtype differs from the working one (on the
    host, or on NVMe beside a working copy homed there).
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
        self._copies: dict[str, HostCopy | NvmeCopy | ShardedCopy] = {}  # name -> its copy in its own dtype
        self._stores: Mapping[Tier, Store] = {}  # where copies go, as :meth:`place` was given them

    # -- building ------------------------------------------------------------------------------------
    def place(
        self,
        name: str,
        p: torch.nn.Parameter,
        stores: Mapping[Tier, Store],
        dtype: torch.dtype,
        device,
        value: Optional[Callable[[], torch.Tensor]] = None,
    ) -> None:
        """Take the frozen parameter ``p``: its working copy in ``dtype`` (floating point) to the
        device, or to its home off the device, and a copy of its value where it keeps one (on
        NVMe when its working copy's home is, else on the host).
        ``value``: gives its first value, called only where it is needed here (NOTE [Models on the
        meta device]); default: its own."""
        self._meta[name] = (tuple(p.shape), p.dtype)
        if self._in_shards(name):
            self._stores = stores  # its bucket's chunk, and its copy's piece, are cut by :meth:`shard`
            return
        target = dtype if p.is_floating_point() else p.dtype
        first = (p.detach() if value is None else value()).to(p.dtype)
        if keeps_copy(p.dtype, target, p.is_floating_point()):
            home = self._off.homes[name] if self._off is not None and name in self._off.homes else Tier.HOST
            self._copies[name] = self._room(name, tuple(p.shape), p.dtype, copy_tier(home), stores)
            self._copies[name].write(first)
        if self._is_off(name):
            assert self._off is not None
            self._off.adopt(name, first.to(dtype=target, copy=True))
        else:
            on_device = stores[Tier.DEVICE]
            assert isinstance(on_device, MemoryStore)
            point(p, on_device.adopt(copy_key(name), first.to(device=device, dtype=target), TensorClass.PARAM))

    @staticmethod
    def _room(
        name: str, shape: tuple[int, ...], dtype: torch.dtype, tier: Tier, stores: Mapping[Tier, Store]
    ) -> HostCopy | NvmeCopy:
        """Room for ``shape`` elements of ``name``'s copy in its own dtype on ``tier`` (host or NVMe)."""
        if tier == Tier.NVME:
            return NvmeCopy(stores[Tier.NVME], name, shape, dtype)
        host = stores[Tier.HOST]
        assert isinstance(host, MemoryStore)
        return HostCopy(host.allocate(copy_key(name), shape, dtype, TensorClass.PARAM))

    def shard(self, buckets: list[Bucket], group: Group, dtype: torch.dtype, given: Optional[Values] = None) -> None:
        """Each frozen bucket's chunk at home, and this rank's pieces of the copies its parameters
        keep in their own dtype, from rank 0's values (NOTE [Frozen weights sharded over the
        ranks]); its parameters become OffDeviceWeights. Collective unless the values are the same
        on every rank (a checkpoint's): then each rank reads its chunk's elements alone.
        ``given``: where the values come from (NOTE [Models on the meta device]); default: the
        parameters' own."""
        for b in buckets:
            assert self._sharded is not None and b.frozen
            copies = self._sharded_copies(b, group, dtype)
            if given is not None and given.agreed:
                values = torch.empty(b.numel, dtype=dtype)  # the chunk filled, the rest unread
                for s, first, last in b.slots_within(*self._sharded.initial_span(b)):
                    out = values[s.offset + first : s.offset + last]
                    if s.name in copies:  # its piece read in its own dtype, the chunk's rounded from it
                        piece = torch.empty(last - first, dtype=copies[s.name].dtype)
                        given.param_into(s.name, s.param, piece, first)
                        copies[s.name].write_piece(piece)
                        out.copy_(piece)
                    else:
                        given.param_into(s.name, s.param, out, first)
            else:
                firsts = [self._first_value(s, given) for s in b.slots]  # whole: this bucket's only
                values = torch.cat([f.reshape(-1).to("cpu", dtype) for f in firsts])
                group.broadcast_(values)  # every rank starts from rank 0's weights
                kept = [(copies[s.name], f) for s, f in zip(b.slots, firsts) if s.name in copies]
                if kept:  # and from rank 0's copies, bit for bit
                    raw = group.broadcast_(torch.cat([f.to("cpu").reshape(-1).view(torch.uint8) for _, f in kept]))
                    at = 0
                    for copy, f in kept:
                        copy.write(raw[at : at + f.numel() * f.element_size()].clone().view(copy.dtype))  # aligned
                        at += f.numel() * f.element_size()
            self._copies.update(copies)
            self._sharded.initialize(b, values)

    def _sharded_copies(self, b: Bucket, group: Group, dtype: torch.dtype) -> dict[str, ShardedCopy]:
        """Room for this rank's pieces of the copies that frozen bucket ``b``'s parameters of
        another dtype than ``dtype`` keep: its chunk's elements of each, on the copy's tier."""
        assert self._sharded is not None
        c = self._sharded.chunks[b.index]
        out = {}
        for s in b.slots:
            shape, own = self._meta[s.name]
            if not keeps_copy(own, dtype, s.param.is_floating_point()):
                continue
            spans = [dataclasses.replace(c, rank=r).overlap(s.offset, s.numel) for r in range(c.world)]
            spans = [(lo - s.offset, hi - s.offset) for lo, hi in spans]
            lo, hi = spans[c.rank]
            tier = copy_tier(self._sharded.homes[s.name])
            piece = self._room(s.name, (hi - lo,), own, tier, self._stores) if hi > lo else None
            out[s.name] = ShardedCopy(piece, tier, shape, own, spans, group)
        return out

    def _first_value(self, s: Slot, given: Optional[Values]) -> torch.Tensor:
        """A frozen parameter's value as built, in its own dtype, whole: from where it comes."""
        first = s.param.detach() if given is None else given.param(s.name, s.param)
        return first.to(self._meta[s.name][1])

    def log_copies(self) -> None:
        if self._copies:
            dtypes = sorted({str(self._meta[n][1]).removeprefix("torch.") for n in self._copies})
            where = {Tier.HOST: "on the host", Tier.NVME: "on NVMe"}
            held = {t: sum(c.nbytes for c in self._copies.values() if c.tier == t) for t in where}
            sharded = [c for c in self._copies.values() if isinstance(c, ShardedCopy)]
            log.info(
                "tiermem: %d frozen parameters keep a %s copy beside their working copy (%s%s): load the "
                "model in the working precision to keep one copy only",
                len(self._copies),
                "/".join(dtypes),
                ", ".join(f"{n / 2**30:.2f} GiB {where[t]}" for t, n in held.items() if n) or "none here",
                f"; {len(sharded)} of them sharded over the {sharded[0].group.world} ranks, this rank's pieces"
                if sharded
                else "",
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
        copy's key (:func:`copy_key`) from the stores."""
        del self._meta[name]
        self._copies.pop(name, None)

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """The parameter's shape and its own dtype, reading nothing."""
        return self._meta[name]

    # -- values --------------------------------------------------------------------------------------
    def shown(self, name: str) -> torch.Tensor:
        """The tensor a param group shows for it: its host copy, or the parameter itself (also for
        one whose copy is on NVMe or sharded over the ranks: a group holds no whole copy for it)."""
        copy = self._copies.get(name)
        return copy.tensor if isinstance(copy, HostCopy) else self._module.get_parameter(name)

    def value(self, name: str, *, own: bool = False) -> torch.Tensor:
        """Its value in its own dtype, on the host: its copy (the host copy itself, read from
        NVMe, or gathered from the ranks' pieces when sharded: then collective), or the working copy (the parameter's data, copied from a GPU, or read from its home
        off the device; gathered when sharded over the ranks: then collective). With ``own``, a
        tensor nothing else holds (a live one is cloned; one read from home already is)."""
        copy = self._copies.get(name)
        if copy is not None:
            return copy.read(own=own)
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
        parameter's data (the device is the CPU), or a new one (also for a copy on NVMe or sharded
        over the ranks)."""
        copy = self._copies.get(name)
        if copy is not None:
            return copy.target()
        data = self._module.get_parameter(name).data
        if self._is_off(name) or self._in_shards(name) or data.device.type != "cpu":
            shape, dtype = self._meta[name]
            return torch.empty(shape, dtype=dtype)
        return data

    def write(self, name: str, value: torch.Tensor) -> None:
        """``value`` (in the parameter's own dtype) becomes the parameter's: its copy, and its
        working copy at its home (sharded over the ranks: this rank's piece of each; not
        collective)."""
        copy = self._copies.get(name)
        if copy is not None:
            copy.write(value)
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
        """Per frozen bucket sharded over the ranks, in bucket order: its index and, for each of its
        parameters, the elements ``[lo, hi)`` of the flattened parameter this rank's chunk holds
        (and its piece of the copy in its own dtype, where it keeps one: :meth:`copy_piece`) and
        where they start in the chunk (``(name, shape, lo, hi, at)``; rank 0 names a parameter of
        no elements). Reads nothing."""
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
        """Whether reading ``name``'s value gathers it over the ranks (every rank must read it):
        its working copy, or its copy in its own dtype, is sharded over them."""
        return self._in_shards(name)

    def keeps_copy(self, name: str) -> bool:
        """Whether ``name`` keeps a copy in its own dtype beside its working copy."""
        return name in self._copies

    def copy_piece(self, name: str) -> tuple[torch.Tensor, int, int]:
        """This rank's elements ``[lo, hi)`` of ``name``'s copy in its own dtype, flat, and ``lo``
        and ``hi``: all of it (the host copy itself, or read from NVMe), or, sharded over the
        ranks, this rank's piece (:meth:`local_pieces`' span), read alone; no communication."""
        copy = self._copies[name]
        if isinstance(copy, ShardedCopy):
            return copy.read_piece(), copy.lo, copy.hi
        whole = copy.read().reshape(-1)
        return whole, 0, whole.numel()

    def live(self, name: str) -> Optional[torch.Tensor]:
        """``name``'s value as :meth:`copy_piece` gives it (flat; its piece when its copy is sharded
        over the ranks), where that is a host tensor read in place: a copy in host memory, or the
        working copy when the device is the CPU; else None (reading it reads its home)."""
        copy = self._copies.get(name)
        if isinstance(copy, ShardedCopy):
            if copy.piece is None:
                return torch.empty(0, dtype=copy.dtype)
            copy = copy.piece
        if isinstance(copy, HostCopy):
            return copy.tensor.reshape(-1)
        if copy is not None or self._is_off(name) or self._in_shards(name):
            return None
        data = self._module.get_parameter(name).data
        return data.reshape(-1) if data.device.type == "cpu" else None

    def write_copy(self, name: str, piece: torch.Tensor) -> None:
        """``piece`` (in the parameter's own dtype, :meth:`copy_piece`'s elements) becomes that part
        of its copy; its working copy is left as it is. No communication."""
        copy = self._copies[name]
        if isinstance(copy, ShardedCopy):
            copy.write_piece(piece)
        else:
            copy.write(piece)

    def _is_off(self, name: str) -> bool:
        return self._off is not None and name in self._off.homes

    def _in_shards(self, name: str) -> bool:
        return self._sharded is not None and name in self._sharded.homes
