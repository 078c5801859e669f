"""``tm.optimizer.param_groups``: the plan's param groups as torch optimizer groups, and the
changes a user makes to them (``add_param_group``) checked and applied.

A group is a dict as torch keeps it (``params``, ``lr``, ``betas``, ``eps``, ``weight_decay``)
plus tiermem's ``name``, ``param_names`` (canonical names, the group's membership: NOTE [Param
groups] in tiermem/config/specs.py) and ``adamw``. ``params`` shows each parameter's fp32 value: its
master weights where the optimizer state lives (a meta tensor when that is NVMe), or the fp32 copy
of a frozen parameter that has no state yet.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Mapping

import torch

from tiermem.config.specs import _Spec, read_groups
from tiermem.errors import ConfigError, TierMemError
from tiermem.plan.placement import ParamGroup
from tiermem.train.layout import Layout

log = logging.getLogger(__name__)

#: what each group dict holds besides the hyperparameters
MEMBERS = ("params", "param_names", "name")


class Fp32Values:
    """The fp32 tensor a group shows for each parameter, by name: its master where its optimizer
    state lives; for a frozen parameter that has no state (yet), its host copy or the parameter
    itself (NOTE [Frozen weights keep one copy])."""

    def __init__(self, module: torch.nn.Module, layout: Layout):
        self.module, self.layout = module, layout

    def __call__(self, name: str) -> torch.Tensor:
        if name in self.layout.frozen:
            return self.layout.frozen.shown(name)
        b, s = self.layout.slot_of[id(self.module.get_parameter(name))]
        return self.layout.homes.state[b.index].master(b, s)


def group_dicts(groups: Iterable[ParamGroup], spec: _Spec, value_of: Callable[[str], torch.Tensor]) -> list[dict]:
    """The torch optimizer groups of the plan's ``groups``: the group's own hyperparameters over
    the spec's; ``value_of(name)``: the fp32 tensor shown for a parameter."""
    out = []
    for g in groups:
        names = [*g.params, *g.frozen]
        out.append(
            {
                "params": [value_of(n) for n in names],
                "param_names": names,
                "name": g.name,
                **spec.group_defaults(),
                **g.options,
            }
        )
    return out


def membership(groups: list[dict]) -> dict[str, int]:
    """Canonical parameter name -> index of the group that lists it."""
    return {name: i for i, g in enumerate(groups) for name in g["param_names"]}


class GroupEditor:
    """Applies ``tm.optimizer.add_param_group(group)`` as torch does, for a model whose every
    trainable parameter is already in a group: the parameters given leave the group they were in
    (their optimizer state stays theirs) and are trained with the new group's hyperparameters
    from the next step; a parameter in no group yet (a frozen one) joins it, and is trained in it
    once unfrozen (tiermem.train.step.trainable). The new group is checked whole before anything
    changes: parameters of the wrapped module, each once, floating point; the hyperparameters by
    the spec's rules, those left out the spec's."""

    def __init__(self, module: torch.nn.Module, spec: _Spec, value_of: Callable[[str], torch.Tensor]):
        self.spec, self.value_of = spec, value_of
        self._names: dict[int, str] = {}  # id(parameter) -> its canonical name (tied aliases: the first)
        for name, p in module.named_parameters(remove_duplicate=False):
            self._names.setdefault(id(p), name)

    def add(self, groups: list[dict], group: Any) -> None:
        if not isinstance(group, Mapping):
            raise ConfigError(
                f"tiermem: add_param_group() takes one group, a dict with 'params' (as torch), not a "
                f"{type(group).__name__}"
            )
        given = {k: v for k, v in group.items() if k not in ("adamw",)}
        if "name" not in given:
            given["name"] = f"group{len(groups)}"
        spec = self.spec
        (read,) = read_groups(
            f"add_param_group(): group {len(groups)}'s ",
            [given],
            hyper=spec.HYPER,
            off=spec.OFF,
            rules=spec.RULES,
            what=spec.WHAT,
        )
        taken = {g["name"] for g in groups}
        if read.name in taken:
            raise ConfigError(
                f"tiermem: add_param_group(): a group named {read.name!r} exists already; give the new "
                f"group another 'name'"
            )
        names = [self._name_of(t, groups) for t in read.params]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(
                f"tiermem: add_param_group(): the group lists {twice} twice (tied weights are one "
                f"parameter); list each parameter once"
            )
        where = membership(groups)
        moved: dict[str, list[str]] = {}
        for name in names:  # checked: now the change
            if name in where:
                old = groups[where[name]]
                i = old["param_names"].index(name)
                del old["param_names"][i], old["params"][i]
                moved.setdefault(old["name"], []).append(name)
        groups.append(
            {
                "params": [self.value_of(n) for n in names],
                "param_names": names,
                "name": read.name,
                **self.spec.group_defaults(),
                **read.overrides,
            }
        )
        for source, which in moved.items():
            log.info(
                "tiermem: add_param_group(): %d parameters move from group %r to %r (their optimizer state "
                "with them): %s",
                len(which),
                source,
                read.name,
                ", ".join(which[:5]),
            )

    def _name_of(self, t: torch.Tensor, groups: list[dict]) -> str:
        """The canonical name of a parameter given to add_param_group: the module's parameter
        itself, or the fp32 tensor a group shows for it."""
        name = self._names.get(id(t))
        if name is None:
            name = next((n for g in groups for p, n in zip(g["params"], g["param_names"]) if p is t), None)
        if name is None:
            raise ConfigError(
                f"tiermem: add_param_group(): a tensor of shape {tuple(t.shape)} is not a parameter of "
                f"the wrapped module; give its parameters (e.g. model.layers[0].parameters())"
            )
        return name


def check_listed(groups: list[dict], names: Iterable[str]) -> dict[str, int]:
    """The group of each of ``names`` (parameters about to be trained); a ``tiermem:`` error
    names those no group lists (a param group list edited by hand, or a parameter unfrozen that
    was left out of the optimizer's groups)."""
    where = membership(groups)
    missing = [n for n in names if n not in where]
    if missing:
        raise TierMemError(
            f"tiermem: {missing[:5]} {'is' if len(missing) == 1 else 'are'} to be trained but in no "
            f"param group of tm.optimizer; add them with tm.optimizer.add_param_group({{'params': "
            f"[...]}}) or freeze them (requires_grad_(False))"
        )
    return {n: where[n] for n in names}


def hyper_of(group: dict) -> dict[str, Any]:
    """The hyperparameters the update reads from a group, as they are at this moment (the kernel of
    the state format picks its own by name into its record: tiermem.optim.formats.hyper_record)."""
    return {k: v for k, v in group.items() if k not in MEMBERS}
