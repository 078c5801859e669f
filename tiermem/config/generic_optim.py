"""Any other ``torch.optim.Optimizer`` run by its own ``step()`` inside TieredModel (the generic path).

# NOTE [Generic optimizers]
An optimizer class without a fused kernel (torch's RAdam, NAdam, Rprop, ASGD, Adamax, RMSprop, a
user's own subclass, ...) runs generically, as torchao's CPUOffloadOptimizer runs any optimizer
class: its own ``step()`` on the fp32 master weights where the optimizer state lives (the host, the
device, or NVMe streamed through the host), so its numbers are that optimizer's in a plain fp32 loop.
- The state's layout is learnt up front by a *probe*: a copy of the optimizer (never the user's
  instance) steps once on a small parameter per distinct param-group setting, and each state entry
  it makes must be a tensor of the parameter's shape (elementwise: ``exp_avg``) or a one-element
  tensor (``step``, NAdam's ``mu_product``); anything else (a Python number, a factored shape) is
  refused by name, and so is an optimizer whose step fails without a closure (LBFGS) or with dense
  gradients (SparseAdam). Those entries become the parts of the parameters' state format, so the
  homes keep, count, stream and checkpoint them like any fused optimizer's (NOTE [State formats]).
- At each step (tiermem.train.step.generic_step), per bucket: one leaf tensor per parameter, kept for the
  life of the model (the optimizer's ``state`` is keyed by it), is pointed at the parameter's slice of
  the master buffer, its ``.grad`` at the gradient (unscaled and clipped first when needed), its state
  entries at the slices of the part buffers, and the optimizer steps once over the bucket with the
  hyperparameters of its group as ``tm.optimizer.param_groups`` holds them now (lr schedulers drive
  them). A parameter's first step lets the optimizer make its state; it is then copied into the
  parts. Entries the optimizer rebinds instead of updating in place are copied back after the step.
- Every part but the master is not elementwise in the DP sense (a one-element part per parameter),
  so data parallelism, which cuts parameters at chunk edges, refuses the generic path
  (``process_group=False`` runs it on a full replica per process).
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, NamedTuple, Sequence

import torch

from tiermem.config.kinds import Kind
from tiermem.config.specs import _number, _Spec, read_groups
from tiermem.errors import ConfigError, checked_arguments

log = logging.getLogger(__name__)

__all__ = ["GenericPart", "GenericSpec", "fresh_copy", "probe"]


class GenericPart(NamedTuple):
    """One entry of a parameter's state under a generic optimizer: its key, dtype and whether it has
    the parameter's shape (else one element)."""

    name: str
    dtype: torch.dtype
    elementwise: bool


def fresh_copy(optimizer: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """A shallow copy of ``optimizer`` (its class, defaults and attributes) with ``groups``, no state
    and none of its step hooks: what TieredModel steps (NOTE [Generic optimizers])."""
    inner = copy.copy(optimizer)
    inner.state = defaultdict(dict)
    inner.param_groups = groups
    inner._optimizer_step_pre_hooks = OrderedDict()
    inner._optimizer_step_post_hooks = OrderedDict()
    return inner


def probe(optimizer: torch.optim.Optimizer, hypers: Sequence[Mapping[str, Any]]) -> tuple[GenericPart, ...]:
    """The state entries ``optimizer``'s class makes for a parameter, learnt by stepping a copy once
    on a small fp32 parameter under each of ``hypers`` (its groups' settings); a ``tiermem:`` error
    when a step fails or the entries are not of a layout tiermem homes (NOTE [Generic optimizers])."""
    name = type(optimizer).__qualname__
    found: dict[tuple, tuple[GenericPart, ...]] = {}
    for hyper in hypers:
        p = torch.zeros(3, 5)
        p.grad = torch.linspace(-1.0, 1.0, 15).view(3, 5)
        inner = fresh_copy(optimizer, [{**hyper, "params": [p]}])
        try:
            inner.step()
        except Exception as e:  # noqa: BLE001  (any error of a user's step: said, with what tiermem needs)
            raise ConfigError(
                f"tiermem: optimizer={name} could not be run generically: its step() failed on a probe "
                f"({type(e).__name__}: {str(e)[:160]}); tiermem calls step() without a closure, on dense "
                f"fp32 gradients: pass an optimizer that steps so"
            ) from None
        if not inner.state[p] and bool((p == 0).all()):
            raise ConfigError(
                f"tiermem: optimizer={name}'s step() neither changed a probe parameter nor made state for "
                f"it; the generic path steps the parameters of param_groups (as torch optimizers do): "
                f"pass an optimizer that reads its param groups, with an lr that is not 0"
            )
        parts = []
        for key, value in inner.state[p].items():
            if not isinstance(key, str) or not isinstance(value, torch.Tensor):
                raise ConfigError(
                    f"tiermem: optimizer={name} keeps state[{key!r}] as a {type(value).__name__}; the generic "
                    f"path homes tensors only (of the parameter's shape, or of one element): pass another "
                    f"optimizer, or one of those tiermem runs fused (tiermem.optimizers())"
                )
            if tuple(value.shape) == tuple(p.shape):
                parts.append(GenericPart(key, value.dtype, True))
            elif value.numel() == 1:
                parts.append(GenericPart(key, value.dtype, False))
            else:
                raise ConfigError(
                    f"tiermem: optimizer={name} keeps state[{key!r}] of shape {tuple(value.shape)} for a "
                    f"parameter of shape {tuple(p.shape)}; the generic path homes state of the parameter's "
                    f"shape or of one element: pass another optimizer"
                )
        found[tuple(sorted(hyper.items(), key=lambda kv: kv[0]))] = tuple(parts)
    layouts = set(found.values())
    if len(layouts) > 1:
        raise ConfigError(
            f"tiermem: optimizer={name} keeps other state entries in some param groups than in others "
            f"({sorted({tuple(q.name for q in parts) for parts in layouts})}); the generic path keeps "
            f"one layout for all: give every group the settings that choose the state (e.g. amsgrad)"
        )
    return next(iter(layouts))


@checked_arguments
@dataclass(frozen=True, kw_only=True, repr=False)
class GenericSpec(_Spec):
    """A torch optimizer of a class without a fused kernel, run by its own ``step()`` (NOTE [Generic
    optimizers]); built by :func:`tiermem.config.torch_optim.spec_from_torch`, not by hand.

    Args:
        params: the optimizer's param groups (NOTE [Param groups]).
        optimizer: the torch optimizer given (never stepped: a copy of it is).
    """

    optimizer: Any = field(default=None, compare=False)
    #: the state entries of each parameter, learnt by :func:`probe`
    parts: tuple[GenericPart, ...] = field(init=False, default=(), compare=False)

    kind: ClassVar[Kind] = Kind.GENERIC
    HYPER: ClassVar[tuple[str, ...]] = ()
    OFF: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        opt = self.optimizer
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError("tiermem: GenericSpec takes optimizer=, a torch.optim.Optimizer")
        what = type(opt).__qualname__
        defaults = self.defaults
        keys = dict.fromkeys(defaults)  # and any other key a group holds: the optimizer's own step may read it
        for g in self.params if isinstance(self.params, (list, tuple)) else ():
            if isinstance(g, dict):
                keys.update(dict.fromkeys(k for k in g if k not in ("params", "name", "param_names")))
        groups = read_groups(
            f"{what}.", self.params, hyper=tuple(keys), off=(), rules={k: "generic" for k in keys}, what=what
        )
        object.__setattr__(self, "params", groups)
        object.__setattr__(self, "_member", {id(t): i for i, g in enumerate(groups) for t in g.params})
        hypers = [{**defaults, **g.overrides} for g in groups]
        object.__setattr__(self, "parts", probe(opt, hypers))
        log.info(
            "tiermem: %s has no fused kernel: it runs generically, its own step() on the fp32 master "
            "weights where the state lives (state per parameter: %s)",
            what,
            ", ".join(f"{q.name} {'elementwise' if q.elementwise else 'one value'}" for q in self.parts) or "none",
        )

    @property
    def defaults(self) -> dict[str, Any]:
        """The optimizer's defaults: every key its groups hold, as torch built them."""
        return {k: _number(v) for k, v in self.optimizer.defaults.items()}

    def group_defaults(self) -> dict[str, Any]:
        return self.defaults

    def group_values(self, name: str) -> list[Any]:
        return [g.overrides.get(name, self.defaults.get(name)) for g in self.param_groups()]

    def state_options(self) -> dict[str, Any]:
        return {"generic_parts": self.parts, "optimizer": self.optimizer}

    def __repr__(self) -> str:
        groups = "" if self.params is None else f"<{len(self.params)} param groups>, "
        return f"GenericSpec({groups}optimizer={type(self.optimizer).__qualname__})"
