"""The one registry of optimizer kinds (``FAMILIES``): for each :class:`~tiermem.config.kinds.Kind`,
the state tensors it keeps beside the master weights, the kernel that updates them and the typed
record of hyperparameters that kernel reads.

Three readers, one table: :func:`tiermem.optim.formats.state_format` (what a parameter's state is
made of inside TieredModel: plans, budgets, homes, NVMe keys, checkpoints), :func:`tiermem.optim.formats.update`
(the fused update a bucket's piece of state gets, its record made once a step by
:func:`tiermem.optim.formats.hyper_record`: NOTE [Checked once a step]) and :func:`state_layout` (the same tensors, master
left out, for a parameter's shape: what the functional entries take, in their positional order,
Adafactor's by keyword). A kind without a row here is an error everywhere, never a default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from tiermem.config.kinds import KINDS, Kind
from tiermem.errors import ConfigError
from tiermem.optim import adafactor as _factored, functional as _functional, steps as _steps
from tiermem.optim.adafactor import AdafactorHyper, state_numels as _factored_numels
from tiermem.optim.adam_hyper import Adam8bitHyper, AdamHyper
from tiermem.optim.arg_checks import make_hyper
from tiermem.optim.hypers import AdagradHyper, LionHyper, SGDHyper
from tiermem.optim.kernels import dispatch as _run, quant as _quant

F32 = torch.float32
Tensor = torch.Tensor
Dims = Optional[Sequence[int]]


@dataclass(frozen=True)
class StatePart:
    """One tensor of a parameter's state: its name, dtype, one element per ``block`` elements of the
    parameter (1: elementwise), and the value it starts at (moments 0; Adagrad's sum its
    ``initial_accumulator_value``). ``factored``: its elements follow the parameter's shape, as
    :func:`tiermem.optim.adafactor.state_numels` counts the part of this name (NOTE [State formats])."""

    name: str
    dtype: torch.dtype
    block: int = 1
    initial: float = 0.0
    factored: bool = False
    #: one element per parameter, whatever its size (a generic optimizer's ``step``: NOTE [Generic optimizers])
    per_parameter: bool = False
    #: the part holding the absmax of this quantized part's blocks (8-bit moments: NOTE [8-bit state])
    scale: Optional[str] = None

    def numel(self, n: int, shape: Optional[Sequence[int]] = None) -> int:
        """Elements of this part for a parameter of ``n`` elements (of ``shape``: a factored part
        needs it; without it, a factored part counts as a vector's, ``n``)."""
        if self.per_parameter:
            return 1
        if self.factored:
            dims = (n,) if shape is None else tuple(int(d) for d in shape)
            if math.prod(dims) != n:
                raise ConfigError(f"tiermem: state part {self.name}: shape {dims} does not have {n} elements")
            return _factored_numels(dims).get(self.name, 0)
        return n if self.block == 1 else -(-n // self.block)

    @property
    def elementwise(self) -> bool:
        """One element per parameter element, whatever its shape."""
        return self.block == 1 and not self.factored and not self.per_parameter

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


@dataclass(frozen=True)
class PartOptions:
    """What a kind's state parts depend on besides the kind (a spec's ``state_options``)."""

    momentum: bool = False
    initial_accumulator_value: float = 0.0
    #: a generic optimizer's entries, as its probe found them (NOTE [Generic optimizers])
    generic_parts: Sequence[Any] = ()


#: ``update(master, state, grad, out, record, shape, stochastic_round)``: one fused update into ``out``,
#: its hyperparameters one checked record (the kind's ``record``; NOTE [Checked once a step]), the
#: gradients known to be finite
Update = Callable[
    [torch.Tensor, Sequence[torch.Tensor], torch.Tensor, Optional[torch.Tensor], Any, Dims, Optional[Any]], None
]

#: ``record(hyper, step, grad_scale, clip_coef)``: a param group's hyperparameters (torch's names) as the
#: kind's typed record, checked by the rules of the kind's functional entry (its errors name the entry)
Record = Callable[[Mapping[str, Any], int, float, float], Any]


@dataclass(frozen=True)
class Family:
    """A kind's row: its state ``parts`` (master excluded), its fused ``update`` (None: the optimizer
    steps itself, NOTE [Generic optimizers]) and the ``record`` of hyperparameters it takes, whether a
    parameter's state may be cut into pieces (``divisible``: not a factored state nor a generic
    optimizer's), and the kind a parameter below ``min_8bit_size`` elements falls back to (``small``:
    8-bit Adam keeps fp32 moments there)."""

    parts: Callable[[PartOptions], tuple[StatePart, ...]]
    update: Optional[Update]
    record: Optional[Record] = None
    divisible: bool = True
    small: Optional[Kind] = None


def _adam_parts(o: PartOptions) -> tuple[StatePart, ...]:
    return StatePart("exp_avg", F32), StatePart("exp_avg_sq", F32)


def _adam8bit_parts(o: PartOptions) -> tuple[StatePart, ...]:
    b = _quant.BLOCK
    return (
        StatePart("exp_avg", torch.uint8, scale="exp_avg_absmax"),
        StatePart("exp_avg_absmax", F32, b),
        StatePart("exp_avg_sq", torch.uint8, scale="exp_avg_sq_absmax"),
        StatePart("exp_avg_sq_absmax", F32, b),
    )


def _sgd_parts(o: PartOptions) -> tuple[StatePart, ...]:
    return (StatePart("momentum_buffer", F32),) if o.momentum else ()


def _adagrad_parts(o: PartOptions) -> tuple[StatePart, ...]:
    return (StatePart("state_sum", F32, initial=float(o.initial_accumulator_value)),)


def _lion_parts(o: PartOptions) -> tuple[StatePart, ...]:
    return (StatePart("exp_avg", F32),)


def _adafactor_parts(o: PartOptions) -> tuple[StatePart, ...]:
    # a matrix keeps row_var and col_var, a vector variance (NOTE [State formats])
    return tuple(StatePart(name, F32, factored=True) for name in ("row_var", "col_var", "variance"))


def _generic_parts(o: PartOptions) -> tuple[StatePart, ...]:
    # its entries as the probe found them (NOTE [Generic optimizers])
    return tuple(StatePart(q.name, q.dtype, per_parameter=not q.elementwise) for q in o.generic_parts)


def _given(hyper: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    """The group's values of ``keys`` (torch's names, which are the record's fields)."""
    return {k: hyper[k] for k in keys}


def _adam_record(cls: Callable[..., Any]) -> Record:
    """The record maker of Adam's ``cls`` (AdamHyper, or Adam8bitHyper, whose errors name adam8bit_step)."""

    def make(hyper: Mapping[str, Any], step: int, grad_scale: float, clip_coef: float) -> Any:
        beta1, beta2 = hyper["betas"]
        values = _given(hyper, "lr", "eps", "weight_decay", "adamw")
        return make_hyper(
            cls, step=step, beta1=beta1, beta2=beta2, grad_scale=grad_scale, clip_coef=clip_coef, **values
        )

    return make


def _sgd_record(hyper: Mapping[str, Any], step: int, grad_scale: float, clip_coef: float) -> Any:
    values = _given(hyper, "lr", "momentum", "dampening", "nesterov", "weight_decay", "maximize")
    return make_hyper(SGDHyper, step=step, grad_scale=grad_scale, clip_coef=clip_coef, **values)


def _adagrad_record(hyper: Mapping[str, Any], step: int, grad_scale: float, clip_coef: float) -> Any:
    values = _given(hyper, "lr", "lr_decay", "weight_decay", "eps", "maximize")
    return make_hyper(AdagradHyper, step=step, grad_scale=grad_scale, clip_coef=clip_coef, **values)


def _lion_record(hyper: Mapping[str, Any], step: int, grad_scale: float, clip_coef: float) -> Any:
    beta1, beta2 = hyper["betas"]
    values = dict(lr=hyper["lr"], lion_beta1=beta1, lion_beta2=beta2, weight_decay=hyper["weight_decay"])
    return make_hyper(LionHyper, step=step, grad_scale=grad_scale, clip_coef=clip_coef, **values)


def _adafactor_record(hyper: Mapping[str, Any], step: int, grad_scale: float, clip_coef: float) -> Any:
    eps1, eps2 = hyper["eps"]
    values = _given(hyper, "lr", "beta2_decay", "d", "weight_decay", "maximize")
    return make_hyper(
        AdafactorHyper, step=step, eps1=eps1, eps2=eps2, grad_scale=grad_scale, clip_coef=clip_coef, **values
    )


def _adam(
    master: Tensor, state: Sequence[Tensor], grad: Tensor, out: Optional[Tensor], hyper: Any, shape: Dims, sr: Any
) -> None:
    _functional.adam_update(
        master, state[0], state[1], grad, out, hyper, check_finite=False, impl=None, stochastic_round=sr
    )


def _adam8bit(
    master: Tensor, state: Sequence[Tensor], grad: Tensor, out: Optional[Tensor], hyper: Any, shape: Dims, sr: Any
) -> None:
    _steps.adam8bit_update(master, state[:4], grad, out, hyper, check_finite=False, impl=None, stochastic_round=sr)


def _elementwise(kernel: _run.Kernel) -> Update:
    """The update of an elementwise kind whose one state tensor ``kernel`` takes (Adagrad, Lion)."""

    def update(
        master: Tensor, state: Sequence[Tensor], grad: Tensor, out: Optional[Tensor], hyper: Any, shape: Dims, sr: Any
    ) -> None:
        _run.run(kernel, master, (state[0],), grad, out, hyper, check_finite=False, impl=None, stochastic_round=sr)

    return update


def _sgd(
    master: Tensor, state: Sequence[Tensor], grad: Tensor, out: Optional[Tensor], hyper: Any, shape: Dims, sr: Any
) -> None:
    momentum = hyper.momentum
    buffer = state[0] if state else None
    if (momentum != 0) != (buffer is not None):
        raise ConfigError(
            f"tiermem: a param group's SGD momentum is {momentum} but the optimizer state was made "
            f"{'with' if buffer is not None else 'without'} a momentum buffer; set momentum "
            f"{'> 0' if buffer is not None else '= 0'} in every group, or give the optimizer a "
            f"momentum > 0 from the start"
        )
    _run.run(_run.SGD, master, (buffer,), grad, out, hyper, check_finite=False, impl=None, stochastic_round=sr)


def _adafactor(
    master: Tensor, state: Sequence[Tensor], grad: Tensor, out: Optional[Tensor], hyper: Any, shape: Dims, sr: Any
) -> None:
    dims = tuple(master.shape) if shape is None else tuple(shape)
    # a matrix's pieces are row_var and col_var, a vector's variance (the other layout's have 0 elements)
    row_var, col_var, variance = (state[0], state[1], None) if len(dims) >= 2 else (None, None, state[2])
    dims, pieces = _factored.factored_state(master, dims, row_var, col_var, variance)
    _factored.adafactor_update(
        master, grad, pieces, dims, out, hyper, check_finite=False, impl=None, stochastic_round=sr
    )


#: every kind's row; each member of Kind has one (tests/test_optim_formats.py checks)
FAMILIES: Mapping[Kind, Family] = {
    Kind.ADAM: Family(_adam_parts, _adam, _adam_record(AdamHyper)),
    Kind.ADAMW: Family(_adam_parts, _adam, _adam_record(AdamHyper)),
    Kind.ADAM8BIT: Family(_adam8bit_parts, _adam8bit, _adam_record(Adam8bitHyper), small=Kind.ADAM),
    Kind.ADAMW8BIT: Family(_adam8bit_parts, _adam8bit, _adam_record(Adam8bitHyper), small=Kind.ADAMW),
    Kind.SGD: Family(_sgd_parts, _sgd, _sgd_record),
    Kind.ADAGRAD: Family(_adagrad_parts, _elementwise(_run.ADAGRAD), _adagrad_record),
    Kind.LION: Family(_lion_parts, _elementwise(_run.LION), _lion_record),
    # a factored state and a generic optimizer's own step() take whole parameters: cut only at edges
    Kind.ADAFACTOR: Family(_adafactor_parts, _adafactor, _adafactor_record, divisible=False),
    Kind.GENERIC: Family(_generic_parts, None, divisible=False),
}


def kind_of(value: Any, where: str) -> Kind:
    """``value`` as a :class:`Kind`; an unknown name is a :class:`ConfigError` naming ``where``."""
    try:
        return Kind(value)
    except ValueError:
        raise ConfigError(f"tiermem: {where} kind={value!r} is unknown; pass one of {KINDS}") from None


def family(kind: Kind, numel: Optional[int], min_8bit_size: int) -> tuple[Kind, Family]:
    """The kind and row a parameter of ``numel`` elements (None: unknown, a small one) gets under
    ``kind``: 8-bit Adam's ``small`` kind below ``min_8bit_size`` elements (NOTE [8-bit state])."""
    fam = FAMILIES[kind]
    if fam.small is not None and (numel is None or numel < min_8bit_size):
        return fam.small, FAMILIES[fam.small]
    return kind, fam


def state_layout(
    kind: str, shape: Sequence[int], *, momentum: float = 0.0, min_8bit_size: int = _quant.MIN_8BIT_NUMEL
) -> dict[str, tuple[int, torch.dtype]]:
    """name -> (elements, dtype) of the state (master weights left out) of one parameter of ``shape``
    under ``kind``, in the order the functional entry takes them: :data:`FAMILIES`' parts, counted for
    this shape (an absent factored part left out). SGD has a ``momentum_buffer`` only with
    ``momentum``; 8-bit Adam keeps fp32 moments (Adam's layout) below ``min_8bit_size`` elements (NOTE
    [8-bit state]).

    Args:
        kind: ``"adam"``, ``"adamw"``, ``"adam8bit"``, ``"adamw8bit"``, ``"sgd"``, ``"adagrad"``,
            ``"lion"`` or ``"adafactor"`` (a :class:`Kind`).
        shape: the parameter's shape.
        momentum: SGD's momentum (a buffer exists only when it is not 0).
        min_8bit_size: the fewest elements 8-bit Adam keeps 8-bit moments for.
    """
    known = kind_of(kind, "state_layout")
    if FAMILIES[known].update is None:
        raise ConfigError(
            f"tiermem: state_layout kind={kind!r} has no fixed layout (a generic optimizer keeps what its "
            f"probe finds); pass a kind tiermem has a kernel for"
        )
    dims = tuple(int(s) for s in shape)
    n = math.prod(dims)
    _, fam = family(known, n, min_8bit_size)
    parts = fam.parts(PartOptions(momentum=momentum != 0))
    factored = _factored_numels(dims)  # the factored parts this shape has (a matrix's or a vector's)
    return {p.name: (p.numel(n, dims), p.dtype) for p in parts if not p.factored or p.name in factored}


def state_bytes(kind: str, shape: Sequence[int], **options: Any) -> int:
    """The bytes of :func:`state_layout`'s tensors.

    Args:
        kind: as :func:`state_layout` takes it.
        shape: the parameter's shape.
        **options (Any): :func:`state_layout`'s keywords (``momentum``, ``min_8bit_size``).
    """
    return sum(k * torch.empty((), dtype=dt).element_size() for k, dt in state_layout(kind, shape, **options).values())


__all__ = ["FAMILIES", "Family", "PartOptions", "StatePart", "family", "kind_of", "state_bytes", "state_layout"]
