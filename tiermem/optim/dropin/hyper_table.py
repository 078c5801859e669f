"""A drop-in's hyperparameters as one table: each declared once, with its default, its rule and the
field of the update's record it fills; the constructor's signature, the param groups' defaults, the
checks of a group and the hyperparameters of a step are all read from it (tiermem/optim/dropin/shared.py).

The signature is torch's: ``params``, then the hyperparameters torch takes positionally, then the
keyword-only ones (the table's order), then the settings every drop-in shares (``check_finite``,
``bf16_stochastic_round``, ``sr_seed``). Rules are the named rules of tiermem/config/rules.py (NOTE
[Adam hyperparameter rules]), so a drop-in, a spec and a functional entry check a name alike.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterable, NamedTuple, Optional, Union

import torch

from tiermem.config.rules import check_hyper, invalid
from tiermem.optim.arg_checks import as_number

Number = Union[float, torch.Tensor]
Params = Union[Iterable[torch.Tensor], Iterable[dict[str, Any]]]


class Pair(NamedTuple):
    """The rule of a pair of numbers (Lion's ``betas``, Adafactor's ``eps``): two values, each checked
    by the rule of its own name (``rules``); ``must`` says what the pair must be."""

    must: str
    rules: tuple[str, str]


class Hyper(NamedTuple):
    """One hyperparameter of a drop-in."""

    name: str
    default: Any
    #: the rule of tiermem/config/rules.py it is checked by (by name), or a pair's
    rule: Union[str, Pair]
    #: the fields of the step's record (SGDHyper, AdamHyper, ...) it fills: None its own name (a pair:
    #: its rules' names), () none (a value the state starts from, not the update)
    to: Optional[tuple[str, ...]] = None
    annotation: Any = float
    #: keyword-only in the constructor (torch takes it so)
    keyword_only: bool = False
    #: the optimizer's, not a param group's: kept as an attribute, checked on construction
    setting: bool = False
    #: a one-element tensor is checked as the number it holds (torch allows a tensor lr)
    tensor_ok: bool = False

    @property
    def fields(self) -> tuple[str, ...]:
        if self.to is not None:
            return self.to
        return self.rule.rules if isinstance(self.rule, Pair) else (self.name,)


def lr(default: float) -> Hyper:
    """The learning rate: a number, or a one-element tensor (torch allows one) checked as its number."""
    return Hyper("lr", default, "lr", annotation=Number, tensor_ok=True)


#: what every drop-in takes after its hyperparameters (tiermem/optim/dropin/shared.py checks them)
SHARED = (
    inspect.Parameter("check_finite", inspect.Parameter.KEYWORD_ONLY, default=True, annotation=bool),
    inspect.Parameter("bf16_stochastic_round", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=bool),
    inspect.Parameter("sr_seed", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Optional[int]),
)


def signature(table: tuple[Hyper, ...]) -> inspect.Signature:
    """The constructor's signature: ``self, params``, the table's hyperparameters, the shared settings."""
    out = [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("params", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Params),
    ]
    for h in table:
        how = inspect.Parameter.KEYWORD_ONLY if h.keyword_only or h.setting else inspect.Parameter.POSITIONAL_OR_KEYWORD
        out.append(inspect.Parameter(h.name, how, default=h.default, annotation=h.annotation))
    return inspect.Signature([*out, *SHARED], return_annotation=None)


def check(where: str, table: tuple[Hyper, ...], values: dict[str, Any]) -> None:
    """Each of ``values`` (a param group, or the settings) against its rule; the error names ``where``
    (``"CPUSGD "``), the hyperparameter and the value. A pair's shape is checked before its numbers."""
    named: dict[str, Any] = {}
    for h in table:
        if h.name not in values:
            continue
        v = values[h.name]
        if isinstance(h.rule, Pair):
            if not (isinstance(v, (tuple, list)) and len(v) == 2):
                raise invalid(where, h.name, v, h.rule.must)
            named.update(zip(h.rule.rules, v))
        else:
            named[h.rule] = as_number(v) if h.tensor_ok else v
    check_hyper(where, **named)


def record(table: tuple[Hyper, ...], group: dict[str, Any]) -> dict[str, Any]:
    """The step record's fields a param group's values fill (a pair split into its two)."""
    out: dict[str, Any] = {}
    for h in table:
        fields = h.fields
        if len(fields) == 1:
            out[fields[0]] = group[h.name]
        elif fields:
            out.update(zip(fields, group[h.name]))
    return out
