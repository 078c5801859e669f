"""``CPUAdafactor``: a drop-in ``torch.optim.Adafactor`` on tiermem's CPU kernels (tiermem/optim/dropin/shared.py)."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from tiermem.errors import checked_arguments
from tiermem.optim.adafactor import AdafactorHyper, adafactor_update, factored_state
from tiermem.optim.dropin.hyper_table import Hyper, Pair, lr
from tiermem.optim.dropin.shared import CPUOptimizer, Plan
from tiermem.optim.kernels.sr import StochasticRound


@checked_arguments
class CPUAdafactor(CPUOptimizer):
    """torch.optim.Adafactor (factored second moment of the last two dimensions, relative step size,
    update clipping), in the fewest passes its reductions allow. State as torch's: ``row_var`` and
    ``col_var`` (two or more dimensions) or ``variance``, and ``step``.

    Args:
        lr: learning rate (relative step size).
        beta2_decay: the exponent of the second moment's decay.
        eps: ``(eps1, eps2)``: the term added to the squared gradient (None: the dtype's smallest
            normal number) and the floor of the parameter's RMS.
        d: clipping threshold of the update's RMS.
        weight_decay: decoupled weight decay.
        maximize: maximize the objective instead of minimizing it.
    """

    HYPERS = (
        lr(1e-2),
        Hyper("beta2_decay", -0.8, "beta2_decay"),
        Hyper(
            "eps",
            (None, 1e-3),
            Pair("(eps1 or None, eps2)", ("eps1", "eps2")),
            annotation=tuple[Optional[float], float],
        ),
        Hyper("d", 1.0, "d"),
        Hyper("weight_decay", 0.0, "weight_decay"),
        Hyper("maximize", False, "maximize", annotation=bool, keyword_only=True),
    )
    RECORD = AdafactorHyper

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], g: dict[str, Any]) -> None:
        if p.dim() > 1:
            state["row_var"] = p.new_zeros((*p.shape[:-1], 1), dtype=torch.float32)
            state["col_var"] = p.new_zeros((*p.shape[:-2], 1, p.shape[-1]), dtype=torch.float32)
        else:
            state["variance"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)

    def _state_spec(self, p: torch.Tensor, key: str, state: dict[str, Any]) -> Optional[tuple[torch.dtype, int]]:
        shape = tuple(p.shape)
        numel = {
            "row_var": math.prod(shape[:-1]),
            "col_var": math.prod(shape[:-2]) * shape[-1] if len(shape) > 1 else 0,
            "variance": p.numel(),
        }.get(key)
        return None if numel is None else (torch.float32, numel)

    def _plan(self, p: torch.Tensor, state: dict[str, Any], g: dict[str, Any]) -> Plan:
        shape = tuple(p.shape)
        _, tensors = factored_state(p, shape, state.get("row_var"), state.get("col_var"), state.get("variance"))
        return Plan(None, tensors, (shape,))

    def _functional(
        self, plan: Plan, p: torch.Tensor, grad: torch.Tensor, hyper: Any, sr: Optional[StochasticRound]
    ) -> None:
        """adafactor_step's passes (no single native pass: its reductions come between)."""
        (shape,) = plan.variant
        state = tuple(t for t in plan.state if t is not None)
        adafactor_update(p, grad, state, shape, None, hyper, stochastic_round=sr, check_finite=False, impl=None)
