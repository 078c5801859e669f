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
import logging
from typing import Any, Callable, ContextManager, Iterator, Optional, Protocol, Sequence, SupportsIndex

import torch
from torch._ops import OpOverload

from tiermem.errors import ConfigError, TierMemError

__all__ = ["OffDeviceWeight", "WeightSource", "is_off_device", "Link", "SwappedParams", "point", "swap_param"]

log = logging.getLogger(__name__)


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
    def __new__(
        cls,
        source: WeightSource,
        key: str,
        size: Sequence[int],
        stride: Sequence[int],
        offset: int,
        dtype: torch.dtype,
        device: torch.device,
        requires_grad: bool = False,
    ) -> "OffDeviceWeight":
        t = torch.Tensor._make_wrapper_subclass(
            cls, size, strides=stride, storage_offset=offset, dtype=dtype, device=device, requires_grad=requires_grad
        )
        t._source, t._key = source, key
        return t

    @classmethod
    def whole(
        cls,
        source: WeightSource,
        key: str,
        shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        requires_grad: bool = False,
    ) -> "OffDeviceWeight":
        """The weight ``key`` itself: contiguous, at offset 0."""
        return cls(source, key, shape, _contiguous_strides(shape), 0, dtype, device, requires_grad)

    # ops never see this class through torch functions: dispatch below is where it is handled
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # torch's own way to disable it

    @classmethod
    @torch._disable_dynamo  # never traced: NOTE [Callbacks dynamo must not trace] in tiermem/train/hooks.py
    def __torch_dispatch__(  # type: ignore[override]  # torch: untyped
        cls,
        func: OpOverload,
        types: Any,
        args: tuple = (),
        kwargs: Optional[dict] = None,
    ) -> Any:
        kwargs = kwargs or {}
        kind = _kind(func)
        if kind is _VIEW:
            return _view(func, args, kwargs)
        weights = _weights_in(args, kwargs)
        reader = _op_name(func)
        if kind is not _PURE:
            for i in kind:  # the arguments this op writes into
                target = args[i] if i < len(args) else None
                if type(target) is OffDeviceWeight:
                    target._source.written(target._key, reader)
        by_source: dict[int, tuple[WeightSource, list[str]]] = {}  # weights of two homes may meet in one op
        for w in weights:
            keys = by_source.setdefault(id(w._source), (w._source, []))[1]
            if w._key not in keys:
                keys.append(w._key)
        with contextlib.ExitStack() as held:
            real: dict[str, torch.Tensor] = {}
            for source, keys in by_source.values():
                real.update(zip(keys, held.enter_context(source.holding(keys, reader))))
            out = func(*_replace(args, real), **{k: _replace_one(v, real) for k, v in kwargs.items()})
        if kind is not _PURE:  # an in-place op returns the tensor it wrote: give back the weight, not its copy
            return _rewrap_written(func, args, out)
        return out

    # -- what a user sees ----------------------------------------------------------------------------
    def real(self) -> torch.Tensor:  # type: ignore[override]  # Tensor.real (complex part) does not apply to weights
        """A plain copy of the values, on the weight's device, outside autograd."""
        with torch.no_grad():
            return torch.ops.aten.clone.default(self)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # as torch's, keyword only
        head = "Parameter containing:\n" if getattr(self, "_is_param", False) else ""
        return f"{head}{self.real()!r} (tiermem: {self._key!r}, homed off the device)"

    def numpy(self, *, force: bool = False) -> Any:
        return self.real().numpy(force=force)

    def tolist(self) -> Any:
        return self.real().tolist()

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
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
        written = tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
        aliasing = bool(schema.returns) and all(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        )
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
        return OffDeviceWeight(base._source, base._key, o.size(), o.stride(), o.storage_offset(), o.dtype, base.device)  # type: ignore[arg-type]  # eager: an int

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
    whole = real[w._key]  # the weight's values may begin anywhere in their storage (a view of a gathered bucket)
    return whole.as_strided(w.size(), w.stride(), whole.storage_offset() + w.storage_offset())


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


# -- the parameters that become such weights ---------------------------------------------------------
class Link:
    """What off-device weights ask for their values: their home (``source``) while the model
    lives; once it is given back (a model dropped without ``detach()``), a clear error. Each home
    has its own: the weights of two homes may meet in one op."""

    __slots__ = ("source",)

    def __init__(self, source: WeightSource):
        self.source: Optional[WeightSource] = source

    def _live(self, key: str) -> WeightSource:
        if self.source is None:
            raise TierMemError(
                f"tiermem: the weight {key!r} lived off the device under a TieredModel that was "
                f"dropped without detach(), so its values are gone: build the module again (and "
                f"call tm.detach() or tm.save(path) before dropping a model whose weights you need)"
            )
        return self.source

    def holding(self, keys: Sequence[str], reader: str) -> ContextManager[Sequence[torch.Tensor]]:
        return self._live(keys[0]).holding(keys, reader)

    def written(self, key: str, op: str) -> None:
        self._live(key).written(key, op)


#: what an OffDeviceWeight keeps in its ``__dict__``: not the user's, so not carried across a swap
_OWN = frozenset({"_source", "_key", "_is_param"})


def swap_param(p: torch.nn.Parameter, other: torch.nn.Parameter, name: str) -> None:
    """Exchange the contents of two parameters, keeping each Python object; attributes user code
    set on ``p`` (``torch.utils.swap_tensors`` exchanges those too) stay with ``p``."""
    attrs = {k: v for k, v in vars(p).items() if k not in _OWN}
    try:
        torch.utils.swap_tensors(p, other)
    except RuntimeError as e:
        raise ConfigError(
            f"tiermem: the parameter {name!r} cannot be homed off the device: {e}; build the "
            f"TieredModel before anything else holds references into the parameter (a "
            f"torch.compile'd call, a live autograd graph), or place PARAM on the device"
        ) from None
    vars(p).update(attrs)


def point(p: torch.Tensor, value: torch.Tensor) -> None:
    """``p.data = value``, also where the two differ in device type (a parameter on the meta device
    getting its first real tensor, or given back its meta one): the Python object stays."""
    if p.device.type == value.device.type:
        p.data = value
        return
    stand_in = torch.nn.Parameter(value, requires_grad=p.requires_grad) if isinstance(p, torch.nn.Parameter) else value
    swap_param(p, stand_in, "a parameter on the meta device")  # type: ignore[arg-type]  # a plain tensor swaps too


class SwappedParams:
    """Parameters of ``module`` (``params``: name -> parameter) that become OffDeviceWeights, each
    keeping its Python object, and the plain tensors swapped out of them, until the model settles
    (construction succeeded), is undone (it failed) or gives them back (``detach()``)."""

    def __init__(self, module: torch.nn.Module, params: dict[str, torch.nn.Parameter]):
        self._params = dict(params)
        where = {id(p): name for name, p in self._params.items()}
        self._places: dict[str, list[tuple[torch.nn.Module, str]]] = {}  # name -> every (module, attribute) of it
        for mod in module.modules():
            for attr, p in mod._parameters.items():
                if p is not None and id(p) in where:
                    self._places.setdefault(where[id(p)], []).append((mod, attr))
        self._plain: dict[str, torch.nn.Parameter] = {}  # name -> the plain tensor swapped out of the parameter
        self._rested: dict[str, Optional[torch.Tensor]] = {}  # name -> its tensor before rest_on (None once settled)

    def swap_in(self, name: str, link: Link, dtype: torch.dtype, device: torch.device) -> None:
        """The parameter ``name`` becomes an :class:`OffDeviceWeight` whose values ``link`` holds."""
        p = self._params[name]
        weight = torch.nn.Parameter(
            OffDeviceWeight.whole(link, name, tuple(p.shape), dtype, device), requires_grad=p.requires_grad
        )
        swap_param(p, weight, name)
        self._plain[name] = weight  # now the plain one; its data goes back in restore() or undo()

    def rest_on(self, name: str, home: torch.Tensor) -> None:
        """The parameter ``name`` stays a plain tensor, over ``home``, the memory of its home (NOTE
        [Host weights read in place] in tiermem/train/weights/param_offload.py)."""
        p = self._params[name]
        self._rested[name] = p.data
        point(p, home)

    def __contains__(self, name: str) -> bool:
        """Whether the parameter ``name`` is an :class:`OffDeviceWeight` already, or rests on its home."""
        return name in self._plain or name in self._rested

    def settle(self) -> None:
        """Construction succeeded: the original tensors swapped out of the parameters are let go."""
        for plain in self._plain.values():
            plain.data = torch.empty(0, dtype=plain.dtype, device=plain.device)
        self._rested = dict.fromkeys(self._rested)

    def undo(self) -> None:
        """Construction failed: every parameter gets back the tensor it had (before :meth:`settle`)."""
        for name, plain in self._plain.items():
            self._put_back(name, plain)
        self._plain.clear()
        for name, before in self._rested.items():
            if before is not None:
                point(self._params[name], before)
        self._rested.clear()

    def restore(self, values: dict[str, torch.Tensor]) -> None:
        """``detach()``: each parameter becomes a plain tensor again, holding ``values[name]``."""
        for name, plain in self._plain.items():
            point(plain, values[name])  # a meta model's plain tensors are on the meta device
            self._put_back(name, plain)
        self._plain.clear()
        for name in self._rested:
            point(self._params[name], values[name])  # off the home's memory, which goes with the model
        self._rested.clear()

    def cut_off(self, link: Link, dtype: torch.dtype, device: torch.device) -> None:
        """The model is given back without ``detach()``: a parameter resting on its home's memory
        (which the home may hand to another tensor now) becomes an :class:`OffDeviceWeight` of
        ``link``, whose reads fail clearly."""
        for name in list(self._rested):
            self.swap_in(name, link, dtype, device)
        self._rested.clear()

    def _put_back(self, name: str, plain: torch.nn.Parameter) -> None:
        """The plain tensor back in the parameter object; if something still holds references into
        the parameter (a graph ``torch.compile`` built with it under overlap_step), the modules get
        ``plain`` as their parameter instead, a new object with the same values and attributes."""
        p = self._params[name]
        try:
            swap_param(p, plain, name)
        except ConfigError:
            vars(plain).update({k: v for k, v in vars(p).items() if k not in _OWN})
            for mod, attr in self._places.get(name, []):
                mod._parameters[attr] = plain
            log.info(
                "tiermem: %r was still referenced elsewhere (a compiled graph?), so the module holds a new "
                "Parameter object for it, with its values",
                name,
            )
