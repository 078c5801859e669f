"""``CPUAdam``: a drop-in ``torch.optim.Optimizer`` for fp32 CPU parameters, built on ``adam_step``."""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch.optim import Optimizer

from tiermem.config import check_adam_hyper
from tiermem.errors import ConfigError, checked_arguments
from tiermem.optim.functional import adam_step, any_nonfinite, as_number

log = logging.getLogger(__name__)

Params = Union[Iterable[torch.Tensor], Iterable[dict[str, Any]]]


@checked_arguments
class CPUAdam(Optimizer):
    """Adam or AdamW (``adamw=True``, the default) on CPU parameters, one fused pass per tensor.

    Matches ``torch.optim.AdamW`` / ``torch.optim.Adam`` (``foreach=False``) up to the rounding of
    one square root (see tiermem/optim/_kernels.py, NOTE [sqrt rounding]); lr schedulers, param
    groups with their own hyperparameters, and ``state_dict``/``load_state_dict`` work as they do
    there, with the same state keys (``step``, ``exp_avg``, ``exp_avg_sq``). A step whose gradients
    hold an inf or NaN changes nothing (no parameter, moment or step count) and sets
    ``last_step_skipped``; ``check_finite=False`` turns the check off.
    """

    def __init__(self, params: Params, lr: Union[float, torch.Tensor] = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw: bool = True, *, check_finite: bool = True):
        _check_hyper(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw=adamw)
        if not isinstance(check_finite, bool):
            raise ConfigError(f"tiermem: CPUAdam check_finite={check_finite!r} is invalid: it must be True or False")
        self.check_finite = check_finite
        self.last_step_skipped = False
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw=adamw))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = {**self.defaults, **param_group}  # what torch's add_param_group will store
        _check_hyper(lr=group["lr"], betas=group["betas"], eps=group["eps"],
                     weight_decay=group["weight_decay"], adamw=group["adamw"])
        params = group["params"]
        for p in [params] if isinstance(params, torch.Tensor) else list(params):
            if p.device.type != "cpu" or p.dtype != torch.float32:
                raise ConfigError(f"tiermem: CPUAdam got a {p.dtype} parameter on {p.device} of shape "
                                  f"{tuple(p.shape)}; it updates fp32 CPU parameters only; use "
                                  f"torch.optim.AdamW for others, or TieredModel for mixed precision")
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # a torch.optim.Adam/AdamW state_dict names it differently
            group.setdefault("adamw", group.get("decoupled_weight_decay", self.defaults["adamw"]))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        for _, p in todo:
            if p.grad.is_sparse:
                raise ConfigError(f"tiermem: CPUAdam got a sparse gradient for a parameter of shape "
                                  f"{tuple(p.shape)}; use torch.optim.SparseAdam for sparse gradients")
        # A step is atomic: every gradient is checked before any parameter is written.
        self.last_step_skipped = self.check_finite and any(any_nonfinite(p.grad) for _, p in todo)
        if self.last_step_skipped:
            log.info("tiermem: CPUAdam skipped a step: a gradient holds inf or NaN")
            return loss
        for group, p in todo:
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            beta1, beta2 = group["betas"]
            adam_step(p, state["exp_avg"], state["exp_avg_sq"], p.grad, step=state["step"],
                      lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                      weight_decay=group["weight_decay"], adamw=group["adamw"], check_finite=False)
        return loss


def _check_hyper(*, lr: Any, betas: Any, eps: Any, weight_decay: Any, adamw: Any) -> None:
    """The rules every Adam in tiermem checks (NOTE [Adam hyperparameter rules]); a tensor lr, which
    torch optimizers allow, is checked as the number it holds."""
    check_adam_hyper("CPUAdam ", lr=as_number(lr), betas=betas, eps=eps, weight_decay=weight_decay, adamw=adamw)
