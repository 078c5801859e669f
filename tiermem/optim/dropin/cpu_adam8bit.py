"""``CPUAdam8bit``: Adam or AdamW with 8-bit block-wise moments as a drop-in ``torch.optim`` optimizer
on tiermem's fused CPU kernels (tiermem/optim/dropin/shared.py)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from tiermem.config.argdocs import shares_args
from tiermem.errors import ConfigError, checked_arguments
from tiermem.optim.adam_hyper import AdamHyper
from tiermem.optim.dropin.cpu_adam import ADAM_ARGS, ADAM_HYPERS, adam_functional, fill_adamw, init_adam_state
from tiermem.optim.dropin.hyper_table import Hyper
from tiermem.optim.dropin.shared import CPUOptimizer, Plan
from tiermem.optim.kernels import dispatch as _run, quant as _quant
from tiermem.optim.kernels.sr import StochasticRound
from tiermem.optim.steps import adam8bit_update


@shares_args(ADAM_ARGS)
@checked_arguments
class CPUAdam8bit(CPUOptimizer):
    """Adam or AdamW (``adamw=True``) with 8-bit block-wise moments (NOTE [8-bit state] in
    tiermem/optim/kernels/quant.py), as bitsandbytes' and torchao's 8-bit AdamW: tensors of at least
    ``min_8bit_size`` elements keep ``exp_avg``/``exp_avg_sq`` as uint8 codes (flat) with fp32
    ``exp_avg_absmax``/``exp_avg_sq_absmax``; smaller ones keep fp32 moments and step as CPUAdam.

    Args:
        min_8bit_size: the fewest elements a tensor needs for 8-bit moments.

    Adam's hyperparameters (ADAM_HYPERS) are documented on its constructor.
    """

    HYPERS = (
        *ADAM_HYPERS,
        Hyper("min_8bit_size", _quant.MIN_8BIT_NUMEL, "min_8bit_size", annotation=int, setting=True),
    )
    RECORD = AdamHyper
    min_8bit_size: int

    def _fill_group(self, group: dict[str, Any], defaults: dict[str, Any]) -> None:
        fill_adamw(group, defaults)
        super()._fill_group(group, defaults)

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], g: dict[str, Any]) -> None:
        if p.numel() < self.min_8bit_size:
            init_adam_state(p, state)
            return
        n, blocks = p.numel(), _quant.num_blocks(p.numel())
        state["exp_avg"] = torch.zeros(n, dtype=torch.uint8)
        state["exp_avg_absmax"] = torch.zeros(blocks, dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros(n, dtype=torch.uint8)
        state["exp_avg_sq_absmax"] = torch.zeros(blocks, dtype=torch.float32)

    def _state_spec(self, p: torch.Tensor, key: str, state: dict[str, Any]) -> Optional[tuple[torch.dtype, int]]:
        n = p.numel()
        if "exp_avg_absmax" not in state:  # fp32 moments, as CPUAdam
            return (torch.float32, n) if key in ("exp_avg", "exp_avg_sq") else None
        blocks = _quant.num_blocks(n)
        specs = {"exp_avg": (torch.uint8, n), "exp_avg_sq": (torch.uint8, n)}
        specs.update({"exp_avg_absmax": (torch.float32, blocks), "exp_avg_sq_absmax": (torch.float32, blocks)})
        return specs.get(key)

    def _check_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        super()._check_state(p, state)
        eight_bit = "exp_avg_absmax" in state if state else p.numel() >= self.min_8bit_size
        if eight_bit and not p.is_contiguous():
            raise ConfigError(
                f"tiermem: CPUAdam8bit got a non-contiguous parameter of shape {tuple(p.shape)}: its 8-bit "
                f"state is blocked along the flat tensor; pass contiguous parameters (or raise "
                f"min_8bit_size above its {p.numel()} elements)"
            )

    def _plan(self, p: torch.Tensor, state: dict[str, Any], g: dict[str, Any]) -> Plan:
        if "exp_avg_absmax" not in state:  # a small tensor: fp32 moments, as CPUAdam
            return Plan(_run.ADAM, (state["exp_avg"], state["exp_avg_sq"]))
        return Plan(
            _run.ADAM8BIT, (state["exp_avg"], state["exp_avg_absmax"], state["exp_avg_sq"], state["exp_avg_sq_absmax"])
        )

    def _functional(
        self, plan: Plan, p: torch.Tensor, grad: torch.Tensor, hyper: Any, sr: Optional[StochasticRound]
    ) -> None:
        if plan.kernel is _run.ADAM:
            adam_functional(plan, p, grad, hyper, sr)
        else:
            adam8bit_update(
                p.view(-1) if p.is_contiguous() else p,
                plan.state,
                grad.reshape(-1),
                None,
                hyper,
                stochastic_round=sr,
                check_finite=False,
                impl=None,
            )
