"""``tm.optimizer``: the torch Optimizer face of a TieredModel, for lr schedulers."""
from __future__ import annotations

import weakref
from typing import Callable

import torch

from tiermem.config import _AdamSpec
from tiermem.errors import TierMemError
from tiermem.train.layout import Layout


class TieredOptimizer(torch.optim.Optimizer):
    """A torch Optimizer whose param groups (fp32 master weights and hyperparameters) lr
    schedulers can drive. ``step()`` runs the tiered step; gradients are cleared by it, so
    ``zero_grad()`` has nothing to do. Checkpoint with ``tm.save()``."""

    def __init__(self, layout: Layout, spec: _AdamSpec, step: Callable[[list[dict]], object]):
        masters = {s.name: layout.homes.state[b.index].master(b, s) for b in layout.buckets for s in b.slots}
        if not masters:
            raise TierMemError("tiermem: the module has no trainable parameters (requires_grad=True); "
                               "unfreeze some before wrapping it")
        groups = [{"params": [masters[n] for n in g.params], "param_names": list(g.params),
                   **spec.group_defaults(), **g.options}  # NOTE [Param groups]: the group's own over the spec's
                  for g in layout.groups]
        super().__init__(groups, spec.group_defaults())
        # weakly: a scheduler that keeps this optimizer must not keep the whole model alive
        # (NOTE [A dropped model lets go] in tiermem.train.lifetime)
        self._run_step = weakref.WeakMethod(step) if hasattr(step, "__self__") else (lambda: step)

    def step(self, closure=None):  # type: ignore[override]
        if closure is not None:
            raise TierMemError("tiermem: step(closure) is not supported; call tm.backward(loss) then tm.step()")
        run = self._run_step()
        if run is None:
            raise TierMemError("tiermem: the TieredModel of this optimizer was dropped (nothing referenced it any "
                               "more); keep a reference to the TieredModel while you train with its optimizer")
        return run(self.param_groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: tm.step() clears the gradients it consumed."""

    def state_dict(self):  # type: ignore[override]
        raise TierMemError("tiermem: tm.optimizer holds no checkpointable state of its own; use "
                           "tm.save(path) and tm.load(path), which include the optimizer state")

    def load_state_dict(self, state_dict) -> None:  # type: ignore[override]
        self.state_dict()
