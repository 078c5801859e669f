"""What tiermem's drop-in ``torch.optim`` optimizers share (CPUAdam, CPUSGD, CPUAdagrad, CPULion,
CPUAdafactor, CPUAdam8bit): parameter checks, the closure, the all-or-nothing finite check, state
created on a parameter's first step, the step count, and the stochastic rounding of bf16 weights.

A subclass names itself (errors say it), checks a param group's hyperparameters, creates a
parameter's state and runs one update; the base does the rest. Every update of a step runs after
every gradient was checked: a step whose gradients hold an inf or NaN changes nothing (no weight,
state or step count) and sets ``last_step_skipped``. With ``bf16_stochastic_round=True`` the
parameters may be bf16 (no fp32 copy is kept; NOTE [Stochastic rounding bits] in
tiermem/optim/_sr.py); their rounding is keyed by ``sr_seed`` (default: ``torch.initial_seed()``
when the optimizer is built, so ``torch.manual_seed`` makes runs repeat) and by each parameter's
index in the optimizer (the numbering of ``state_dict()``), and both are kept in the param groups, so
a resumed run rounds as the uninterrupted one.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch.optim import Optimizer

from tiermem.config import is_int
from tiermem.errors import ConfigError
from tiermem.optim import _native, _run
from tiermem.optim._sr import StochasticRound
from tiermem.optim.functional import as_number

log = logging.getLogger(__name__)

Params = Union[Iterable[torch.Tensor], Iterable[dict[str, Any]]]


class CPUOptimizer(Optimizer):
    """The base of tiermem's drop-in CPU optimizers (module docstring)."""

    _sparse_hint = "use a torch.optim optimizer that takes sparse gradients (torch.optim.SGD, Adagrad)"

    def __init__(
        self,
        params: Params,
        defaults: dict[str, Any],
        *,
        check_finite: bool,
        bf16_stochastic_round: bool,
        sr_seed: Optional[int],
    ) -> None:
        name = type(self).__name__
        for key, value in (("check_finite", check_finite), ("bf16_stochastic_round", bf16_stochastic_round)):
            if not isinstance(value, bool):
                raise ConfigError(f"tiermem: {name} {key}={value!r} is invalid: it must be True or False")
        if sr_seed is not None and not is_int(sr_seed):
            raise ConfigError(f"tiermem: {name} sr_seed={sr_seed!r} is invalid: it must be an int or None")
        self.check_finite = check_finite
        self.last_step_skipped = False
        self._index: Optional[dict[int, int]] = None
        self._prepared: dict[tuple, tuple[Any, ctypes.Array]] = {}
        defaults = {
            **defaults,
            "bf16_stochastic_round": bf16_stochastic_round,
            "sr_seed": torch.initial_seed() if sr_seed is None else sr_seed,
        }
        super().__init__(params, defaults)

    # -- what a subclass supplies ------------------------------------------------------------------
    def _check_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _update(
        self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], step: int, sr: Optional[StochasticRound]
    ) -> None:
        raise NotImplementedError

    # -- torch.optim.Optimizer -----------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, as ``torch.optim.Optimizer.add_param_group``; its hyperparameters are
        checked first.

        Args:
            param_group: the group: ``"params"`` and the hyperparameters it sets.
        """
        group = {**self.defaults, **param_group}  # what torch's add_param_group will store
        self._check_group(group)
        if not isinstance(group["bf16_stochastic_round"], bool):
            raise ConfigError(
                f"tiermem: {type(self).__name__} bf16_stochastic_round="
                f"{group['bf16_stochastic_round']!r} is invalid: it must be True or False"
            )
        params = group["params"]
        for p in [params] if isinstance(params, torch.Tensor) else list(params):
            self._check_param(p, group["bf16_stochastic_round"])
        super().add_param_group(param_group)
        self._index = None

    def _check_param(self, p: torch.Tensor, stochastic: bool) -> None:
        ok = p.device.type == "cpu" and (p.dtype == torch.float32 or (stochastic and p.dtype == torch.bfloat16))
        if not ok:
            raise ConfigError(
                f"tiermem: {type(self).__name__} got a {p.dtype} parameter on {p.device} of shape "
                f"{tuple(p.shape)}; it updates fp32 CPU parameters only (bf16 ones with "
                f"bf16_stochastic_round=True); use a torch.optim optimizer for others, or "
                f"TieredModel for mixed precision"
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this optimizer, or of the torch optimizer it stands in for.

        Args:
            state_dict: what ``state_dict()`` returned.
        """
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # a torch optimizer's state_dict lacks tiermem's keys
            for key in ("bf16_stochastic_round", "sr_seed"):
                group.setdefault(key, self.defaults[key])
        # torch casts floating-point state to the parameter's dtype: a bf16 parameter's fp32 moments
        # would lose their precision and 8-bit codes their type. State keeps the dtype it was saved in.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(pid, {}).items():
                if isinstance(value, torch.Tensor) and key != "step" and self.state[p][key].dtype != value.dtype:
                    self.state[p][key] = value.detach().to(p.device, copy=True)
        self._index = None

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]  # torch's stub: overloads
        """One update of every parameter with a gradient, after every gradient was checked: a step
        whose gradients hold an inf or NaN changes nothing and sets ``last_step_skipped``.

        Args:
            closure: reevaluates the model and returns the loss, as ``torch.optim`` takes it.

        Returns:
            The closure's loss, or None without one.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        for _, p in todo:
            if p.grad.is_sparse:
                raise ConfigError(
                    f"tiermem: {type(self).__name__} got a sparse gradient for a parameter of shape "
                    f"{tuple(p.shape)}; {self._sparse_hint}"
                )
        # A step is atomic: every gradient is checked before any parameter is written.
        self.last_step_skipped = self.check_finite and any(_run.any_nonfinite(p.grad) for _, p in todo)
        if self.last_step_skipped:
            log.info("tiermem: %s skipped a step: a gradient holds inf or NaN", type(self).__name__)
            return loss
        self._prepared.clear()
        for group, p in todo:
            state = self.state[p]
            if not state:
                self._init_state(p, state, group)
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
            elif "step" not in state:  # torch.optim.SGD's state keeps no count: its buffer exists, so not step 1
                state["step"] = torch.tensor(1.0, dtype=torch.float32)
            state["step"] += 1
            step = int(state["step"].item())
            sr = self._rounding(p, group) if p.dtype == torch.bfloat16 else None
            self._update(p, state, group, step, sr)
        return loss

    def _fused(
        self,
        kernel: _run.Kernel,
        p: torch.Tensor,
        state: tuple,
        group: dict[str, Any],
        step: int,
        sr: Optional[StochasticRound],
        make: Callable[[], Any],
        checked: Callable[[], object],
        *variant: Any,
    ) -> None:
        """One update: the native kernel straight away, with the group's hyperparameters made and checked
        once per step (``make``), when the tensors allow; else ``checked``, the functional entry."""
        key = (id(group), step, *variant)
        prepared = self._prepared.get(key)
        if prepared is None:
            hyper = make()
            prepared = self._prepared[key] = (hyper, _native.floats(kernel.scalars(hyper)))
        keys = None if sr is None else sr.keys(step)
        grad = p.grad
        assert grad is not None  # the drop-ins step the parameters that have a gradient
        if not _run.fast_step(kernel, p.detach(), state, grad.detach(), prepared[1], keys):
            checked()

    def _rounding(self, p: torch.Tensor, group: dict[str, Any]) -> StochasticRound:
        if self._index is None:
            params = (q for g in self.param_groups for q in g["params"])
            self._index = {id(q): i for i, q in enumerate(params)}
        return StochasticRound.for_parameter(int(group["sr_seed"]), f"param{self._index[id(p)]}")


def number(value: Any) -> Any:
    """A one-element tensor hyperparameter (torch allows a tensor lr) as the number it holds."""
    return as_number(value)
