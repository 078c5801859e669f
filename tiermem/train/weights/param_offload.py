"""Parameters off the device (ZeRO-Infinity): real wherever they are read, resident only while used.

# NOTE [Parameters off the device]
Every parameter whose PARAM placement is HOST or NVME is registered with the residency scheduler
under its name, its working-precision copy stored at home, and becomes an
:class:`~tiermem.train.weights.offdevice.OffDeviceWeight` (NOTE [Weights off the device are a tensor
subclass]): every op that computes with it asks :class:`ParamOffload` for the real values.

Two ways in, one residency. A forward pre-hook of each module that owns such parameters acquires
them through the :class:`~tiermem.transfer.schedule.ResidencyScheduler` (which prefetches the next
ones in the order recorded during the first step and evicts by furthest next use), and a forward
hook releases them: while its module runs, a weight's ops find it resident at once. Any other read
(another module's code, autograd's backward formulas, a forward recomputed by checkpointing, user
code between steps) acquires the weight for that one op; those reads are recorded in the trace
like the module's, so the next step prefetches them, and the ones that still had to wait for a
fetch started on demand are counted (``tm.report().weights_on_demand``).

These hooks run as plain Python even in a ``torch.compile``d model
(:func:`~tiermem.train.hooks.eager`), and dynamo cannot trace the fetch inside an op either: a
compiled model with weights off the device runs its forward eagerly
(``torch.compiler.set_stance("force_eager")`` around ``tm(...)``; with ``overlap_step`` dynamo
falls back by itself, as the stance is process-wide and the step's compiled Adam runs meanwhile),
with the numbers of the uncompiled model.

The optimizer step writes the updated weights to their home tier, never to the device; device
copies still cached are dropped first (:meth:`begin_update`). ``tm.resident(...)`` holds weights
on the device for a block and lets user code write into them; what it wrote goes home when the
block ends (:meth:`resident`). ``detach()`` gives each parameter a plain tensor again
(:meth:`restore`); a model dropped without it leaves weights that raise a ``tiermem:`` error when
read, never a made-up value.

# NOTE [One copy of bf16 master weights]
With ``bf16_stochastic_round=True`` the optimizer keeps no fp32 master: its master is a bf16
tensor in the optimizer state, and the working weights (bf16 precision) hold exactly its values.
Where both rest on the same tier off the device, one parameter at a time (PARAM and OPTIM_STATE
on the host, or both on NVMe; not sharded over ranks, not with overlap_step, whose update rewrites
the master while the next forward reads the old weights: the rule is
:func:`tiermem.plan.placement.master_is_weights`), they are one copy:

- on the host, each weight's home is a view of the master in the optimizer state's buffer
  (``KeyedResidency.share``): the update writes the master in place, and the next fetch to the
  device reads the new value; the host counts the master's 2 bytes per parameter, once;
- on NVMe, the master's bytes are the weights' own keys: the bucket's state key holds the other
  parts only, and the state pipeline reads and writes the master through the weights' keys
  (:meth:`ParamOffload.read_master`, :meth:`ParamOffload.write_master`), so the disk holds 2 bytes
  per parameter of weights and the rest of the state (4.03 B/param with 8-bit moments, not 6.03).

Either way the update writes no separate weights (``from_master``: ``out=None``), so the numbers
are those of every other placement bit for bit (the same kernel, the same rounding keys), and
checkpoints, ``state_dict()`` and ``detach()`` read the master as before (on-disk checkpoints are
unchanged). A failed step on NVMe keeps a bucket whose new value landed only in part in memory
and writes it first at the retry (NOTE [A failed step is rolled forward]). Frozen weights solve
the same problem their way (NOTE [Frozen weights keep one copy] in tiermem/train/weights/frozen.py);
sharded chunks theirs (NOTE [A chunk rounded from its master] in tiermem/train/weights/weight_shards.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter, deque
from typing import Iterator, Optional, Sequence

import torch

from tiermem.handles import Handle, wait_all
from tiermem.plan.buckets import Bucket
from tiermem.plan.placement import master_is_weights
from tiermem.train.homes.update_runs import Runs, slots_in
from tiermem.train.hooks import HookSet
from tiermem.train.weights.offdevice_home import OffDeviceHome
from tiermem.transfer.residency import KeyedResidency
from tiermem.transfer.schedule import ResidencyScheduler
from tiermem.types import TensorClass, TensorInfo, Tier

log = logging.getLogger(__name__)


class ParamOffload(OffDeviceHome):
    """The PARAM home of weights that live on the host or NVMe: NOTE [Parameters off the device]."""

    lives = "lives off the device"

    def __init__(
        self,
        module: torch.nn.Module,
        homes: dict[str, Tier],
        residency: KeyedResidency,
        scheduler: ResidencyScheduler,
        dtype: torch.dtype,
        device: torch.device,
        hooks: HookSet,
        *,
        overlap: bool = False,
        host_in_place: bool = False,
    ):
        """``homes``: canonical parameter name -> home tier (HOST or NVME) of the parameters to
        offload; each one's first value arrives through :meth:`initialize` or :meth:`adopt`.
        ``residency``: where they are registered and stored; ``scheduler``: what brings them to
        the device, connected to that residency; ``overlap``: overlap_step (no weights are the
        master then: NOTE [One copy of bf16 master weights]); ``host_in_place``: the device is the
        host, and the weights homed there are read where they are (NOTE [Host weights read in
        place])."""
        self.residency, self.scheduler, self.dtype, self.device = residency, scheduler, dtype, device
        self.overlap = overlap
        self.homes = dict(homes)
        self._in_place = frozenset(n for n, t in homes.items() if t == Tier.HOST) if host_in_place else frozenset()
        params = dict(module.named_parameters())
        self._params = {name: params[name] for name in homes}
        self._initial: deque[list[Handle]] = deque()  # NOTE [Initial writes in flight]: per bucket
        self._running: dict[str, list] = {}  # key -> [its device tensor, holds]: acquired by a module or a block
        self.on_demand: Counter[str] = Counter()  # reads outside the schedule that waited for a fetch
        super().__init__(module, self._params, {name: name for name in homes}, hooks, unheld=self._in_place)
        scheduler.expect([n for n in params if n in homes and n not in self._in_place])  # the first forward's guess

    def adopt(self, name: str, value: torch.Tensor, *, shared: bool = False, wait: bool = True) -> Optional[Handle]:
        """``value`` (a host tensor in the working precision) becomes ``name``'s first value at
        home, and the parameter an :class:`OffDeviceWeight` of it from now on. ``shared``: its home
        is ``value`` itself, memory the host store counts already (NOTE [One copy of bf16 master
        weights]); else a copy of it. ``wait=False``: that copy's write may still be in flight: the
        handle returned (None: nothing in flight), and ``value`` stays unchanged until it is done."""
        if name in self._swaps:  # homed here already, frozen until now (NOTE [Freezing and unfreezing])
            if shared:
                self.residency.share(name, value)
            else:
                self.write_home(name, value)
            return None
        p = self._params[name]
        self.residency.register(
            TensorInfo(
                name,
                TensorClass.PARAM,
                value.numel() * value.element_size(),
                tuple(p.shape),
                value.dtype,
                name.rpartition(".")[0],
            ),
            self.homes[name],
        )
        handle = None
        if shared:
            self.residency.share(name, value)
        else:  # counted in tm.report() as moved; a read of the key waits for the write
            handle = self.residency.put(name, value, src_tier=Tier.HOST, wait=wait)
        if name in self._in_place:  # NOTE [Host weights read in place]
            self._swaps.rest_on(name, self.residency.home_value(name))
            return None
        self._swaps.swap_in(name, self._link, value.dtype, self.device)
        return handle

    def remove(self) -> None:
        """The model is detached or given back: nothing is read through it any more, and weights
        still being written home have landed (their errors stay on their handles)."""
        super().remove()
        self._swaps.cut_off(self._link, self.dtype, self.device)
        self.residency.synchronize()

    # -- as a WeightHome ---------------------------------------------------------------------------
    def initialize(self, b: Bucket, master: torch.Tensor) -> None:
        if self.from_master(b) and b.param_tier == Tier.HOST:  # `master` is the state's own buffer, for the run
            for s in b.slots:
                self.adopt(s.name, master[s.offset : s.offset + s.numel].view(s.shape), shared=True)
            return
        while len(self._initial) > 1:  # NOTE [Initial writes in flight]: two buckets' copies at most
            wait_all(self._initial.popleft())
        writes = []
        for s in b.slots:
            # a copy, even in fp32: `master` may be a pipeline buffer the next bucket reuses
            h = self.adopt(
                s.name, master[s.offset : s.offset + s.numel].view(s.shape).to(self.dtype, copy=True), wait=False
            )
            writes += [h] if h is not None else []
        self._initial.append(writes)

    def built(self) -> None:
        pending, self._initial = [h for hs in self._initial for h in hs], deque()
        wait_all(pending)

    def from_master(self, b: Bucket) -> bool:
        """NOTE [One copy of bf16 master weights]: ``b``'s weights are its master."""
        return master_is_weights(b, False, self.overlap)

    def read_master(self, b: Bucket, out: torch.Tensor) -> list[Handle]:
        """Start reading ``b``'s master, which its weights' keys hold, into ``out`` (flat, host)."""
        return [self.residency.read_home(s.name, out[s.offset : s.offset + s.numel]) for s in b.slots]

    def write_master(self, b: Bucket, src: torch.Tensor) -> list[Handle]:
        """Start writing ``b``'s master ``src`` (flat, host; unchanged until the handles are done)
        as its weights, the device copies dropped."""
        return self.write(b, src, [(0, b.numel, 0)], Tier.HOST)

    def write(self, b: Bucket, src: torch.Tensor, runs: Runs, src_tier: Tier) -> list[Handle]:
        """Updated weights go to their home tier, never to the device; overlaps Adam on the next
        bucket, like an upload. ``src`` in another dtype (an fp32 master) is rounded first."""
        return [
            self.write_home(s.name, src[s.offset : s.offset + s.numel].view(s.shape).to(self.dtype), wait=False)
            for s in slots_in(b, runs)
        ]

    # -- reads ---------------------------------------------------------------------------------------
    # NOTE [Host weights read in place]
    # When the device is the CPU, host memory is the device's memory: a weight homed on the host
    # needs no copy to be computed with. An inference-only model (NOTE [Inference only]) reads such
    # weights where they are: each one's parameter stays a plain tensor over its home's memory
    # (``SwappedParams.rest_on``), so ops run on it with no fetch, no device bytes, no hold by its
    # module's hooks and no OffDeviceWeight dispatch; only the weights homed on NVMe go through the
    # weights cache. Measured on the 220M Llama of bench/generate.py with every weight on the host and
    # a device budget of a quarter of them: each token copied every weight from the host tier to the
    # device tier (6.3 tokens/s against 27.1 in memory, bench/RESULTS.md 2026-12-07). A write into such
    # a parameter (inside ``tm.resident(...)``) writes its home. ``detach()`` hands each one a copy of
    # its value, and a model dropped without it turns them into OffDeviceWeights that refuse reads
    # (``SwappedParams.cut_off``): the home's memory may hold another tensor by then. Training keeps
    # the copy: its step rewrites the weights at home (with overlap_step while the next forward
    # reads them).
    def _hold(self, key: str) -> torch.Tensor:
        """Acquire ``key`` for a module or a block: its ops find it resident until :meth:`_unhold`."""
        with self._lock:
            entry = self._running.get(key)
            if entry is not None:
                entry[1] += 1
                return entry[0]
        if key in self._in_place:  # NOTE [Host weights read in place]: nothing to fetch or release
            with self._lock:
                entry = self._running.setdefault(key, [self.residency.home_value(key), 0])
                entry[1] += 1
                return entry[0]
        t = self.scheduler.acquire(key)
        with self._lock:
            entry = self._running.setdefault(key, [t, 0])
            entry[1] += 1
            if entry[0] is not t:  # held meanwhile by another thread: one acquire is enough
                self.scheduler.release(key)
            return entry[0]

    def _unhold(self, key: str) -> None:
        with self._lock:
            entry = self._running[key]
            entry[1] -= 1
            if entry[1]:
                return
            del self._running[key]
        if key not in self._in_place:
            self.scheduler.release(key)

    @contextlib.contextmanager
    def holding(self, keys: Sequence[str], reader: str) -> Iterator[list[torch.Tensor]]:
        """The device tensors of ``keys`` for one op (NOTE [Weights off the device are a tensor
        subclass]): held already by a running module or block, or acquired for the op."""
        reals, taken = [], []
        try:
            for key in keys:
                with self._lock:
                    entry = self._running.get(key)
                    if entry is not None:
                        reals.append(entry[0])
                        continue
                reals.append(self.scheduler.acquire(key, on_demand=self.on_demand))
                taken.append(key)
            yield reals
        finally:
            for key in taken:
                self.scheduler.release(key)

    def _send_home(self, dirty: list[str], written: dict[str, torch.Tensor]) -> None:
        for key in dirty:
            value = self._running[key][0].to("cpu", copy=True)
            self.write_home(key, value)  # drops the device copy: the next read fetches the new value
            written[key] = value

    # -- the step ----------------------------------------------------------------------------------
    def begin_update(self) -> None:
        """Before new weights are written home: device copies are about to be stale."""
        self.scheduler.evict_all()

    def write_home(self, key: str, value: torch.Tensor, *, wait: bool = True) -> Handle:
        """Store the updated working-precision weights of ``key`` (a host tensor) at its home
        tier; with ``wait=False``, keep ``value`` unchanged until the handle is done."""
        return self.residency.put(key, value, src_tier=Tier.HOST, wait=wait)

    def end_update(self) -> None:
        self.scheduler.end_iteration()  # freezes the trace, prefetches the next step's first weights
