"""``CPULion``: Lion (Chen et al. 2023; torch has none) as a drop-in ``torch.optim`` optimizer on
tiermem's fused CPU kernel (tiermem/optim/dropin/shared.py)."""

from __future__ import annotations

from typing import Any

import torch

from tiermem.errors import checked_arguments
from tiermem.optim.dropin.hyper_table import Hyper, Pair, lr
from tiermem.optim.dropin.shared import CPUOptimizer, Plan
from tiermem.optim.hypers import LionHyper
from tiermem.optim.kernels import dispatch as _run


@checked_arguments
class CPULion(CPUOptimizer):
    """Lion (Chen et al. 2023; torch has none): ``betas`` and decoupled ``weight_decay`` as the paper's
    reference implementation. State: ``exp_avg`` and ``step``.

    Args:
        lr: learning rate.
        betas: the interpolation coefficient whose sign is the update, and the momentum's.
        weight_decay: decoupled weight decay.
    """

    HYPERS = (
        lr(1e-4),
        Hyper(
            "betas",
            (0.9, 0.99),
            Pair("two numbers, each in [0, 1]", ("lion_beta1", "lion_beta2")),
            annotation=tuple[float, float],
        ),
        Hyper("weight_decay", 0.0, "weight_decay"),
    )
    RECORD = LionHyper
    _state_keys = ("exp_avg",)

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], g: dict[str, Any]) -> None:
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)

    def _plan(self, p: torch.Tensor, state: dict[str, Any], g: dict[str, Any]) -> Plan:
        return Plan(_run.LION, (state["exp_avg"],))
