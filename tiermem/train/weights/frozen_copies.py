"""The copies of frozen parameters in their own dtype (NOTE [Frozen weights keep one copy] in
tiermem/train/weights/frozen.py): whole in host memory (:class:`HostCopy`) or on NVMe
(:class:`NvmeCopy`), or sharded over the ranks like the parameter's working copy
(:class:`ShardedCopy`: each rank keeps its chunk's elements in one of the other two).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from tiermem.errors import StoreError
from tiermem.memory.base import Store
from tiermem.train.homes.store_keys import Part, StoreKey
from tiermem.transfer.collectives import Group
from tiermem.types import TensorClass, Tier

__all__ = ["HostCopy", "NvmeCopy", "ShardedCopy", "copy_key"]


def copy_key(name: str) -> str:
    """The key of frozen parameter ``name``'s copy in its own dtype, in the store of its tier (in
    the device store the same key is its working copy)."""
    return str(StoreKey(name, Part.FROZEN))


class HostCopy:
    """A frozen parameter's copy in its own dtype in host memory (NOTE [Frozen weights keep one
    copy]): a buffer of the host store, read and written in place."""

    tier = Tier.HOST

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def read(self, *, own: bool = False) -> torch.Tensor:
        return self.tensor.clone() if own else self.tensor

    def target(self) -> torch.Tensor:
        return self.tensor

    def write(self, value: torch.Tensor) -> None:
        if value is not self.tensor:
            self.tensor.copy_(value.reshape(self.tensor.shape))


class NvmeCopy:
    """A frozen parameter's copy in its own dtype on NVMe, under :func:`copy_key` (NOTE [Frozen
    weights keep one copy]): each read is a fresh host tensor nothing else holds, each write waits
    until it landed."""

    tier = Tier.NVME

    def __init__(self, store: Store, name: str, shape: tuple[int, ...], dtype: torch.dtype):
        self.store, self.name, self.shape, self.dtype = store, name, shape, dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def read(self, *, own: bool = False) -> torch.Tensor:
        out = self.target()
        try:
            self.store.read(copy_key(self.name), out).wait()
        except StoreError as e:
            dtype = str(self.dtype).removeprefix("torch.")
            why = str(e).removeprefix("tiermem: ")  # it names the file and what to change
            raise StoreError(f"tiermem: the {dtype} copy of frozen parameter {self.name!r}: {why}") from e
        return out

    def target(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype)

    def write(self, value: torch.Tensor) -> None:
        value = value.to("cpu", self.dtype).reshape(self.shape)
        self.store.write(copy_key(self.name), value, TensorClass.PARAM).wait()


class ShardedCopy:
    """A frozen parameter's copy in its own dtype sharded over the ranks like its working copy
    (NOTE [Frozen weights sharded over the ranks] in tiermem/train/weights/frozen.py): this rank
    keeps elements ``[lo, hi)`` of the flattened parameter, those its bucket's chunk holds, in
    ``piece`` (None where it keeps none), on ``tier``; ``spans``: every rank's ``(lo, hi)``, in
    rank order, the same on every rank. A read gathers every rank's piece over ``group``
    (collective: every rank reads it, in the same order as the others); a write keeps this rank's."""

    def __init__(
        self,
        piece: Optional[HostCopy | NvmeCopy],
        tier: Tier,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        spans: Sequence[tuple[int, int]],
        group: Group,
    ):
        self.piece, self.tier, self.shape, self.dtype, self.group = piece, tier, shape, dtype, group
        self.spans = [(lo, max(lo, hi)) for lo, hi in spans]
        self.lo, self.hi = self.spans[group.rank]

    @property
    def nbytes(self) -> int:
        return self.piece.nbytes if self.piece is not None else 0

    def read_piece(self) -> torch.Tensor:
        """This rank's elements of the copy, flat, in a tensor nothing else holds."""
        if self.piece is None:
            return torch.empty(0, dtype=self.dtype)
        return self.piece.read(own=True).reshape(-1)

    def write_piece(self, piece: torch.Tensor) -> None:
        """``piece`` (this rank's elements, flat) becomes its part of the copy; no communication."""
        assert piece.numel() == self.hi - self.lo, (piece.numel(), self.lo, self.hi)
        if self.piece is not None:
            self.piece.write(piece)

    def read(self, *, own: bool = False) -> torch.Tensor:
        """The whole copy, gathered from every rank's piece into a fresh tensor (collective: as
        bytes, so every value arrives bit for bit)."""
        size = self.dtype.itemsize
        width = max(hi - lo for lo, hi in self.spans) * size
        out = torch.empty(self.shape, dtype=self.dtype)
        if not width:
            return out
        mine = torch.zeros(width, dtype=torch.uint8)
        piece = self.read_piece()
        mine[: piece.numel() * size].copy_(piece.view(torch.uint8))
        every = torch.empty(width * len(self.spans), dtype=torch.uint8)
        self.group.all_gather(every, mine)
        flat = out.view(-1).view(torch.uint8)
        for r, (lo, hi) in enumerate(self.spans):
            flat[lo * size : hi * size].copy_(every[r * width : r * width + (hi - lo) * size])
        return out

    def target(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype)

    def write(self, value: torch.Tensor) -> None:
        """``value`` (the whole parameter) becomes the copy: this rank keeps its elements."""
        self.write_piece(value.detach().reshape(-1)[self.lo : self.hi])
