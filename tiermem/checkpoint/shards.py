"""A process's pieces of each parameter's fp32 state, in a form torch.distributed.checkpoint plans with.

# NOTE [Sharded values for DCP]
Under data parallelism rank r keeps chunk r of every bucket's fp32 master, exp_avg and exp_avg_sq
(NOTE [Data parallel]), and under ZeRO-3 chunk r of every frozen bucket's working weights (NOTE
[Frozen weights sharded over the ranks] in tiermem/train/weights/frozen.py: saved and loaded the same
way, in their own dtype, which is the working one). A bucket is parameters laid end to end, so the part of one parameter a
rank keeps is an arbitrary range ``[lo, hi)`` of its flattened elements: a parameter may sit
whole on one rank, or be cut anywhere, even inside a row. DCP stores a tensor as chunks, each an
N-d box (offsets, sizes) of the tensor's real shape, and its load planner intersects the boxes
one run wrote with those another run asks for: that is what lets any world size read any other's.

The representations it already knows do not fit those ranges. A DTensor sharded over a 1-d mesh
gives rank r the r-th ``torch.chunk`` of a dimension, not an arbitrary range: the ranks would have
to exchange elements at every save and load, and hold a second copy of the state to do it.
``ShardedTensor`` holds arbitrary boxes but is deprecated and needs a process group. So
:class:`ShardedValue` is a tensor subclass that carries no storage of its own and implements the
three methods DCP's planner asks any tensor for (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``: the protocol DTensor itself implements).
Its range is cut into boxes by :func:`flat_boxes`: a range of a row-major tensor is at most
``2 * ndim - 1`` boxes (the end of a first partial row, whole rows, the start of a last partial
row, recursively in the inner dimensions), each a contiguous run of the range, so each box's data
is a view of the process's flat piece, never a copy. The checkpoint therefore holds every
parameter with its own shape under its ``module.state_dict()`` name, whatever the bucket size,
world size or placement that wrote it, and ``dcp.load({"model": module.state_dict()}, ...)``
reads full tensors into a plain module. Any other operation on a ShardedValue is a ``tiermem:``
error: it holds only this process's elements (``.local()`` gives them, ``tm.state_dict()`` the
whole weights).

Names (NOTE [Checkpoint format] for the single file): ``master/<p>`` and frozen parameters and
buffers are ``model.<name>`` (a frozen parameter whole in one chunk where one process, or rank 0
of a run that does not shard it, wrote it; in each rank's pieces where the ranks shard it: the
names are the same, so DCP's planner reads either layout into the other); ``exp_avg/<p>`` is ``optim.state.<p>.exp_avg`` (and likewise
``exp_avg_sq``), as torch's optimizer state dicts nest them; the step counts, loss scale and
hyperparameters are one JSON string under ``tiermem`` (the footer's ``meta``); a directory
tm.save wrote also holds ``tiermem_manifests``, the number of its manifests.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Union

import torch

from tiermem.checkpoint.names import StateName
from tiermem.errors import TierMemError

META = "tiermem"
#: in a directory tm.save wrote: the number of its manifests (NOTE [Checkpoint directories]), so
#: that one whose manifests were lost never loads as if a user's own dcp.save had written it
MANIFESTS = "tiermem_manifests"
Box = tuple[tuple[int, ...], tuple[int, ...], int]  # offsets, sizes, index of its first element in the flat tensor


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """The boxes that cover elements ``[lo, hi)`` of a row-major tensor of ``shape``, in order;
    an empty tensor is one empty box (so that it is saved), an empty range of another none."""
    if math.prod(shape) == 0:
        return [((0,) * len(shape), tuple(shape), 0)]
    out: list[Box] = []

    def cut(prefix: tuple[int, ...], dims: tuple[int, ...], lo: int, hi: int, base: int) -> None:
        if lo >= hi:
            return
        if not dims:  # one element of a 0-d tensor
            out.append((prefix, (1,) * len(prefix), base))
            return
        row = math.prod(dims[1:])
        first, last = -(-lo // row), hi // row  # whole rows [first, last)
        if first > last:  # inside one row
            r = lo // row
            cut(prefix + (r,), dims[1:], lo - r * row, hi - r * row, base + r * row)
            return
        if lo < first * row:  # the end of a partial row
            cut(prefix + (first - 1,), dims[1:], lo - (first - 1) * row, row, base + (first - 1) * row)
        if first < last:
            out.append(
                (
                    prefix + (first,) + (0,) * (len(dims) - 1),
                    (1,) * len(prefix) + (last - first,) + dims[1:],
                    base + first * row,
                )
            )
        if last * row < hi:  # the start of a partial row
            cut(prefix + (last,), dims[1:], 0, hi - last * row, base + last * row)

    cut((), tuple(shape), lo, hi, 0)
    return out


class Streamed:
    """A source read from the model's home when DCP asks (NOTE [Streamed sharded values]):
    :meth:`box` gives ``n`` elements from ``begin`` in a tensor of their own, read and copied under
    the source's lock (a writer may resolve from several threads); :meth:`forget` drops what it
    kept from an earlier read."""

    def box(self, begin: int, n: int) -> torch.Tensor:
        raise NotImplementedError

    def forget(self) -> None:
        pass


Source = Union[torch.Tensor, Callable[[], torch.Tensor], Streamed]


class ShardedValue(torch.Tensor):
    """Elements ``[lo, hi)`` of a flattened tensor of ``shape``: what one process keeps of a
    parameter's fp32 state (NOTE [Sharded values for DCP]). ``local`` is those elements as a 1-d
    tensor, or a function that returns them when DCP reads them (a checkpoint streamed from
    NVMe), or a :class:`Streamed` source. ``guard()``: checked when a DCP save plans it.
    ``.local()`` gives them; torch.distributed.checkpoint saves and loads them."""

    _name: str
    _lo: int
    _hi: int
    _source: Source
    _boxes: list[Box]
    _at: dict[tuple[int, ...], int]
    _guard: Optional[Callable[[], None]]
    _held: Optional[torch.Tensor]  # a streamed value's buffer for a dcp.load to fill
    _filled: set[int]  # the boxes a dcp.load asked for, into that buffer

    @staticmethod
    def __new__(
        cls,
        name: str,
        shape: tuple[int, ...],
        lo: int,
        hi: int,
        local: Source,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        guard: Optional[Callable[[], None]] = None,
    ) -> "ShardedValue":
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=torch.device(device))
        r._name, r._lo, r._hi, r._source, r._guard, r._held, r._filled = name, lo, hi, local, guard, None, set()
        r._boxes = flat_boxes(tuple(shape), lo, hi)
        r._at = {offsets: i for i, (offsets, _, _) in enumerate(r._boxes)}
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # torch's own way to disable it

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return args[0]
        value = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, ShardedValue))
        raise TierMemError(
            f"tiermem: {value._name!r} is a ShardedValue from tm.sharded_state_dict(): it holds only "
            f"this process's elements [{value._lo}, {value._hi}) of {math.prod(value.shape)}, so "
            f"{func} cannot run on it; use .local() for its elements, or tm.state_dict() for whole weights "
            f"(torch.distributed.checkpoint's async_save copies every value: use dcp.save)"
        )

    @property
    def local_range(self) -> tuple[int, int]:
        """``(lo, hi)``: which elements of the flattened tensor this process holds."""
        return self._lo, self._hi

    def local(self) -> torch.Tensor:
        """This process's elements, flat: a view of the model's state where it lives in memory;
        for a value read from its home when asked (NOTE [Streamed sharded values]), what a
        ``dcp.load`` filled in, else a copy read now."""
        if self._held is not None:
            return self._held
        if isinstance(self._source, Streamed):
            self._source.forget()
            return self._source.box(0, self._hi - self._lo)
        return self._source() if callable(self._source) else self._source

    def _box(self, i: int) -> torch.Tensor:
        _, sizes, start = self._boxes[i]
        begin = start - self._lo if math.prod(self.shape) else 0
        n = math.prod(sizes)
        if self._held is not None:  # a dcp.load fills it
            self._filled.add(i)
            return self._held[begin : begin + n].view(sizes)
        if isinstance(self._source, Streamed):  # its own bytes: a writer may keep it past the next read
            return self._source.box(begin, n).view(sizes)
        flat = self._source() if callable(self._source) else self._source
        return _own_storage(flat[begin : begin + n]).view(sizes)

    @property
    def filled(self) -> bool:
        """Whether :meth:`local` gives values without reading the home: a view of the live state,
        or a streamed value every box of which a ``dcp.load`` filled (NOTE [Streamed sharded values])."""
        if not isinstance(self._source, Streamed):
            return True
        return self._held is not None and len(self._filled) == len(self._boxes)

    def drop_loaded(self) -> None:
        """Forget what a ``dcp.load`` filled in (it went home): a later read is of the home again."""
        self._held, self._filled = None, set()

    # -- the protocol DCP's planner calls (DTensor implements it too) ------------------------------
    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        if self._held is not None:
            raise TierMemError(
                f"tiermem: {self._name!r} holds what a dcp.load filled in, which the model has not taken: "
                f"call tm.load_sharded_state_dict() with this dict first, or save a new tm.sharded_state_dict()"
            )
        if self._guard is not None:
            self._guard()
        if isinstance(self._source, Streamed):  # a save reads the home as it is now, not what a read before kept
            self._source.forget()
        properties = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.shape),
            )
            for offsets, chunk in zip((o for o, _, _ in self._boxes), self._chunks())
        ]

    def __create_chunk_list__(self) -> list:
        """DCP's load planner asks this (its save planner asks :meth:`__create_write_items__`): a
        streamed value gets a buffer for the load to fill, held until ``tm.load_sharded_state_dict``."""
        if isinstance(self._source, Streamed) and self._held is None:
            self._held, self._filled = torch.empty(self._hi - self._lo, dtype=self.dtype, device=self.device), set()
        return self._chunks()

    def _chunks(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes, _ in self._boxes]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        i = self._at.get(tuple(index.offset) if index.offset is not None else ())
        if i is None:
            raise TierMemError(
                f"tiermem: {self._name!r} has no piece at {tuple(index.offset or ())} on this process; "
                f"its pieces start at {sorted(self._at)}"
            )
        return self._box(i)

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"ShardedValue({self._name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"elements [{self._lo}, {self._hi}))"
        )


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` (flat, contiguous) sharing its bytes but as the whole of its storage where it is a view
    of a larger one on the CPU: DCP writes such a tensor as it is, where it would first copy a view
    (``torch.save`` writes a tensor's whole storage)."""
    if t.device.type != "cpu" or t.numel() == 0 or t.untyped_storage().nbytes() == t.nbytes:
        return t
    return torch.frombuffer(
        memoryview(t.view(torch.uint8).numpy()),  # type: ignore[arg-type]  # numpy's stubs
        dtype=t.dtype,
    )


def key(name: str | StateName) -> str:
    """The DCP key (flattened) of a tensor a tiermem checkpoint holds, by its tiermem name."""
    n = StateName.parse(name) if isinstance(name, str) else name
    return f"model.{n.param}" if n.of_module else f"optim.state.{n.param}.{n.part}"


def nested(values: dict[str, Any], meta_json: str) -> dict[str, Any]:
    """``values`` (by tiermem name) nested as DCP saves them (NOTE [Sharded values for DCP])."""
    model: dict[str, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    for n, v in ((StateName.parse(name), v) for name, v in values.items()):
        if n.of_module:
            model[n.param] = v
        else:
            state.setdefault(n.param, {})[n.part] = v
    return {"model": model, "optim": {"state": state}, META: meta_json}
