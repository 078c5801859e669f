"""The one registry of optimizer kinds (``FAMILIES``): for each :class:`~tiermem.config.kinds.Kind`,
the state tensors it keeps beside the master weights and the kernel that updates them.

Three readers, one table: :func:`tiermem.optim.formats.state_format` (what a parameter's state is
made of inside TieredModel: plans, budgets, homes, NVMe keys, checkpoints), :func:`tiermem.optim.formats.step`
(the fused update a bucket's piece of state gets) and :func:`state_layout` (the same tensors, master
left out, for a parameter's shape: what the functional entries take, in their positional order,
Adafactor's by keyword). A kind without a row here is an error everywhere, never a default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from tiermem import optim as _entries  # the functional entries, looked up when called (tests may wrap them)
from tiermem.config.kinds import KINDS, Kind
from tiermem.errors import ConfigError
from tiermem.optim.adafactor import state_numels as _factored_numels
from tiermem.optim.kernels import quant as _quant

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


#: ``update(master, state, grad, hyper, common, shape)``: one fused update, the hyperparameters read
#: from a param group's dict (torch's names), ``common`` the keywords every functional entry takes
Update = Callable[
    [torch.Tensor, Sequence[torch.Tensor], torch.Tensor, Mapping[str, Any], dict, Optional[Sequence[int]]], None
]


@dataclass(frozen=True)
class Family:
    """A kind's row: its state ``parts`` (master excluded), its fused ``update`` (None: the optimizer
    steps itself, NOTE [Generic optimizers]), whether a parameter's state may be cut into pieces
    (``divisible``: not a factored state nor a generic optimizer's), and the kind a parameter below
    ``min_8bit_size`` elements falls back to (``small``: 8-bit Adam keeps fp32 moments there)."""

    parts: Callable[[PartOptions], tuple[StatePart, ...]]
    update: Optional[Update]
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


def _adam(
    master: Tensor, state: Sequence[Tensor], grad: Tensor, hyper: Mapping[str, Any], common: dict, shape: Dims
) -> None:
    beta1, beta2 = hyper["betas"]
    _entries.adam_step(
        master,
        state[0],
        state[1],
        grad,
        lr=hyper["lr"],
        beta1=beta1,
        beta2=beta2,
        eps=hyper["eps"],
        weight_decay=hyper["weight_decay"],
        adamw=hyper["adamw"],
        **common,
    )


def _adam8bit(
    master: Tensor, state: Sequence[Tensor], grad: Tensor, hyper: Mapping[str, Any], common: dict, shape: Dims
) -> None:
    beta1, beta2 = hyper["betas"]
    _entries.adam8bit_step(
        master,
        state[0],
        state[1],
        state[2],
        state[3],
        grad,
        lr=hyper["lr"],
        beta1=beta1,
        beta2=beta2,
        eps=hyper["eps"],
        weight_decay=hyper["weight_decay"],
        adamw=hyper["adamw"],
        **common,
    )


def _sgd(
    master: Tensor, state: Sequence[Tensor], grad: Tensor, hyper: Mapping[str, Any], common: dict, shape: Dims
) -> None:
    momentum = hyper["momentum"]
    buffer = state[0] if state else None
    if (momentum != 0) != (buffer is not None):
        raise ConfigError(
            f"tiermem: a param group's SGD momentum is {momentum} but the optimizer state was made "
            f"{'with' if buffer is not None else 'without'} a momentum buffer; set momentum "
            f"{'> 0' if buffer is not None else '= 0'} in every group, or give the optimizer a "
            f"momentum > 0 from the start"
        )
    _entries.sgd_step(
        master,
        buffer,
        grad,
        lr=hyper["lr"],
        momentum=momentum,
        dampening=hyper["dampening"],
        nesterov=hyper["nesterov"],
        weight_decay=hyper["weight_decay"],
        maximize=hyper["maximize"],
        **common,
    )


def _adagrad(
    master: Tensor, state: Sequence[Tensor], grad: Tensor, hyper: Mapping[str, Any], common: dict, shape: Dims
) -> None:
    _entries.adagrad_step(
        master,
        state[0],
        grad,
        lr=hyper["lr"],
        lr_decay=hyper["lr_decay"],
        weight_decay=hyper["weight_decay"],
        eps=hyper["eps"],
        maximize=hyper["maximize"],
        **common,
    )


def _lion(
    master: Tensor, state: Sequence[Tensor], grad: Tensor, hyper: Mapping[str, Any], common: dict, shape: Dims
) -> None:
    beta1, beta2 = hyper["betas"]
    _entries.lion_step(
        master,
        state[0],
        grad,
        lr=hyper["lr"],
        beta1=beta1,
        beta2=beta2,
        weight_decay=hyper["weight_decay"],
        **common,
    )


def _adafactor(
    master: Tensor, state: Sequence[Tensor], grad: Tensor, hyper: Mapping[str, Any], common: dict, shape: Dims
) -> None:
    dims = tuple(master.shape) if shape is None else tuple(shape)
    # a matrix's pieces are row_var and col_var, a vector's variance (the other layout's have 0 elements)
    row_var, col_var, variance = (state[0], state[1], None) if len(dims) >= 2 else (None, None, state[2])
    eps1, eps2 = hyper["eps"]
    _entries.adafactor_step(
        master,
        grad,
        lr=hyper["lr"],
        beta2_decay=hyper["beta2_decay"],
        eps1=eps1,
        eps2=eps2,
        d=hyper["d"],
        weight_decay=hyper["weight_decay"],
        maximize=hyper["maximize"],
        row_var=row_var,
        col_var=col_var,
        variance=variance,
        shape=dims,
        **common,
    )


#: every kind's row; each member of Kind has one (tests/test_optim_formats.py checks)
FAMILIES: Mapping[Kind, Family] = {
    Kind.ADAM: Family(_adam_parts, _adam),
    Kind.ADAMW: Family(_adam_parts, _adam),
    Kind.ADAM8BIT: Family(_adam8bit_parts, _adam8bit, small=Kind.ADAM),
    Kind.ADAMW8BIT: Family(_adam8bit_parts, _adam8bit, small=Kind.ADAMW),
    Kind.SGD: Family(_sgd_parts, _sgd),
    Kind.ADAGRAD: Family(_adagrad_parts, _adagrad),
    Kind.LION: Family(_lion_parts, _lion),
    # a factored state and a generic optimizer's own step() take whole parameters: cut only at edges
    Kind.ADAFACTOR: Family(_adafactor_parts, _adafactor, divisible=False),
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
