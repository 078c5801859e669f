"""What the two homes of off-device weights share: :class:`OffDeviceHome`.

:class:`~tiermem.train.weights.param_offload.ParamOffload` (weights on the host or NVMe in one
process: NOTE [Parameters off the device]) and
:class:`~tiermem.train.weights.gathered.GatheredWeights` (weights sharded over the ranks: NOTE
[Weights sharded over the ranks]) are both the source of their parameters' values (NOTE [Weights
off the device are a tensor subclass]). Both swap those parameters for OffDeviceWeights, hold what
a module's weights need while its forward runs, refuse a write into a weight outside
``tm.resident(...)`` and, inside one, send what was written home when the block ends. They differ
in what they hold for a weight (the weight itself; its whole bucket, gathered) and in how it
reaches the device and goes home: the methods each supplies.
"""

from __future__ import annotations

import contextlib
import threading
from abc import abstractmethod
from collections import Counter
from typing import Collection, ContextManager, Iterator, Sequence

import torch

from tiermem.errors import TierMemError
from tiermem.train.homes.weight_homes import WeightHome
from tiermem.train.hooks import HookSet, eager
from tiermem.train.weights.offdevice import Link, SwappedParams


class OffDeviceHome(WeightHome):
    """The PARAM home of weights off the device, and the source of their values. ``params``: name
    -> parameter of each weight it homes; ``units``: name -> what is held for it (its own name, or
    its bucket's key); the modules owning such parameters get hooks in ``hooks`` that hold their
    units while their forward runs."""

    #: where a weight of this home lives, and where to write it, for the refusal of a write
    lives: str
    write_where: str = ""

    def __init__(
        self,
        module: torch.nn.Module,
        params: dict[str, torch.nn.Parameter],
        units: dict[str, str],
        hooks: HookSet,
        *,
        unheld: Collection[str] = (),
    ):
        """``unheld``: units no module holds while it runs (weights read where they rest, NOTE [Host
        weights read in place]): their modules get no hooks for them."""
        self._swaps = SwappedParams(module, params)
        self._link = Link(self)
        self._unit = dict(units)
        self._lock = threading.RLock()  # reads come from autograd's threads too
        self._writable: Counter[str] = Counter()  # keys user code may write into (inside tm.resident)
        self._dirty: set[str] = set()
        owned = {id(p): units[name] for name, p in params.items() if units[name] not in unheld}
        self.owners: dict[torch.nn.Module, list[str]] = {}
        self._holding: dict[torch.nn.Module, list[list[str]]] = {}  # module -> what each running call holds
        for mod in module.modules():
            mine = list(dict.fromkeys(owned[id(p)] for p in mod.parameters(recurse=False) if id(p) in owned))
            if mine:
                self.owners[mod] = mine
                hooks.add(mod.register_forward_pre_hook(eager(self._before)))
                hooks.add(mod.register_forward_hook(eager(self._after), always_call=True))  # also when forward raises
        hooks.add(self)  # remove(): reads after the model is given back fail clearly

    # -- what each home supplies -------------------------------------------------------------------
    @abstractmethod
    def _hold(self, unit: str) -> object:
        """Make ``unit`` resident on the device and keep it so until :meth:`_unhold`."""

    @abstractmethod
    def _unhold(self, unit: str) -> None:
        """One hold of ``unit`` ends."""

    @abstractmethod
    def holding(self, keys: Sequence[str], reader: str) -> ContextManager[Sequence[torch.Tensor]]:
        """The device tensors of ``keys`` (each a whole weight) for one op: held already, or held
        for the op (a :class:`~tiermem.train.weights.offdevice.WeightSource`)."""

    @abstractmethod
    def _send_home(self, dirty: list[str], written: dict[str, torch.Tensor]) -> None:
        """The weights ``dirty``, written inside ``tm.resident(...)`` and held still, go home; each
        one's new value (a host copy) into ``written``."""

    # -- module hooks --------------------------------------------------------------------------------
    def _before(self, mod: torch.nn.Module, args) -> None:
        taken: list[str] = []
        self._holding.setdefault(mod, []).append(taken)
        for unit in self.owners[mod]:
            self._hold(unit)
            taken.append(unit)

    def _after(self, mod: torch.nn.Module, args, out) -> None:
        stack = self._holding.get(mod)
        for unit in stack.pop() if stack else []:
            self._unhold(unit)

    # -- writes ----------------------------------------------------------------------------------------
    def written(self, key: str, op: str) -> None:
        """An op writes into ``key``: allowed inside ``tm.resident(...)`` only."""
        with self._lock:
            if self._writable[key]:
                self._dirty.add(key)
                return
        raise TierMemError(
            f"tiermem: {op} writes into the weight {key!r}, which {self.lives}; write to it inside "
            f"`with tm.resident(...)`{self.write_where}, which sends the new values home and to the "
            f"optimizer's master weights"
        )

    @contextlib.contextmanager
    def resident(self, names: Sequence[str]) -> Iterator[dict[str, torch.Tensor]]:
        """Hold ``names`` on the device for a block in which they may be written; yields the written
        ones' new values (host copies, filled in when the block ends), whose home has them."""
        held: list[str] = []
        written: dict[str, torch.Tensor] = {}
        marked: list[str] = []
        try:
            for unit in dict.fromkeys(self._unit[n] for n in names):
                self._hold(unit)
                held.append(unit)
            with self._lock:
                for name in names:
                    self._writable[name] += 1
                    marked.append(name)
            yield written
            with self._lock:
                dirty = [n for n in names if n in self._dirty]
            self._send_home(dirty, written)
        finally:
            with self._lock:
                for name in marked:
                    self._writable[name] -= 1
                    if not self._writable[name]:
                        del self._writable[name]
                        self._dirty.discard(name)
            for unit in held:
                self._unhold(unit)

    # -- the parameters ------------------------------------------------------------------------------
    def settle(self) -> None:
        """Construction succeeded: the original tensors swapped out of the parameters are let go."""
        self._swaps.settle()

    def undo(self) -> None:
        """Construction failed: every parameter gets back the tensor it had (before :meth:`settle`)."""
        self._swaps.undo()

    def restore(self, values: dict[str, torch.Tensor]) -> None:
        """``detach()``: each parameter becomes a plain tensor again, holding ``values[name]``."""
        self._swaps.restore(values)

    def remove(self) -> None:
        """The model is detached or given back: its weights' reads fail clearly from now on."""
        self._link.source = None
