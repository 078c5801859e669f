"""``CPUAdagrad``: a drop-in ``torch.optim.Adagrad`` on tiermem's fused CPU kernel (tiermem/optim/dropin/shared.py)."""

from __future__ import annotations

from typing import Any

import torch

from tiermem.errors import checked_arguments
from tiermem.optim.dropin.hyper_table import Hyper, lr
from tiermem.optim.dropin.shared import CPUOptimizer, Plan
from tiermem.optim.hypers import AdagradHyper
from tiermem.optim.kernels import dispatch as _run


@checked_arguments
class CPUAdagrad(CPUOptimizer):
    """torch.optim.Adagrad (lr decay, weight decay, initial accumulator, maximize), one fused pass per
    tensor. State: ``sum`` and ``step``.

    Args:
        lr: learning rate.
        lr_decay: learning rate decay.
        weight_decay: L2 penalty added to the gradient.
        initial_accumulator_value: the starting value of the sum of squared gradients.
        eps: term added to the denominator.
        maximize: maximize the objective instead of minimizing it.
    """

    HYPERS = (
        lr(1e-2),
        Hyper("lr_decay", 0.0, "lr_decay"),
        Hyper("weight_decay", 0.0, "weight_decay"),
        # where the sum starts (the state), not part of an update
        Hyper("initial_accumulator_value", 0.0, "initial_accumulator_value", to=()),
        Hyper("eps", 1e-10, "eps"),
        Hyper("maximize", False, "maximize", annotation=bool, keyword_only=True),
    )
    RECORD = AdagradHyper
    _state_keys = ("sum",)

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], g: dict[str, Any]) -> None:
        state["sum"] = torch.full_like(
            p, g["initial_accumulator_value"], dtype=torch.float32, memory_format=torch.preserve_format
        )

    def _plan(self, p: torch.Tensor, state: dict[str, Any], g: dict[str, Any]) -> Plan:
        return Plan(_run.ADAGRAD, (state["sum"],))
