"""Activations: the tensors autograd saves for backward, accounted on the device or offloaded.

:class:`ActivationOffloader` installs ``torch.autograd.graph.saved_tensors_hooks`` around each
training forward. For every saved tensor it asks the policy where it lives, with a
``TensorInfo`` naming the innermost module whose forward is running (tracked by forward pre and
post hooks whose handles TieredModel keeps); ``nbytes`` is the size of the storage the tensor
views, which is what would move. Tensors that stay are accounted to the device ledger as
ACTIVATION until autograd drops them; the others leave for the host or NVMe while forward goes
on (:mod:`tiermem.transfer.activation_io`, NOTE [Activation lifecycle]) and come back while backward
walks the graph in reverse: unpacking record i starts the fetches of records i-1 ...
i-``window`` too, so they are on their way before backward needs them.

What moves is a storage, once per forward however many of its views autograd saves (q, k, v of
one projection); each view comes back with its own size, stride and offset, so backward sees the
same layouts, and the same numbers. Never moved, whatever the policy says: parameters and
buffers (and views of them: matmul saves ``weight.t()``), storages under
:data:`MIN_OFFLOAD_BYTES`, tensors with lazy conj/neg bits, tensor subclasses with a storage of
their own, and tensors on another device. Nothing is packed under ``torch.no_grad()`` or in eval
mode: TieredModel only tracks training forwards.

# NOTE [Wrapper subclasses]
A wrapper tensor subclass (DTensor, a float8 tensor, any ``__torch_dispatch__`` wrapper) has no
bytes of its own: they are in the plain tensors it wraps. One that says what those are
(``__tensor_flatten__``, as ``torch.compile`` requires) is placed through them: each inner
tensor is packed as any saved tensor (kept and counted, or offloaded; a weight's never moves),
and unpacking rebuilds the wrapper with its class's ``__tensor_unflatten__`` from the inner
tensors, its context and its outer size and stride. One that does not cannot be moved or
measured: it stays where it is, counted by class in ``tm.report().activations_unplaced``, and
when the policy asks to move it, a warning names the class once.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import uuid
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils.weak

from tiermem.errors import ConfigError, fmt_bytes
from tiermem.memory.aligned import ALIGN
from tiermem.plan.policy import Policy, checked_place
from tiermem.train.hooks import untraced
from tiermem.train.weights.offdevice import is_off_device
from tiermem.transfer.activation_io import ActivationMover, ActivationStats, Record, reserve_device, view_of
from tiermem.types import TensorClass, TensorInfo, Tier

log = logging.getLogger(__name__)

__all__ = ["ActivationOffloader", "ActivationStats", "MIN_OFFLOAD_BYTES", "PREFETCH_WINDOW"]

#: Saved tensors smaller than this stay on the device whatever the policy says: a pooled host
#: buffer takes at least a page, and moving a few bytes costs more than it frees.
MIN_OFFLOAD_BYTES = ALIGN
#: How many records saved just before the one backward unpacks are fetched ahead of it.
PREFETCH_WINDOW = 2


class _Pass:
    """The offloaded records of one forward, in the order they were saved."""

    __slots__ = ("records", "__weakref__")

    def __init__(self) -> None:
        self.records: list[Record] = []


class _Kept:
    """Packed form of a tensor left on the device: its bytes count until autograd drops it."""

    __slots__ = ("tensor", "ptr", "owner")

    def __init__(self, tensor: torch.Tensor, ptr: int, owner: "ActivationOffloader"):
        self.tensor, self.ptr, self.owner = tensor, ptr, owner

    def __del__(self) -> None:
        self.owner._unkeep(self.ptr)


class _Offloaded:
    """An offloaded storage, shared by the packed forms of its views; retires when they are all
    gone. Holds no reference to the device storage."""

    __slots__ = ("rec", "run", "mover", "__weakref__")

    def __init__(self, rec: Record, run: _Pass, mover: ActivationMover):
        self.rec, self.run, self.mover = rec, run, mover

    def __del__(self) -> None:
        self.mover.retire(self.rec)


class _View:
    """Packed form of an offloaded tensor: its storage's record and where it lay in it."""

    __slots__ = ("storage", "dtype", "size", "stride", "offset")

    def __init__(self, storage: _Offloaded, t: torch.Tensor):
        self.storage, self.dtype = storage, t.dtype
        self.size, self.stride, self.offset = tuple(t.shape), tuple(t.stride()), t.storage_offset()


class _Wrapped:
    """Packed form of a wrapper subclass (NOTE [Wrapper subclasses]): what its class's
    ``__tensor_unflatten__`` takes, with each inner tensor packed."""

    __slots__ = ("cls", "ctx", "inner", "size", "stride")

    def __init__(self, t: torch.Tensor, ctx: Any, inner: dict[str, Any]):
        self.cls, self.ctx, self.inner = type(t), ctx, inner
        self.size, self.stride = t.shape, t.stride()


def _flattens(t: torch.Tensor) -> bool:
    """A tensor subclass that says which plain tensors hold its bytes (NOTE [Wrapper subclasses])."""
    return type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__") and hasattr(t, "__tensor_unflatten__")


def _plain_parts(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """``t``, or the plain tensors a wrapper subclass holds, at any depth."""
    if not _flattens(t) or is_off_device(t):
        yield t
        return
    for name in t.__tensor_flatten__()[0]:  # type: ignore[attr-defined]  # a wrapper subclass (_flattens)
        yield from _plain_parts(getattr(t, name))


def _storage_ptr(t: torch.Tensor) -> Optional[int]:
    """Where ``t``'s storage lies, or None when it has none of its own (a wrapper subclass)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class ActivationOffloader:
    """Saved-tensor hooks for one module: account, offload and prefetch its activations.

    ``hooks`` (a :class:`~tiermem.train.hooks.HookSet`) receives the handles of the module hooks and
    this object, whose ``remove()`` stops it, so ``TieredModel.detach()`` removes them all.
    Weights homed off the device are saved as what they are, an
    :class:`~tiermem.train.weights.offdevice.OffDeviceWeight` with no bytes on the device (NOTE [Weights
    off the device are a tensor subclass]).
    """

    def __init__(
        self, module: torch.nn.Module, policy: Policy, stores: dict, engine, hooks, *, window: int = PREFETCH_WINDOW
    ):
        self.module, self.policy, self.stores = module, policy, stores
        self.window = window
        self.stats = ActivationStats()
        self.mover = ActivationMover(stores, engine, self.stats, f"activation-{uuid.uuid4().hex[:12]}")
        self.device = self.mover.device
        self._dev = stores[Tier.DEVICE].ledger
        self._lock = threading.RLock()  # kept tensors retire on autograd's threads, or in a GC pass
        self._ids = itertools.count()
        self._kept: dict[int, list] = {}  # storage pointer -> [packed references, ledger key]
        self._tiers: dict[tuple, Tier] = {}  # the policy is pure: what it was told -> its answer
        self._sent = torch.utils.weak.WeakIdKeyDictionary()  # device storage -> (version, its record)
        self._weights: set[Optional[int]] = set()
        self._warned: set[str] = set()  # wrapper classes the log has named (NOTE [Wrapper subclasses])
        self._stack: list[str] = []  # names of the modules whose forward is running, innermost last
        self._modules: dict[str, torch.nn.Module] = {}
        self._run: Optional[_Pass] = None
        self._active = False
        if policy.places_activations_by_module():  # NOTE [Module hooks and torch.compile]
            self._modules = dict(module.named_modules())
            for name, mod in self._modules.items():
                hooks.add(mod.register_forward_pre_hook(self._entering(name)))
                hooks.add(mod.register_forward_hook(self._leaving, always_call=True))
        hooks.add(self)

    # -- what TieredModel calls -----------------------------------------------------------------
    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Pack and unpack hooks for one training forward."""
        self.mover.flush()
        self._weights = {
            _storage_ptr(part)
            for t in itertools.chain(self.module.parameters(), self.module.buffers())
            for part in _plain_parts(t)
            if not is_off_device(part)
        } - {None}
        self._run, self._active = _Pass(), True
        try:
            with torch.autograd.graph.saved_tensors_hooks(*untraced(self._pack, self._unpack)):
                yield
        finally:
            self._active, self._run = False, None
            self._stack.clear()

    def release(self) -> None:
        """Backward has run: wait for what it retired to be freed, delete its NVMe files."""
        self.mover.settle()

    def remove(self) -> None:
        """Stop for good (``TieredModel.detach()``). Records still alive free their host buffers
        when they retire; their NVMe files go with the store's keys."""
        self.mover.closed = True

    # -- which module is running ----------------------------------------------------------------
    # NOTE [Module hooks and torch.compile]
    # The module of a saved activation is known only through a forward pre and post hook on every
    # module, so they are installed only for a policy that places activations by module
    # (``Policy.places_activations_by_module()``); the built-in ones do not, and a compiled
    # model under them runs with no tiermem hook in its forward but the saved-tensor hooks,
    # which see the tensors the compiled graph saves. Under ``torch.compile`` dynamo traces these
    # module hooks into the graph: they touch nothing but plain Python values (a flag, a list of
    # names), never a module object, whose mutation dynamo would have to track (storing the
    # module made it fail: "is already tracked for mutation"). A compiled region saves its
    # activations as one autograd function, so they are named after the compiled module
    # (``_orig_mod``), not the submodule that computed them.
    # Hooks that move weights, take locks or read data pointers (ParamOffload's) are marked
    # :func:`~tiermem.train.hooks.eager` instead: dynamo stops its graph there and they run as
    # plain Python; and TieredModel runs a compiled forward eagerly when weights live off the
    # device (NOTE [Parameters off the device]).
    def _entering(self, name: str) -> Callable:
        def pre_hook(mod: torch.nn.Module, args: Any) -> None:
            if self._active:
                self._stack.append(name)

        return pre_hook

    def _leaving(self, mod: torch.nn.Module, args: Any, output: Any) -> None:
        if self._active and self._stack:
            self._stack.pop()

    # -- pack and unpack ------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        self.stats.saved += 1
        return self._place(t)

    def _place(self, t: torch.Tensor) -> Any:
        # a weight homed off the device: backward reads it again through its home
        if is_off_device(t) or isinstance(t, torch.nn.Parameter):
            self.stats.weights += 1
            return t.detach()
        if _flattens(t):  # NOTE [Wrapper subclasses]
            names, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]  # _flattens(t)
            self.stats.wrapped += 1
            return _Wrapped(t, ctx, {n: self._place(getattr(t, n)) for n in names})
        ptr = _storage_ptr(t)
        if ptr is None:
            return self._unplaced(t)
        storage = t.untyped_storage()
        if self._is_weight(ptr):
            self.stats.weights += 1
            return t.detach()
        if t.device.type != self.device.type or self.device.index not in (None, t.device.index):
            return t.detach()
        nbytes = storage.nbytes()
        if (
            type(t) is torch.Tensor
            and t.layout is torch.strided
            and nbytes >= MIN_OFFLOAD_BYTES
            and not t.is_conj()
            and not t.is_neg()
        ):  # lazy conj/neg bits would not survive set_()
            sent = self._sent.get(storage)
            token = sent[1]() if sent is not None and sent[0] == t._version else None
            if token is not None and token.run is self._run:  # a view of a storage sent in this forward
                return _View(token, t)
            name = self._stack[-1] if self._stack else ""
            tier = self._tier(name, t, nbytes)
            if tier is not Tier.DEVICE:
                return _View(self._offload(storage, t._version, tier, name), t)
        return self._keep(t, ptr, nbytes)

    def _unplaced(self, t: torch.Tensor) -> torch.Tensor:
        """A wrapper subclass that does not flatten: left where it is, counted, and a policy that
        asks to move it told once (NOTE [Wrapper subclasses])."""
        cls = f"{type(t).__module__}.{type(t).__qualname__}"
        self.stats.unplaced[cls] += 1
        name = self._stack[-1] if self._stack else ""
        tier = self._tier(name, t, t.numel() * t.element_size())
        if tier is not Tier.DEVICE and cls not in self._warned:
            self._warned.add(cls)
            log.warning(
                "tiermem: activations of class %s stay on the device, though the policy places them on %s: "
                "a tensor subclass without __tensor_flatten__ cannot be moved or measured (counted in "
                "tm.report().activations_unplaced); give the class __tensor_flatten__/__tensor_unflatten__ "
                "to have them placed",
                cls,
                tier,
            )
        return t.detach()

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Kept):
            return packed.tensor
        if isinstance(packed, _Wrapped):  # NOTE [Wrapper subclasses]
            inner = {n: self._unpack(p) for n, p in packed.inner.items()}
            return packed.cls.__tensor_unflatten__(inner, packed.ctx, packed.size, packed.stride)  # type: ignore[attr-defined]
        rec, run = packed.storage.rec, packed.storage.run
        handle = self.mover.fetch(rec, ahead=False)
        assert handle is not None  # an unpacked record is not retired: fetched now, or already
        for j in range(rec.index - 1, max(rec.index - 1 - self.window, -1), -1):
            self.mover.fetch(run.records[j], ahead=True)  # what backward needs next, in reverse
        return view_of(self.mover.engine.join(handle), packed.dtype, packed.size, packed.stride, packed.offset)

    def _is_weight(self, ptr: int) -> bool:
        if ptr in self._weights:
            return True
        if self._stack:  # weights made resident during this forward (e.g. by another pre-hook)
            mod = self._modules[self._stack[-1]]
            for w in itertools.chain(mod._parameters.values(), mod._buffers.values()):
                if w is not None and any(
                    _storage_ptr(part) == ptr for part in _plain_parts(w) if not is_off_device(part)
                ):
                    return True
        return False

    def _tier(self, name: str, t: torch.Tensor, nbytes: int) -> Tier:
        key = (name, tuple(t.shape), t.dtype, nbytes)
        tier = self._tiers.get(key)
        if tier is None:
            info = TensorInfo(name, TensorClass.ACTIVATION, nbytes, tuple(t.shape), t.dtype, name)
            tier = checked_place(self.policy, info)
            if tier not in self.stores:
                raise ConfigError(
                    f"tiermem: the policy places an activation of module {name or '<root>'!r} "
                    f"({fmt_bytes(nbytes)}, shape {tuple(t.shape)}) on {tier}, but no {tier} store is "
                    f"configured; pass nvme_dir=... to TieredModel, or change the policy"
                )
            if len(self._tiers) > 4096:
                self._tiers.clear()
            self._tiers[key] = tier
        return tier

    def _offload(self, storage: torch.UntypedStorage, version: int, tier: Tier, name: str) -> _Offloaded:
        run = self._run
        assert run is not None, "pack outside track()"
        rec = self.mover.send(storage, tier, len(run.records), f"activation of {name or '<root>'!r}")
        run.records.append(rec)
        token = _Offloaded(rec, run, self.mover)
        self._sent[storage] = (version, weakref.ref(token))
        self.stats.offloaded[tier] += 1
        self.stats.offloaded_bytes[tier] += rec.nbytes
        self.stats.by_module[name] += 1
        return token

    def _keep(self, t: torch.Tensor, ptr: int, nbytes: int) -> _Kept:
        with self._lock:
            entry = self._kept.setdefault(ptr, [0, None])  # views of one storage count once
            entry[0] += 1
            key = None
            if entry[1] is None:
                key = entry[1] = f"<activation kept {next(self._ids)}>"
        if key is not None:  # outside the lock: a full ledger may reclaim, which may wait on lanes
            try:
                reserve_device(self._dev, key, nbytes, "activations saved for backward")
            except BaseException:
                self._unkeep(ptr)
                raise
        return _Kept(t.detach(), ptr, self)

    def _unkeep(self, ptr: int) -> None:
        with self._lock:
            entry = self._kept[ptr]
            entry[0] -= 1
            if entry[0] == 0:
                del self._kept[ptr]
                self._dev.release(entry[1])
