"""``CPUAdam``: a drop-in ``torch.optim.Optimizer`` for fp32 CPU parameters, built on the fused Adam kernel.

NOTE [Drop-in speed]
CPUAdam once stepped 4 tensors of 2M fp32 parameters 2.5-3x slower than torch.optim.AdamW(fused=True),
while the same update inside TieredModel ran at ~0.9x. Three costs TieredModel does not pay:
- The found_inf check ran torch.compile's ``isfinite().all()`` per gradient, at half the bandwidth of
  the update itself. Now it is the native bit test: one read of the gradient at memory speed (4 of
  32 bytes a parameter with fp32 gradients, so the default, checked step is at best 0.875x of
  torch's, which checks nothing; ``check_finite=False`` moves torch's bytes).
- Each ``adam_step`` call went through argument checks and dynamo's guards (~0.1 ms a tensor). Now
  the update is the native Adam kernel (tiermem/optim/kernels/csrc/elementwise.py: bit-identical to the
  compiled kernel, both equal the reference) called through ctypes; the compiled ``adam_step``
  remains the path where no native kernel can be built. The base's step loop (tiermem/optim/dropin/shared.py)
  counts the steps in one call, makes and checks the hyperparameters once per group and step, and
  finds the native library once per step (~12-16 us of Python a tensor, torch's fused: 5-13 us).
- Python between two kernels runs with a cold cache: the kernel before it streamed the tensor's
  bytes through it, so each object the interpreter touches is a miss to memory. Made between the
  kernels, the calls of 4 tensors of 2M cost ~1 ms of the step's ~7 (measured: CPU time outside the
  ctypes calls); the base now makes every call of a step first (:func:`tiermem.optim.kernels.dispatch.native_call`
  returns it unmade) and then runs them back to back, as torch's fused kernel runs all tensors in one
  dispatch.
bench/cpu_optim.py measures each drop-in against torch's fused optimizer and against a kernel moving
its bytes (bench/RESULTS.md).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from tiermem.config.argdocs import shares_args
from tiermem.errors import checked_arguments
from tiermem.optim.adam_hyper import AdamHyper
from tiermem.optim.dropin.hyper_table import Hyper, lr
from tiermem.optim.dropin.shared import CPUOptimizer, Plan
from tiermem.optim.functional import adam_update
from tiermem.optim.kernels import dispatch as _run
from tiermem.optim.kernels.sr import StochasticRound

log = logging.getLogger(__name__)

#: Adam's hyperparameters, torch's names and defaults (CPUAdam8bit's too); rules: NOTE [Adam hyperparameter rules]
ADAM_HYPERS = (
    lr(1e-3),
    Hyper("betas", (0.9, 0.999), "betas", to=("beta1", "beta2"), annotation=tuple[float, float]),
    Hyper("eps", 1e-8, "eps"),
    Hyper("weight_decay", 0.0, "weight_decay"),
    Hyper("adamw", True, "adamw", annotation=bool),
)
#: ...and their documentation, joined to CPUAdam's and CPUAdam8bit's constructors (config/argdocs.py)
ADAM_ARGS = """
    lr: learning rate.
    betas: coefficients of the running averages of the gradient and of its square.
    eps: term added to the denominator.
    weight_decay: decoupled (``adamw=True``) or L2 weight decay.
    adamw: AdamW when True (the default), Adam when False.
"""


@shares_args(ADAM_ARGS)
@checked_arguments
class CPUAdam(CPUOptimizer):
    """Adam or AdamW (``adamw=True``, the default) on CPU parameters, one fused pass per tensor.

    Matches ``torch.optim.AdamW`` / ``torch.optim.Adam`` (``foreach=False``) up to the rounding of
    one square root (see tiermem/optim/kernels/eager.py, NOTE [sqrt rounding]); lr schedulers, param
    groups with their own hyperparameters, and ``state_dict``/``load_state_dict`` work as they do
    there, with the same state keys (``step``, ``exp_avg``, ``exp_avg_sq``). A step whose gradients
    hold an inf or NaN changes nothing (no parameter, moment or step count) and sets
    ``last_step_skipped``; ``check_finite=False`` turns the check off. ``bf16_stochastic_round=True``
    takes bf16 parameters and keeps no fp32 copy (tiermem/optim/dropin/shared.py).

    Its hyperparameters (ADAM_HYPERS) are documented on its constructor.
    """

    HYPERS = ADAM_HYPERS
    RECORD = AdamHyper
    _sparse_hint = "use torch.optim.SparseAdam for sparse gradients"
    _state_keys = ("exp_avg", "exp_avg_sq")

    def _fill_group(self, group: dict[str, Any], defaults: dict[str, Any]) -> None:
        fill_adamw(group, defaults)
        super()._fill_group(group, defaults)

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        init_adam_state(p, state)

    def _plan(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> Plan:
        return Plan(_run.ADAM, (state["exp_avg"], state["exp_avg_sq"]))

    def _functional(
        self, plan: Plan, p: torch.Tensor, grad: torch.Tensor, hyper: Any, sr: Optional[StochasticRound]
    ) -> None:
        adam_functional(plan, p, grad, hyper, sr)


def fill_adamw(group: dict[str, Any], defaults: dict[str, Any]) -> None:
    """A loaded group's ``adamw``: a torch.optim.Adam/AdamW state dict names it ``decoupled_weight_decay``."""
    group.setdefault("adamw", group.get("decoupled_weight_decay", defaults["adamw"]))


def init_adam_state(p: torch.Tensor, state: dict[str, Any]) -> None:
    """fp32 moments of zeros, shaped as the parameter (torch's state)."""
    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)


def adam_functional(plan: Plan, p: torch.Tensor, grad: torch.Tensor, hyper: Any, sr: Optional[StochasticRound]) -> None:
    """Where the native kernel cannot run, ``adam_step``'s path: the compiled kernel (bit-identical to
    the native one), or bf16 weights' reference."""
    exp_avg, exp_avg_sq = plan.state
    assert exp_avg is not None and exp_avg_sq is not None  # Adam's moments always exist
    adam_update(p, exp_avg, exp_avg_sq, grad, None, hyper, stochastic_round=sr, check_finite=False, impl=None)
