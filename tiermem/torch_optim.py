"""A ``torch.optim`` optimizer as users bring it, read as a tiermem optimizer spec.

``TieredModel(model, optimizer=torch.optim.AdamW(groups, lr=...))`` takes the optimizer's class,
its param groups and each group's hyperparameters (NOTE [Param groups] in tiermem/config.py);
tiermem runs that update where the optimizer state lives, and never steps the instance itself,
whose state must be empty. :data:`TORCH_OPTIMIZERS` is the one table of the classes it runs; a
class not in it is refused by name, with the list.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from tiermem.config import GROUP_HYPER, Adam, AdamW, _AdamSpec
from tiermem.errors import ConfigError, TierMemError

__all__ = ["TORCH_OPTIMIZERS", "spec_from_torch", "stepped_elsewhere", "supported_names"]


def _adam(defaults: dict[str, Any]) -> type[_AdamSpec]:
    """torch.optim.Adam: AdamW's update when built with ``decoupled_weight_decay=True``."""
    return AdamW if defaults.get("decoupled_weight_decay", False) else Adam


#: the torch.optim classes tiermem runs: each with the spec class that runs it, given the
#: optimizer's defaults (one row per optimizer; a class not here is refused with this list)
TORCH_OPTIMIZERS: dict[type, Callable[[dict[str, Any]], type[_AdamSpec]]] = {
    torch.optim.AdamW: lambda defaults: AdamW,
    torch.optim.Adam: _adam,
}


def supported_names() -> str:
    return ", ".join(f"torch.optim.{cls.__name__}" for cls in TORCH_OPTIMIZERS)


def spec_from_torch(optimizer: torch.optim.Optimizer, *, scheduled: bool = False) -> _AdamSpec:
    """The spec that runs ``optimizer`` in tiermem: its class (by :data:`TORCH_OPTIMIZERS`), its
    param groups in order, each with its hyperparameters. Refused: a class not in the table (a
    subclass too: it may change the update), an optimizer that has stepped (tiermem never steps
    it, so its state would be lost) or one an lr scheduler was built on (that scheduler would set
    the lr of an optimizer nobody steps: build it on ``tm.optimizer``), unless ``scheduled``: the
    caller moves that scheduler onto tiermem's optimizer (the Trainer integration does)."""
    cls = type(optimizer)
    if cls not in TORCH_OPTIMIZERS:
        raise ConfigError(f"tiermem: optimizer={cls.__module__}.{cls.__qualname__} is not one tiermem runs; it runs "
                          f"{supported_names()} (and tiermem.AdamW/Adam): pass one of them, built on the model's "
                          f"parameters as usual")
    if len(optimizer.state):
        raise ConfigError(f"tiermem: the {cls.__name__} given as optimizer= has state for {len(optimizer.state)} "
                          f"parameters (it has stepped); tiermem runs the update itself and never steps it: pass a "
                          f"new one, and load a checkpoint with tm.load()")
    if not scheduled and any("initial_lr" in g for g in optimizer.param_groups):
        raise ConfigError(f"tiermem: an lr scheduler was built on the {cls.__name__} given as optimizer=; it would "
                          f"set the lr of an optimizer tiermem never steps: build the scheduler on tm.optimizer, "
                          f"after the TieredModel")
    defaults = optimizer.defaults
    spec = TORCH_OPTIMIZERS[cls](defaults)
    groups = [{k: v for k, v in g.items() if k != "initial_lr"} for g in optimizer.param_groups]
    decoupled = spec is AdamW
    for g in groups:  # torch.optim.Adam's groups may differ from its defaults in decoupled_weight_decay
        if cls is torch.optim.AdamW or g.get("decoupled_weight_decay", decoupled) == decoupled:
            g.pop("decoupled_weight_decay", None)
    try:
        return spec(groups, **{k: defaults[k] for k in GROUP_HYPER})
    except ConfigError as e:
        raise ConfigError(f"tiermem: the {cls.__name__} given as optimizer=: "
                          f"{str(e).removeprefix('tiermem: ')}") from None


def stepped_elsewhere(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A step pre-hook for an optimizer tiermem read: stepping it would do nothing (its parameters'
    gradients go to tiermem), silently; this says what to call instead."""
    raise TierMemError(f"tiermem: this {type(optimizer).__name__} was given to a TieredModel, which runs its update "
                       f"where the optimizer state lives; call tm.step() (or tm.optimizer.step()) instead of its step()")
