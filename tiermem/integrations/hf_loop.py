"""What the Hugging Face Trainer's loop holds in place of its optimizer and its model while a
:class:`tiermem.TieredModel` trains (NOTE [Trainer integration] in
``tiermem.integrations.transformers``): :class:`TrainerOptimizer` (``tm.optimizer`` as a torch
Optimizer), :class:`SkipAwareOptimizer` (it, as accelerate's prepared optimizer) and
:class:`TrainerModule` (the loop's ``model_wrapped``)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from accelerate.optimizer import AcceleratedOptimizer
from transformers.trainer import OPTIMIZER_NAME

from tiermem.errors import TierMemError
from tiermem.model.tiered_model import StepResult, TieredModel

__all__ = ["TrainerOptimizer", "SkipAwareOptimizer", "TrainerModule", "TIERMEM_CHECKPOINT"]

#: tiermem's checkpoint inside each checkpoint-N/ folder
TIERMEM_CHECKPOINT = "tiermem.ckpt"
_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "initial_lr")


class TrainerOptimizer(torch.optim.Optimizer):
    """``tm.optimizer`` as the Trainer handles optimizers: the same param groups (list and
    dicts), ``step()`` runs ``tm.step()`` and keeps its :class:`StepResult` in ``last``, and a
    ``state_dict()`` of hyperparameters and step count only (the state itself is in
    ``tiermem.ckpt``; NOTE [Trainer integration])."""

    def __init__(self, tiered: TieredModel):
        self.tiered: Optional[TieredModel] = None
        super().__init__(tiered.optimizer.param_groups, tiered.optimizer.defaults)
        self.param_groups = tiered.optimizer.param_groups  # one list: what a scheduler sets, tiermem uses
        self.tiered = tiered
        self.last: Optional[StepResult] = None

    def add_param_group(self, param_group: dict) -> None:
        """As ``tm.optimizer.add_param_group`` (torch's constructor adds the groups it shows first)."""
        if self.tiered is None:
            super().add_param_group(param_group)
        else:
            self.tiered.optimizer.add_param_group(param_group)

    @property
    def _tiered(self) -> TieredModel:
        assert self.tiered is not None  # set at the end of __init__ (torch's constructor runs before)
        return self.tiered

    def step(self, closure=None):
        if closure is not None:
            raise TierMemError("tiermem: step(closure) is not supported; the TieredTrainer calls step() itself")
        self.last = self._tiered.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: tm.step() clears the gradients it consumed."""

    def state_dict(self) -> dict:
        return {
            "state": {},
            "tiermem_step": self._tiered.stepper.steps,
            "param_groups": [{k: g[k] for k in _GROUP_KEYS if k in g} for g in self.param_groups],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the groups' hyperparameters (the lr the scheduler had set), after checking that
        the state is of the step tiermem's checkpoint holds."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(groups, list) or "tiermem_step" not in state_dict or len(groups) != len(self.param_groups):
            raise TierMemError(
                "tiermem: this optimizer state was not written by a TieredTrainer (or by one with "
                "another model); resume from a checkpoint a TieredTrainer saved"
            )
        if state_dict["tiermem_step"] != self._tiered.stepper.steps:
            raise TierMemError(
                f"tiermem: the checkpoint's {OPTIMIZER_NAME} is of step {state_dict['tiermem_step']} "
                f"but its {TIERMEM_CHECKPOINT} of step {self._tiered.stepper.steps}: the folder mixes "
                f"two saves; resume from another checkpoint"
            )
        for group, saved in zip(self.param_groups, groups):
            group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items() if k in _GROUP_KEYS})


class SkipAwareOptimizer(AcceleratedOptimizer):
    """The :class:`TrainerOptimizer` as accelerate's prepared optimizer: ``step_was_skipped``
    (what ``Accelerator.optimizer_step_was_skipped`` reads, and the Trainer consults before it
    steps the lr scheduler) is tiermem's own verdict on the last step, as it is the GradScaler's
    under the Trainer's fp16 (NOTE [Trainer integration])."""

    def __init__(self, optimizer: TrainerOptimizer):
        super().__init__(optimizer, device_placement=False, scaler=None)  # tiermem placed the state; no scaler
        self._is_accelerate_prepared = True  # accelerate's own mark: prepare() keeps this wrapper as it is

    @property
    def step_was_skipped(self) -> bool:
        last = self.optimizer.last
        return last is not None and last.skipped


class TrainerModule(torch.nn.Module):
    """The model the Trainer's loop holds (its ``model_wrapped``) while a TieredModel trains:
    accelerate wraps no DDP around it (tiermem reduces the gradients itself), its ``no_sync()``,
    which the Trainer enters on the micro-batches before the last of a step, is ``tm.no_sync()``,
    and its ``zero_grad()`` is nothing (``tm.step()`` cleared the grads it consumed)."""

    tiered: TieredModel

    def __init__(self, tiered: TieredModel):
        super().__init__()
        object.__setattr__(self, "tiered", tiered)  # not a submodule: no parameters for anyone to wrap

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.tiered(*args, **kwargs)

    def no_sync(self):
        return self.tiered.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: tm.step() clears the gradients it consumed."""

    def train(self, mode: bool = True) -> "TrainerModule":
        self.tiered.train(mode)
        return super().train(mode)
