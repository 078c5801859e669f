"""Frozen, validated configuration: optimizer hyperparameter specs and precision."""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any

import torch

from tiermem.errors import ConfigError

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def working_dtype(precision: str) -> torch.dtype:
    try:
        return PRECISIONS[precision]
    except (KeyError, TypeError):
        raise ConfigError(f"tiermem: precision={precision!r} is not supported; "
                          f"use one of {', '.join(repr(p) for p in PRECISIONS)}") from None


def _need(cls: str, name: str, value: Any, ok: bool, rule: str) -> None:
    if not ok:
        raise ConfigError(f"tiermem: {cls}.{name}={value!r} is invalid: {rule}")


@dataclass(frozen=True, kw_only=True)
class _AdamSpec:
    """Adam hyperparameters. ``no_decay`` lists fnmatch patterns of parameter names that get no
    weight decay (e.g. ``("*.bias", "*.ln_*")``); ``no_decay_1d=True`` exempts every parameter with
    fewer than two dimensions, which covers biases and norm weights in most models."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    no_decay: tuple[str, ...] = ()
    no_decay_1d: bool = False

    adamw = False  # class constant: how weight decay is applied

    def __post_init__(self) -> None:
        c = type(self).__name__
        _need(c, "lr", self.lr, isinstance(self.lr, (int, float)) and self.lr >= 0 and math.isfinite(self.lr),
              "must be a finite number >= 0")
        betas = tuple(self.betas) if isinstance(self.betas, (tuple, list)) else None
        _need(c, "betas", self.betas, betas is not None and len(betas) == 2
              and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas),
              "must be two numbers in [0, 1)")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        _need(c, "eps", self.eps, isinstance(self.eps, (int, float)) and self.eps >= 0, "must be >= 0")
        _need(c, "weight_decay", self.weight_decay,
              isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0, "must be >= 0")
        nd = (self.no_decay,) if isinstance(self.no_decay, str) else tuple(self.no_decay)
        _need(c, "no_decay", self.no_decay, all(isinstance(p, str) for p in nd),
              "must be a tuple of name patterns such as ('*.bias',)")
        object.__setattr__(self, "no_decay", nd)

    def decays(self, name: str, param: torch.Tensor) -> bool:
        """Whether weight decay applies to the parameter ``name``."""
        if self.no_decay_1d and param.dim() < 2:
            return False
        return not any(fnmatch.fnmatchcase(name, p) for p in self.no_decay)

    def group_defaults(self) -> dict[str, Any]:
        """The keys torch optimizers keep in each param group (so lr schedulers work)."""
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps,
                "weight_decay": self.weight_decay, "adamw": self.adamw}


@dataclass(frozen=True, kw_only=True)
class Adam(_AdamSpec):
    """Adam (L2 penalty added to the gradient), like ``torch.optim.Adam``."""


@dataclass(frozen=True, kw_only=True)
class AdamW(_AdamSpec):
    """AdamW (decoupled weight decay), like ``torch.optim.AdamW``; weight decay defaults to 0.01."""

    weight_decay: float = 1e-2
    adamw = True
