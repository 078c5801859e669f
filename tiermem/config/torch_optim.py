"""A ``torch.optim`` optimizer as users bring it, read as a tiermem optimizer spec.

``TieredModel(model, optimizer=torch.optim.AdamW(groups, lr=...))`` takes the optimizer's class,
its param groups and each group's hyperparameters (NOTE [Param groups] in tiermem/config/specs.py);
tiermem runs that update where the optimizer state lives, and never steps the instance itself,
whose state must be empty. :data:`TORCH_OPTIMIZERS` is the one table of the classes it runs with a
fused kernel (and :data:`FOREIGN_8BIT`, other libraries' 8-bit AdamW); any other optimizer class
runs generically, its own ``step()`` on the master weights (NOTE [Generic optimizers] in
tiermem/config/generic_optim.py), or is refused by name where it cannot. :func:`optimizers` lists which.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from tiermem.config import optimizers as optim_specs
from tiermem.config.generic_optim import GenericSpec
from tiermem.config.optimizers import SGD, Adafactor, Adagrad, Adam8bit, AdamW8bit
from tiermem.config.specs import Adam, AdamW, _Spec
from tiermem.errors import ConfigError, TierMemError

__all__ = [
    "FOREIGN_8BIT",
    "TORCH_OPTIMIZERS",
    "optimizers",
    "runs",
    "spec_from_torch",
    "stepped_elsewhere",
    "supported_names",
]

log = logging.getLogger(__name__)


def _adam(defaults: dict[str, Any]) -> type[_Spec]:
    """torch.optim.Adam: AdamW's update when built with ``decoupled_weight_decay=True``."""
    return AdamW if defaults.get("decoupled_weight_decay", False) else Adam


#: the torch.optim classes tiermem runs: each with the spec class that runs it, given the
#: optimizer's defaults (one row per optimizer; a class not here is refused with this list)
TORCH_OPTIMIZERS: dict[type, Callable[[dict[str, Any]], type[_Spec]]] = {
    torch.optim.AdamW: lambda defaults: AdamW,
    torch.optim.Adam: _adam,
    torch.optim.SGD: lambda defaults: SGD,
    torch.optim.Adagrad: lambda defaults: Adagrad,
    torch.optim.Adafactor: lambda defaults: Adafactor,
}

#: 8-bit AdamW classes of other libraries, read by their module and class name (the libraries are
#: never imported): each runs as tiermem's 8-bit Adam of the same meaning (block-wise 8-bit moments,
#: fp32 below a size threshold). Paged variants page their state between GPU and host; tiermem homes
#: the state by its policy instead, so the numbers are the same.
FOREIGN_8BIT: dict[tuple[str, str], type[_Spec]] = {
    ("bitsandbytes.optim.adamw", "AdamW8bit"): AdamW8bit,
    ("bitsandbytes.optim.adamw", "PagedAdamW8bit"): AdamW8bit,
    ("bitsandbytes.optim.adam", "Adam8bit"): Adam8bit,
    ("bitsandbytes.optim.adam", "PagedAdam8bit"): Adam8bit,
    ("torchao.optim.adam", "AdamW8bit"): AdamW8bit,
    ("torchao.prototype.low_bit_optim.adam", "AdamW8bit"): AdamW8bit,
}


def supported_names() -> str:
    return ", ".join(
        [f"torch.optim.{cls.__name__}" for cls in TORCH_OPTIMIZERS]
        + [f"{m.partition('.')[0]} {c}" for m, c in FOREIGN_8BIT]
    )


def runs(cls: Any) -> bool:
    """Whether tiermem may run optimizers of this class: fused (TORCH_OPTIMIZERS, FOREIGN_8BIT) or
    generically (any other torch.optim.Optimizer subclass; its probe may still refuse it)."""
    return cls in TORCH_OPTIMIZERS or (
        isinstance(cls, type) and (_foreign(cls) is not None or issubclass(cls, torch.optim.Optimizer))
    )


def fused(cls: Any) -> bool:
    """Whether optimizers of this class run with one of tiermem's fused kernels."""
    return cls in TORCH_OPTIMIZERS or (isinstance(cls, type) and _foreign(cls) is not None)


def optimizers() -> dict[str, str]:
    """Every optimizer tiermem runs, by name, and how: ``"fused"`` (a fused kernel of tiermem.optim:
    tiermem's specs, the torch classes of :data:`TORCH_OPTIMIZERS`, other libraries' 8-bit AdamW) or
    ``"generic"`` (its own ``step()`` on the master weights: NOTE [Generic optimizers]). The
    ``torch.optim`` classes listed as generic are those whose probe passes here (LBFGS, which needs a
    closure, and SparseAdam, which needs sparse gradients, are not); any other ``torch.optim.Optimizer``
    subclass is tried the same way when given."""
    out = {f"tiermem.{name}": "fused" for name in ("Adam", "AdamW", *optim_specs.__all__)}
    out.update({f"torch.optim.{cls.__name__}": "fused" for cls in TORCH_OPTIMIZERS})
    out.update({f"{m.partition('.')[0]}.{c}": "fused" for m, c in FOREIGN_8BIT})
    for name in sorted(torch.optim.__all__):
        cls = getattr(torch.optim, name)
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer:
            if cls not in TORCH_OPTIMIZERS and _generic_ok(cls):
                out[f"torch.optim.{name}"] = "generic"
    return dict(sorted(out.items()))


def _generic_ok(cls: type) -> bool:
    """Whether the generic path's probe passes for ``cls`` built with its defaults."""
    try:
        GenericSpec([torch.zeros(1, requires_grad=True)], optimizer=cls([torch.zeros(1, requires_grad=True)]))
    except (ConfigError, TypeError, ValueError, RuntimeError):
        return False
    return True


def _stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer has state of a step (torch's Adagrad makes its sums at construction,
    at step 0: that is not a step)."""
    return any(not isinstance(st, dict) or float(st.get("step", 1)) > 0 for st in optimizer.state.values())


def _foreign(cls: type) -> Optional[type[_Spec]]:
    """The spec of another library's 8-bit AdamW class, by its module and name (FOREIGN_8BIT)."""
    return FOREIGN_8BIT.get((cls.__module__, cls.__name__))


def spec_from_torch(optimizer: torch.optim.Optimizer, *, scheduled: bool = False) -> _Spec:
    """The spec that runs ``optimizer`` in tiermem: its class (by :data:`TORCH_OPTIMIZERS`: fused; a
    class not in it, a subclass of one too, since it may change the update: generic), its param
    groups in order, each with its hyperparameters. Refused: an optimizer that has stepped (tiermem never steps
    it, so its state would be lost) or one an lr scheduler was built on (that scheduler would set
    the lr of an optimizer nobody steps: build it on ``tm.optimizer``), unless ``scheduled``: the
    caller moves that scheduler onto tiermem's optimizer (the Trainer integration does)."""
    cls = type(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"tiermem: optimizer={cls.__module__}.{cls.__qualname__} is not a torch.optim.Optimizer; pass "
            f"one built on the model's parameters, or a tiermem spec ({supported_names()}, tiermem.AdamW, ...)"
        )
    if _stepped(optimizer):
        raise ConfigError(
            f"tiermem: the {cls.__name__} given as optimizer= has state for {len(optimizer.state)} "
            f"parameters (it has stepped); tiermem runs the update itself and never steps it: pass a "
            f"new one, and load a checkpoint with tm.load()"
        )
    if not scheduled and any("initial_lr" in g for g in optimizer.param_groups):
        raise ConfigError(
            f"tiermem: an lr scheduler was built on the {cls.__name__} given as optimizer=; it would "
            f"set the lr of an optimizer tiermem never steps: build the scheduler on tm.optimizer, "
            f"after the TieredModel"
        )
    defaults = optimizer.defaults
    if not fused(cls):  # no fused kernel: its own step() (NOTE [Generic optimizers])
        groups = [{k: v for k, v in g.items() if k != "initial_lr"} for g in optimizer.param_groups]
        return GenericSpec(groups, optimizer=optimizer)
    log.info("tiermem: %s runs with its fused kernel (tiermem.optim)", cls.__qualname__)
    spec = TORCH_OPTIMIZERS[cls](defaults) if cls in TORCH_OPTIMIZERS else _foreign(cls)
    assert spec is not None
    if cls not in TORCH_OPTIMIZERS:  # another library's 8-bit AdamW: only the keys tiermem's takes
        return _foreign_spec(spec, optimizer)
    groups = [{k: v for k, v in g.items() if k != "initial_lr"} for g in optimizer.param_groups]
    decoupled = spec is AdamW
    for g in groups:  # torch.optim.Adam's groups may differ from its defaults in decoupled_weight_decay
        if cls is torch.optim.AdamW or g.get("decoupled_weight_decay", decoupled) == decoupled:
            g.pop("decoupled_weight_decay", None)
    try:
        return spec(groups, **{k: defaults[k] for k in spec.HYPER if k in defaults})
    except ConfigError as e:
        raise ConfigError(
            f"tiermem: the {cls.__name__} given as optimizer=: {str(e).removeprefix('tiermem: ')}"
        ) from None


#: options of the other libraries' 8-bit AdamW that change its numbers, with the value that does not
#: (their default); any other value is refused by name
_FOREIGN_PLAIN: dict[str, Any] = {
    "amsgrad": False,
    "percentile_clipping": 100,
    "max_unorm": 0.0,
    "optim_bits": 8,
    "block_size": 256,
}


def _foreign_spec(spec: type[_Spec], optimizer: torch.optim.Optimizer) -> _Spec:
    """An 8-bit AdamW of bitsandbytes or torchao as tiermem's: its groups' lr, betas, eps and
    weight decay; block size and maps are tiermem's own (NOTE [8-bit state])."""
    cls, defaults = type(optimizer), optimizer.defaults
    groups = [{k: v for k, v in g.items() if k == "params" or k in spec.HYPER} for g in optimizer.param_groups]
    kwargs = {k: defaults[k] for k in spec.HYPER if k in defaults}
    for key in ("min_8bit_size", "bf16_stochastic_round"):  # bitsandbytes' threshold; torchao's rounding
        if key in defaults:
            kwargs[key] = defaults[key]
    changed = [f"{k}={defaults[k]!r}" for k, plain in _FOREIGN_PLAIN.items() if k in defaults and defaults[k] != plain]
    if changed:
        raise ConfigError(
            f"tiermem: the {cls.__name__} given as optimizer= sets {', '.join(changed)}, which tiermem's "
            f"8-bit Adam does not do; leave {', '.join(c.partition('=')[0] for c in changed)} at "
            f"{', '.join(repr(_FOREIGN_PLAIN[c.partition('=')[0]]) for c in changed)}"
        )
    try:
        return spec(groups, **kwargs)
    except ConfigError as e:
        raise ConfigError(
            f"tiermem: the {cls.__name__} given as optimizer=: {str(e).removeprefix('tiermem: ')}"
        ) from None


def stepped_elsewhere(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A step pre-hook for an optimizer tiermem read: stepping it would do nothing (its parameters'
    gradients go to tiermem), silently; this says what to call instead."""
    raise TierMemError(
        f"tiermem: this {type(optimizer).__name__} was given to a TieredModel, which runs its update "
        f"where the optimizer state lives; call tm.step() (or tm.optimizer.step()) instead of its step()"
    )
