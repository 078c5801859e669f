"""``tm.optimizer``: the torch Optimizer face of a TieredModel, for lr schedulers."""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from tiermem.errors import TierMemError


def _weakly(fn: Callable) -> Callable[[], Callable | None]:
    """A bound method held weakly (NOTE [A dropped model lets go] in tiermem.model.lifetime): a
    scheduler that keeps this optimizer must not keep the whole model alive."""
    return weakref.WeakMethod(fn) if hasattr(fn, "__self__") else (lambda: fn)


# NOTE [Construction without dynamo]
# torch.optim.Optimizer.add_param_group is wrapped by ``torch._disable_dynamo``, which imports
# torch._dynamo (and torch._inductor with it) at its first call: ~1.8 CPU s in a process that
# builds a TieredModel and never compiles (each example run, each data-parallel rank). The
# constructor's calls are never traced, so they call the undecorated method, which functools.wraps
# keeps as ``__wrapped__``; where a torch lacks it, the decorated one.
_TORCH_ADD_PARAM_GROUP = getattr(
    torch.optim.Optimizer.add_param_group, "__wrapped__", torch.optim.Optimizer.add_param_group
)


class TieredOptimizer(torch.optim.Optimizer):
    """A torch Optimizer whose param groups (named, with their ``param_names``; NOTE [Param
    groups] in tiermem/config/specs.py) lr schedulers drive. ``step()`` runs the tiered step; gradients
    are cleared by it, so ``zero_grad()`` has nothing to do. ``add_param_group`` works as in
    torch, moving parameters that are in a group already. Checkpoint with ``tm.save()``."""

    def __init__(
        self,
        groups: list[dict],
        defaults: dict,
        step: Callable[[list[dict]], object],
        add_group: Callable[[list[dict], dict], None],
    ):
        self._run_step, self._add_group = _weakly(step), None
        super().__init__(groups, defaults)  # torch adds each group through add_param_group
        self._add_group = _weakly(add_group)

    def _model(self, call: Callable[[], Callable | None] | None) -> Callable:
        run = call() if call is not None else None
        if run is None:
            raise TierMemError(
                "tiermem: the TieredModel of this optimizer was dropped (nothing referenced it any "
                "more); keep a reference to the TieredModel while you train with its optimizer"
            )
        return run

    def step(self, closure=None):
        if closure is not None:
            raise TierMemError("tiermem: step(closure) is not supported; call tm.backward(loss) then tm.step()")
        return self._model(self._run_step)(self.param_groups)

    def add_param_group(self, param_group: dict) -> None:
        if self._add_group is None:  # torch's constructor, adding the plan's groups
            _TORCH_ADD_PARAM_GROUP(self, param_group)
            return
        self._model(self._add_group)(self.param_groups, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: tm.step() clears the gradients it consumed."""

    def state_dict(self):
        raise TierMemError(
            "tiermem: tm.optimizer holds no checkpointable state of its own; use "
            "tm.save(path) and tm.load(path), which include the optimizer state"
        )

    def load_state_dict(self, state_dict):
        self.state_dict()
