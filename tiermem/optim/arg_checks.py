"""The argument checks every functional optimizer entry shares: the hyperparameters of one update
made and checked once (``make_hyper``), and ``adam_step``'s implementation name, tensors and dtypes,
each refused with a ``tiermem:`` error that names the argument and what to change.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, TypeVar

import torch

from tiermem.config.specs import is_number
from tiermem.errors import ConfigError

IMPLEMENTATIONS = ("native", "compiled", "fallback", "reference")
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
H = TypeVar("H")


def as_number(value: object) -> Any:
    """A one-element tensor (torch optimizers allow a tensor lr) as the number it holds (anything
    else as it is: the hyperparameters' rules check it)."""
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def make_hyper(cls: Callable[..., H], *, step: object, **values: Any) -> H:
    """The hyperparameters of one update, as every functional entry takes them: ``step`` a whole
    number, a one-element tensor as the number it holds; ``cls`` (AdamHyper, SGDHyper, ...) checks them
    (one validation path for the entries and the drop-ins), and its ``where`` names the entry in errors."""
    return cls(step=_as_step(step, getattr(cls, "where", "adam_step ")), **{k: as_number(v) for k, v in values.items()})


def _as_step(step: object, where: str) -> int:
    value = as_number(step)
    if not is_number(value) or not math.isfinite(value) or value != int(value):
        raise ConfigError(
            f"tiermem: {where}step={step!r} is invalid: it must be a whole number "
            f"of updates including this one, >= 1; pass an int"
        )
    return int(value)


def check_impl(impl: Optional[str]) -> None:
    if impl is not None and impl not in IMPLEMENTATIONS:
        raise ConfigError(
            f"tiermem: adam_step impl={impl!r} is unknown; pass one of {IMPLEMENTATIONS} or None for the default"
        )


def check_dtype(name: str, dtype: torch.dtype, allowed: tuple[torch.dtype, ...]) -> None:
    if dtype not in allowed:
        raise ConfigError(
            f"tiermem: adam_step {name} has dtype {dtype}; it must be one of "
            f"{', '.join(str(d) for d in allowed)}; convert it first"
        )


def check_tensors(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    out: Optional[torch.Tensor],
) -> None:
    named = {"master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "grad": grad}
    if out is not None:
        named["out"] = out
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"tiermem: adam_step {name} is a {type(t).__name__}, not a tensor; pass a CPU tensor")
        if t.device != master.device or t.device.type == "meta":
            raise ConfigError(
                f"tiermem: adam_step {name} is on {t.device} but master is on {master.device}; "
                f"all tensors must be on one CPU or accelerator device; move them there"
            )
        if t.shape != master.shape:
            raise ConfigError(
                f"tiermem: adam_step {name} has shape {tuple(t.shape)} but master has "
                f"{tuple(master.shape)}; pass tensors of one shape"
            )
    for name in ("master", "exp_avg", "exp_avg_sq"):
        if named[name].dtype != torch.float32:
            raise ConfigError(
                f"tiermem: adam_step {name} has dtype {named[name].dtype}; master weights "
                f"and moments must be torch.float32; keep them in fp32"
            )
    check_dtype("grad", grad.dtype, GRAD_DTYPES)
    if out is not None:
        check_dtype("out", out.dtype, OUT_DTYPES)
    ptrs = [master.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr()]
    if master.numel() and len(set(ptrs)) != len(ptrs):
        raise ConfigError(
            "tiermem: adam_step master, exp_avg, exp_avg_sq and grad must be four "
            "different tensors, but two of them share memory; pass separate buffers"
        )
