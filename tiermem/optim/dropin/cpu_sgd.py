"""``CPUSGD``: a drop-in ``torch.optim.SGD`` on tiermem's fused CPU kernel (tiermem/optim/dropin/shared.py)."""

from __future__ import annotations

from typing import Any

import torch

from tiermem.errors import ConfigError, checked_arguments
from tiermem.optim.dropin.hyper_table import Hyper, lr
from tiermem.optim.dropin.shared import CPUOptimizer, Plan
from tiermem.optim.hypers import SGDHyper
from tiermem.optim.kernels import dispatch as _run


@checked_arguments
class CPUSGD(CPUOptimizer):
    """torch.optim.SGD (momentum, dampening, Nesterov, weight decay, maximize), one fused pass per
    tensor. State: ``momentum_buffer`` (with momentum) and ``step``.

    Args:
        lr: learning rate.
        momentum: momentum factor.
        dampening: dampening of the momentum.
        weight_decay: L2 penalty added to the gradient.
        nesterov: Nesterov momentum (needs momentum > 0 and no dampening).
        maximize: maximize the objective instead of minimizing it.
    """

    HYPERS = (
        lr(1e-3),
        Hyper("momentum", 0.0, "momentum"),
        Hyper("dampening", 0.0, "dampening"),
        Hyper("weight_decay", 0.0, "weight_decay"),
        Hyper("nesterov", False, "nesterov", annotation=bool),
        Hyper("maximize", False, "maximize", annotation=bool, keyword_only=True),
    )
    RECORD = SGDHyper
    _state_keys = ("momentum_buffer",)

    def _check_group(self, g: dict[str, Any]) -> None:
        super()._check_group(g)
        if g["nesterov"] and (g["momentum"] <= 0 or g["dampening"] != 0):
            raise ConfigError("tiermem: CPUSGD nesterov=True needs momentum > 0 and dampening = 0; as torch.optim.SGD")

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], g: dict[str, Any]) -> None:
        pass  # the buffer is made on the first step with momentum

    def _plan(self, p: torch.Tensor, state: dict[str, Any], g: dict[str, Any]) -> Plan:
        if g["momentum"] == 0:
            return Plan(_run.SGD, (None,), (False,))
        buf = state.get("momentum_buffer")
        if buf is not None:
            return Plan(_run.SGD, (buf,), (False,))
        # torch: made from the gradient when first needed (the kernel sets it: init_buffer)
        buf = state["momentum_buffer"] = torch.empty_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        return Plan(_run.SGD, (buf,), (True,))

    def _variant(self, variant: tuple) -> dict[str, Any]:
        return {"init_buffer": variant[0]}
