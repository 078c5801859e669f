"""A weight whose bytes live off the device: a tensor subclass that is real wherever it is read.

# NOTE [Weights off the device are a tensor subclass]
A parameter homed on the host or NVMe (ZeRO-Infinity) is, for as long as a TieredModel wraps its
module, an :class:`OffDeviceWeight`: a wrapper tensor with the parameter's shape, dtype and device
but no storage of its own. The parameter object stays the same Python object (its contents are
exchanged with :func:`torch.utils.swap_tensors`), so the module, tied aliases, gradient hooks and
user references keep pointing at it, and ``isinstance(p, nn.Parameter)`` still holds.

Every aten op that reaches such a tensor goes through :meth:`OffDeviceWeight.__torch_dispatch__`,
below autograd, whoever calls it: its own module's forward, another module's code (a tied head,
peft's ``lora_embedding_A[name].T`` of a ``ParameterDict`` that never runs forward), a forward
recomputed by activation checkpointing (reentrant or not), autograd's backward formulas, or user
code outside ``tm(...)``. So there is no access path left to miss:

- a *view* (``.T``, ``.mT``, ``view``, ``transpose``, indexing by slices, ``detach``, ``split``, ...)
  costs nothing: it is another OffDeviceWeight describing the same bytes (size, stride and offset
  into the weight), computed on the meta device;
- any op that *computes* with the values gets the real tensor on the device, from the
  :class:`WeightSource` (the weights' home): resident already when its module is running (the
  module hooks fetch ahead along the recorded order), or fetched just in time for this one op;
- an op that *writes* into the weight is refused with a ``tiermem:`` error naming the weight and
  the op, except inside ``tm.resident(...)``, where the write goes to the resident copy and reaches
  home when the block ends.

Autograd saves the OffDeviceWeight (a few hundred bytes), not the device copy, so a weight is
fetched again when backward needs it and no device copy outlives its use. The results of ops are
plain tensors; gradients of such a parameter are plain tensors too.

Why not the others' ways. FSDP2 frees an unsharded parameter by resizing its storage to zero and
relies on hooks to refill it before any use: a use the hooks did not foresee reads freed memory.
DeepSpeed ZeRO-3 leaves an empty tensor in ``param.data`` and patches ``F.linear`` and module
hooks; "external parameters" must be registered by hand, and a missed read computes on an empty
tensor or fails far from its cause. tiermem's previous way (a NaN placeholder, module hooks, a
saved-tensor hook and a TorchFunctionMode) shared their weakness: every path they missed computed
with NaN. The price here is a Python call per op that touches an off-device weight (a few of them
per module, measured in ``bench/forward_hooks.py``), and that dynamo cannot trace the fetch, so a
compiled model with off-device weights runs its forward eagerly (NOTE [Parameters off the device]).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, Optional, Protocol, Sequence

import torch
from torch._ops import OpOverload

from tiermem.errors import TierMemError

__all__ = ["OffDeviceWeight", "WeightSource", "is_off_device"]


class WeightSource(Protocol):
    """Where the real values of off-device weights come from (their home)."""

    def holding(self, keys: Sequence[str], reader: str) -> ContextManager[Sequence[torch.Tensor]]:
        """The device tensors of ``keys`` (each the whole weight, contiguous), valid for the block.
        ``reader`` names the op, for errors and the count of fetches the schedule did not foresee."""

    def written(self, key: str, op: str) -> None:
        """An op is about to write into ``key``'s resident copy; raise if that is not allowed now."""


class OffDeviceWeight(torch.Tensor):
    """A view (size, stride, offset) of the weight ``key`` whose values ``source`` holds
    (NOTE [Weights off the device are a tensor subclass])."""

    _source: WeightSource
    _key: str

    @staticmethod
    def __new__(cls, source: WeightSource, key: str, size: Sequence[int], stride: Sequence[int], offset: int,
                dtype: torch.dtype, device: torch.device, requires_grad: bool = False) -> "OffDeviceWeight":
        t = torch.Tensor._make_wrapper_subclass(cls, size, strides=stride, storage_offset=offset, dtype=dtype,
                                                device=device, requires_grad=requires_grad)
        t._source, t._key = source, key
        return t

    @classmethod
    def whole(cls, source: WeightSource, key: str, shape: Sequence[int], dtype: torch.dtype,
              device: torch.device, requires_grad: bool = False) -> "OffDeviceWeight":
        """The weight ``key`` itself: contiguous, at offset 0."""
        return cls(source, key, shape, _contiguous_strides(shape), 0, dtype, device, requires_grad)

    # ops never see this class through torch functions: dispatch below is where it is handled
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: OpOverload, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        kind = _kind(func)
        if kind is _VIEW:
            return _view(func, args, kwargs)
        weights = _weights_in(args, kwargs)
        source, reader = weights[0]._source, _op_name(func)
        if kind is not _PURE:
            for i in kind:  # the arguments this op writes into
                target = args[i] if i < len(args) else None
                if type(target) is OffDeviceWeight:
                    source.written(target._key, reader)
        keys = list(dict.fromkeys(w._key for w in weights))
        with source.holding(keys, reader) as reals:
            real = dict(zip(keys, reals))
            out = func(*_replace(args, real), **{k: _replace_one(v, real) for k, v in kwargs.items()})
        if kind is not _PURE:  # an in-place op returns the tensor it wrote: give back the weight, not its copy
            return _rewrap_written(func, args, out)
        return out

    # -- what a user sees ----------------------------------------------------------------------------
    def real(self) -> torch.Tensor:
        """A plain copy of the values, on the weight's device, outside autograd."""
        with torch.no_grad():
            return torch.ops.aten.clone.default(self)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: D105
        head = "Parameter containing:\n" if getattr(self, "_is_param", False) else ""
        return f"{head}{self.real()!r} (tiermem: {self._key!r}, homed off the device)"

    def numpy(self, *, force: bool = False) -> Any:
        return self.real().numpy(force=force)

    def tolist(self) -> Any:
        return self.real().tolist()

    def __reduce_ex__(self, protocol: int) -> Any:
        """Pickled (``torch.save``, ``copy.deepcopy``) as a plain tensor with the real values."""
        value = self.real()
        if getattr(self, "_is_param", False):
            value = torch.nn.Parameter(value, requires_grad=self.requires_grad)
        return value.__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        value = self.real()
        if getattr(self, "_is_param", False):
            value = torch.nn.Parameter(value, requires_grad=self.requires_grad)
        memo[id(self)] = value
        return value


def is_off_device(t: Any) -> bool:
    return type(t) is OffDeviceWeight


# -- what kind of op ---------------------------------------------------------------------------------
_VIEW = "view"
_PURE: tuple[int, ...] = ()
_KINDS: dict[OpOverload, Any] = {}


def _kind(func: OpOverload) -> Any:
    """``_VIEW`` (every result aliases an input, nothing is written), or the positions of the
    arguments the op writes into (``_PURE``: none). Cached: schemas do not change."""
    kind = _KINDS.get(func)
    if kind is None:
        schema = func._schema
        written = tuple(i for i, a in enumerate(schema.arguments)
                        if a.alias_info is not None and a.alias_info.is_write)
        aliasing = bool(schema.returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                                for r in schema.returns)
        kind = _VIEW if aliasing and not written else (written or _PURE)
        _KINDS[func] = kind
    return kind


def _op_name(func: OpOverload) -> str:
    return func.__name__.split(".")[0]


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


# -- views: metadata only ----------------------------------------------------------------------------
def _meta(w: OffDeviceWeight) -> torch.Tensor:
    return torch.empty(0, dtype=w.dtype, device="meta").as_strided(w.size(), w.stride(), w.storage_offset())


def _view(func: OpOverload, args: tuple, kwargs: dict) -> Any:
    """The same op on meta tensors gives each result's size, stride and offset into the weight."""
    base = next(a for a in _flat(args, kwargs) if type(a) is OffDeviceWeight)
    out = func(*_map(args, _to_meta), **{k: _map_one(v, _to_meta) for k, v in kwargs.items()})

    def wrap(o: Any) -> Any:
        if not isinstance(o, torch.Tensor):
            return o
        return OffDeviceWeight(base._source, base._key, o.size(), o.stride(), o.storage_offset(), o.dtype, base.device)
    return [wrap(o) for o in out] if isinstance(out, (list, tuple)) else wrap(out)


def _to_meta(x: Any) -> Any:
    return _meta(x) if type(x) is OffDeviceWeight else x


# -- computing: the real values ----------------------------------------------------------------------
def _flat(args: tuple, kwargs: dict) -> Iterator[Any]:
    """Every argument, one level into lists and tuples (aten's ``Tensor[]``)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _weights_in(args: tuple, kwargs: dict) -> list[OffDeviceWeight]:
    return [a for a in _flat(args, kwargs) if type(a) is OffDeviceWeight]


def _real_of(w: OffDeviceWeight, real: dict[str, torch.Tensor]) -> torch.Tensor:
    return real[w._key].as_strided(w.size(), w.stride(), w.storage_offset())


def _replace_one(x: Any, real: dict[str, torch.Tensor]) -> Any:
    return _map_one(x, lambda t: _real_of(t, real) if type(t) is OffDeviceWeight else t)


def _replace(args: tuple, real: dict[str, torch.Tensor]) -> tuple:
    return tuple(_replace_one(a, real) for a in args)


def _map_one(x: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(x, (list, tuple)):
        return type(x)(fn(t) for t in x)
    return fn(x)


def _map(args: tuple, fn: Callable[[Any], Any]) -> tuple:
    return tuple(_map_one(a, fn) for a in args)


def _rewrap_written(func: OpOverload, args: tuple, out: Any) -> Any:
    """An in-place or ``out=`` op returns the tensor it wrote into: the caller's own argument."""
    kind = _kind(func)
    if isinstance(out, torch.Tensor) and kind and kind[0] < len(args):
        return args[kind[0]]
    return out


@contextlib.contextmanager
def no_source_error(key: str, why: str) -> Iterator[None]:
    """For sources that no longer hold anything (a dropped or detached model)."""
    raise TierMemError(f"tiermem: the weight {key!r} is not readable: {why}")
    yield  # pragma: no cover
