"""Parameters homed off the device (ZeRO-Infinity): resident only while their module runs.

# NOTE [Parameters off the device]
Every parameter whose PARAM placement is HOST or NVME is registered with the engine under its
name, its working-precision copy stored at home. Between uses its ``.data`` is a placeholder of
the right shape that costs one element (NaN, so a use outside its module is loud, not silent).
A forward pre-hook of each module that owns such parameters acquires them through the
:class:`~tiermem.transfer.schedule.ResidencyScheduler` (which prefetches the next ones in the order
recorded during the first step and evicts by furthest next use), and a forward hook puts the
placeholder back and releases them. These hooks, and the watch on a forward's ops for weights
read outside their module, run as plain Python even in a ``torch.compile``d model
(:func:`~tiermem.train.hooks.eager`): traced, they would run once at compile time, and the graph
would compute with the placeholder. So a compiled model with weights off the device runs its
forward eagerly (``torch.compiler.set_stance("force_eager")`` around ``tm(...)``; with
``overlap_step`` dynamo falls back by itself at the eager hooks, as the stance is process-wide and
the step's compiled Adam runs meanwhile), with the numbers of the uncompiled model.

Backward needs weights again: when autograd saves a tensor that lives in an acquired
parameter's storage (the weight, or a view such as ``weight.t()``), the saved-tensor pack hook
keeps only a reference (key, size, stride, offset); unpacking acquires the parameter again —
in reverse order, which the trace knows — and rebuilds the view. The optimizer step writes the
updated weights to their home tier, never to the device.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

from tiermem.handles import Handle
from tiermem.plan.buckets import Bucket
from tiermem.train.homes import Runs, WeightHome, slots_in
from tiermem.train.hooks import HookSet, eager
from tiermem.transfer.schedule import ResidencyScheduler
from tiermem.types import TensorClass, TensorInfo, Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParamRef:
    """What autograd keeps instead of an offloaded parameter's tensor."""

    key: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class ParamOffload(WeightHome):
    """The PARAM home of weights that live on the host or NVMe: NOTE [Parameters off the device]."""

    def __init__(self, module: torch.nn.Module, homes: dict[str, Tier],
                 engine, scheduler: ResidencyScheduler, dtype: torch.dtype, device: torch.device, hooks: HookSet):
        """``homes``: canonical parameter name -> home tier (HOST or NVME) of the parameters to
        offload; each one's first value arrives through :meth:`initialize` or :meth:`adopt`."""
        self.engine, self.scheduler, self.dtype, self.device = engine, scheduler, dtype, device
        self.homes = dict(homes)
        params = dict(module.named_parameters())
        self.keys: dict[int, str] = {id(params[name]): name for name in homes}  # id(param) -> key
        self._params = {name: params[name] for name in homes}
        self._placeholders: dict[str, torch.Tensor] = {}
        self._live: dict[int, str] = {}  # storage address of an acquired parameter -> key
        self._by_placeholder: dict[int, str] = {}  # a placeholder's address -> key
        self.owners: dict[torch.nn.Module, list[tuple[torch.nn.Parameter, str]]] = {}
        for mod in module.modules():
            mine = [(p, self.keys[id(p)]) for p in mod.parameters(recurse=False) if id(p) in self.keys]
            if mine:
                self.owners[mod] = mine
                hooks.add(mod.register_forward_pre_hook(eager(self._before)))
                hooks.add(mod.register_forward_hook(eager(self._after), always_call=True))  # also when forward raises

    def adopt(self, name: str, value: torch.Tensor) -> None:
        """``value`` (a host tensor in the working precision) becomes ``name``'s first value at
        home; the parameter holds a NaN placeholder from now on."""
        p = self._params[name]
        self.engine.register(TensorInfo(name, TensorClass.PARAM, value.numel() * value.element_size(),
                                        tuple(p.shape), value.dtype, name.rpartition(".")[0]), self.homes[name])
        self.engine.put(name, value)
        nan = torch.full((), float("nan"), dtype=value.dtype, device=self.device)
        self._placeholders[name] = nan.expand(p.shape)
        self._by_placeholder[nan.data_ptr()] = name
        p.data = self._placeholders[name]

    # -- as a WeightHome ---------------------------------------------------------------------------
    def initialize(self, b: Bucket, master: torch.Tensor) -> None:
        for s in b.slots:
            # a copy, even in fp32: `master` may be a pipeline buffer the next bucket reuses
            self.adopt(s.name, master[s.offset:s.offset + s.numel].view(s.shape).to(self.dtype, copy=True))

    def write(self, b: Bucket, src: torch.Tensor, runs: Runs, src_tier: Tier) -> list[Handle]:
        """Updated weights go to their home tier, never to the device; overlaps Adam on the next
        bucket, like an upload. ``src`` in another dtype (an fp32 master) is rounded first."""
        return [self.write_home(s.name, src[s.offset:s.offset + s.numel].view(s.shape).to(self.dtype), wait=False)
                for s in slots_in(b, runs)]

    # -- forward -----------------------------------------------------------------------------------
    def _before(self, mod: torch.nn.Module, args) -> None:
        for _, key in self.owners[mod]:
            self.borrow(key)

    def _after(self, mod: torch.nn.Module, args, out) -> None:
        for _, key in self.owners[mod]:
            self.give_back(key)

    # -- weights read outside their own module ------------------------------------------------------
    def borrowing(self) -> "_Borrowing":
        """Around a forward: an op that reads an off-device weight outside its own module (a head
        computing ``F.linear(x, self.wte.weight)``) makes it resident first, until the forward
        ends, instead of computing with the NaN placeholder."""
        return _Borrowing(self)

    def key_of_placeholder(self, t: torch.Tensor) -> Optional[str]:
        return self._by_placeholder.get(t.data_ptr()) if t.numel() else None

    def borrow(self, key: str) -> None:
        """Make ``key`` resident in its parameter (its module runs, or another reads it)."""
        t = self.scheduler.acquire(key)
        self._live[t.untyped_storage().data_ptr()] = key
        self._params[key].data = t

    def give_back(self, key: str) -> None:
        """The placeholder back in ``key``'s parameter; the scheduler may evict its device copy."""
        p = self._params[key]
        t = p.data
        p.data = self._placeholders[key]
        self._live.pop(t.untyped_storage().data_ptr(), None)
        self.scheduler.release(key)

    # -- saved tensors -------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Optional[ParamRef]:
        """A reference in place of ``t`` if it lives in an acquired parameter's storage."""
        key = self._live.get(t.untyped_storage().data_ptr())
        if key is None:
            return None
        return ParamRef(key, tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def unpack(self, ref: ParamRef) -> torch.Tensor:
        t = self.scheduler.acquire(ref.key)
        try:
            return t.as_strided(ref.size, ref.stride, ref.offset)  # keeps the storage alive for autograd
        finally:
            self.scheduler.release(ref.key)

    # -- the step ----------------------------------------------------------------------------------
    def begin_update(self) -> None:
        """Before new weights are written home: device copies are about to be stale."""
        self.scheduler.evict_all()

    def write_home(self, key: str, value: torch.Tensor, *, wait: bool = True) -> Handle:
        """Store the updated working-precision weights of ``key`` (a host tensor) at its home
        tier; with ``wait=False``, keep ``value`` unchanged until the handle is done."""
        return self.engine.put(key, value, src_tier=Tier.HOST, wait=wait)

    def end_update(self) -> None:
        self.scheduler.end_iteration()  # freezes the trace, prefetches the next step's first weights


#: tensor methods and properties that read no values: a placeholder may answer them
_METADATA = frozenset({"__get__", "__set__", "untyped_storage", "data_ptr", "storage_offset", "stride", "size",
                       "dim", "numel", "element_size", "is_floating_point", "is_contiguous", "__repr__",
                       "__format__", "__len__", "__hash__", "_is_view", "is_complex",
                       "register_hook", "requires_grad_", "get_device", "nbytes", "itemsize"})


class _Borrowing(TorchFunctionMode):
    """NOTE [Parameters off the device]: the ops of a forward, watched for placeholders."""

    def __init__(self, offload: ParamOffload):
        super().__init__()
        self.offload, self.borrowed = offload, []

    @eager
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _METADATA:  # asks about the tensor, computes nothing with it
            return func(*args, **kwargs)
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.Tensor):
                    key = self.offload.key_of_placeholder(t)
                    if key is not None:
                        self.offload.borrow(key)
                        self.borrowed.append(key)
        return func(*args, **kwargs)

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)  # first: giving back sets .data, which this mode would watch
        while self.borrowed:
            self.offload.give_back(self.borrowed.pop())
