"""What a save, ``state_dict()``, ``save_pretrained()`` and ``detach()`` read out of a TieredModel:
:class:`StateReader`. Every tensor is named by parameter (:class:`tiermem.checkpoint.names.StateName`),
never by bucket, and reached through the homes (NOTE [Homes]): optimizer state on NVMe passes
through one host buffer set at a time, so it never has to fit in memory. Nothing here changes the
model.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator, Optional

import torch

from tiermem.checkpoint.names import BUFFERS, FROZEN, StateName
from tiermem.checkpoint.view.core import HYPER, StateCore
from tiermem.optim.formats import StatePart
from tiermem.plan.buckets import Bucket


class StateReader:
    """The model's state read out, by checkpoint name; each view valid until the next read, then :meth:`release`."""

    def __init__(self, core: StateCore):
        self.core = core
        self._frozen_release: Callable[[], None] | None = None  # frees the frozen chunk :meth:`read_frozen` gave

    def release(self) -> None:
        """Done reading: whole-bucket buffers kept for that go, and the frozen chunk last read."""
        self.core.release_views()
        self._drop_frozen()

    def _drop_frozen(self) -> None:
        release, self._frozen_release = self._frozen_release, None
        if release is not None:
            release()

    def _bucket_state(self) -> Iterator[tuple[Bucket, tuple[torch.Tensor, ...]]]:
        """(bucket, its state's parts), each valid until the next item."""
        layout = self.core.layout
        try:
            for b in layout.buckets:
                yield b, layout.homes.state[b.index].read(b)
        finally:
            self.release()

    def _bucket_masters(self) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """(bucket, its master), each valid until the next item: the moments are not read."""
        layout = self.core.layout
        homes = layout.homes.state
        try:
            for home, run in itertools.groupby(layout.buckets, key=lambda b: homes[b.index]):
                yield from home.read_masters(list(run))  # a disk home reads the next bucket meanwhile
        finally:
            self.release()

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor a checkpoint holds, by name; each valid until the next."""
        for b, state in self._bucket_state():
            for i, part in enumerate(b.state.parts):
                for j, s in enumerate(b.slots):
                    yield str(StateName(part.name, s.name)), _shaped(b.pieces(state, j)[i], part, s.shape)
        frozen = self.core.layout.frozen
        for name in frozen:
            yield str(StateName(FROZEN, name)), frozen.value(name)
        for name, t in self.core.module.named_buffers():
            yield str(StateName(BUFFERS, name)), t

    def meta(self) -> dict:
        core = self.core
        return {
            "precision": core.precision,
            "step": core.stepper.steps,
            "param_step": core.stepper.param_steps(),
            "scaler": core.scaler.state_dict(),
            "groups": [
                {**{k: g[k] for k in HYPER if k in g}, "name": g["name"], "params": list(g["param_names"])}
                for g in core.param_groups
            ],
        }

    def rest(self, *, pieces: bool = False) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint holds besides the optimizer state, by name: ``frozen/<param>``
        in the parameter's own dtype (NOTE [Frozen weights keep one copy]: its copy, or its
        working copy read from home), ``buffers/<buffer>`` the module's. With ``pieces``, the
        frozen parameters sharded over the ranks are left out: the caller reads them as
        :meth:`StateCore.frozen_pieces` (NOTE [Frozen weights sharded over the ranks]); without,
        reading them gathers (collective)."""
        frozen = self.core.layout.frozen
        out = {str(StateName(FROZEN, n)): frozen.value(n) for n in self.core.whole_frozen(pieces=pieces)}
        out.update((str(StateName(BUFFERS, name)), t) for name, t in self.core.module.named_buffers())
        return out

    # -- weights, as the module names them ---------------------------------------------------------------
    def fp32_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter name (tied aliases included) -> a CPU copy of its fp32 value."""
        return {alias: value for names, value in self.stream_weights() for alias in names}

    def stream_weights(
        self,
        *,
        frozen: bool = True,
        dtype: torch.dtype = torch.float32,
        alloc: Optional[Callable[[torch.Size, torch.dtype], torch.Tensor]] = None,
    ) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
        """Each parameter's names (tied aliases included, the module's own name first) and a CPU copy of
        its value, the master rounded to ``dtype`` (default fp32: exact; frozen ones in their own dtype;
        ``frozen=False``: trained ones only), one at a time, bucket by bucket: what a caller does not
        keep is all the memory it costs (NOTE [Weights read one tensor at a time]). ``alloc(shape,
        dtype)``: where each copy goes (default: a new tensor)."""
        layout = self.core.layout
        for b, master in self._bucket_masters():
            for s in b.slots:
                value = master[s.offset : s.offset + s.numel].view(s.shape).detach()
                out = alloc(s.shape, dtype) if alloc is not None else torch.empty(s.shape, dtype=dtype)
                yield layout.names[id(s.param)], out.copy_(value)
        if not frozen:
            return
        params = dict(self.core.module.named_parameters())
        for name in layout.frozen:
            yield layout.names[id(params[name])], layout.frozen.value(name, own=True)

    def buffer_values(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The buffers ``module.state_dict()`` holds (persistent ones), in their original dtypes."""
        module = self.core.module
        kept, params = self.core.layout.buffers, {n for n, _ in module.named_parameters(remove_duplicate=False)}
        for k, v in module.state_dict().items():
            if k not in params:
                yield k, kept.value(k, v)

    def module_state(self) -> dict[str, torch.Tensor]:
        """``module.state_dict()``'s keys: fp32 weights, buffers in their original dtypes."""
        weights = self.fp32_weights()
        kept = self.core.layout.buffers  # NOTE [Buffers keep their values]
        return {k: weights[k] if k in weights else kept.value(k, v) for k, v in self.core.module.state_dict().items()}

    # -- this process's part of the state (a sharded checkpoint) ----------------------------------------
    def resident(self, index: int) -> bool:
        """Whether :meth:`read_local` of bucket ``index`` gives the live state, not a staging copy."""
        return self.core.layout.homes.state[index].resident

    def read_local(self, index: int) -> tuple[torch.Tensor, ...]:
        """This process's part of bucket ``index``'s state (each part of its format), no
        communication; valid until the next read (then :meth:`release`)."""
        return self.core.layout.homes.state[index].read_local(self.core.bucket(index))

    def read_frozen(self, index: int) -> torch.Tensor:
        """This process's chunk of frozen bucket ``index`` as it rests at home; no communication;
        valid until the next read (then :meth:`release`)."""
        self._drop_frozen()
        chunk, self._frozen_release = self.core.layout.frozen.read_local(index)
        return chunk


def _shaped(t: torch.Tensor, part: StatePart, shape: torch.Size) -> torch.Tensor:
    """A parameter's piece of a part as a checkpoint holds it: the parameter's shape for an
    elementwise part, flat for a blocked one (one value per block) or a factored one (one per row
    or column)."""
    return t.view(shape) if part.elementwise else t
