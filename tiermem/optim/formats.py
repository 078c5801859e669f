"""``StateFormat``: what one parameter's optimizer state is made of, as one record that every part of
TieredModel reads (bytes in plans and budgets, buffers in the homes, NVMe keys, checkpoints, the
kernel the step calls).

# NOTE [State formats]
A parameter's state is its master weights and the state tensors of its optimizer kind, each a
:class:`StatePart`: a name (the checkpoint key's prefix, ``master/<p>``, ``exp_avg/<p>``; the part a
policy sees, ``<p>:exp_avg``), a dtype, and how many of its elements a parameter of ``n`` elements
has. Elementwise parts have ``n``; a blocked part (8-bit state's absmax) has one per ``block``
elements of the parameter, counted from the parameter's own element 0, so blocks never span two
parameters and the numbers never depend on bucket sizes or placement. The master part is fp32, or
bf16 with stochastic rounding (``bf16_stochastic_round``: no separate fp32 copy). A bucket holds the
parameters of one format (one kernel family): each part is one flat buffer per bucket, the slots'
pieces of it back to back in slot order (:meth:`StateFormat.offsets`).

A factored part (``factor``: Adafactor's ``row_var``, ``col_var`` and ``variance``) has as many
elements as the parameter's *shape* gives it (:func:`tiermem.optim.adafactor.state_numels`: one per
row and one per column of each matrix of a parameter of two or more dimensions, one per element of
a vector, none of the other layout), so its ``numel`` takes the shape. Its update needs the whole
parameter (the factors are means over rows and columns): such a format is not elementwise, the step
calls its kernel once per parameter with the parameter's shape, and a piece of a parameter (a data
parallel chunk cutting it) cannot be updated. Its bytes are the true ones everywhere they are
counted (plans, budgets, homes, NVMe values, checkpoints): a matrix of ``r x c`` keeps ``r + c``
fp32 values of second moment, where Adam keeps ``2 r c``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from tiermem.config.kinds import KINDS, Kind
from tiermem.errors import ConfigError
from tiermem.optim.families import FAMILIES, Family, PartOptions, StatePart, family, kind_of
from tiermem.optim.kernels import quant as _quant
from tiermem.optim.kernels.sr import StochasticRound

MASTER_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class StateFormat:
    """A parameter's state (NOTE [State formats]): the kernel ``kind`` and its ``parts``, master first."""

    kind: Kind
    parts: tuple[StatePart, ...]
    #: options the update needs besides the groups' hyperparameters (e.g. Adagrad's initial value)
    options: Mapping[str, Any] = field(default_factory=dict, compare=False)
    #: False: a parameter's state is one indivisible piece (a factored state: Adafactor's row and
    #: column statistics), so a data parallel chunk may start only at a parameter's edge
    divisible: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", kind_of(self.kind, "StateFormat"))
        if not self.parts or self.parts[0].name != "master" or self.parts[0].dtype not in MASTER_DTYPES:
            raise ConfigError("tiermem: a StateFormat's first part is the master weights, fp32 or bf16")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parts)

    @property
    def master_dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def stochastic_round(self) -> bool:
        """bf16 master weights, rounded stochastically (NOTE [Stochastic rounding bits])."""
        return self.master_dtype == torch.bfloat16

    @property
    def elementwise(self) -> bool:
        """Every part has one element per parameter element: any element range of a bucket is a
        valid piece of state (data parallel chunks may cut parameters anywhere)."""
        return all(p.elementwise for p in self.parts)

    @property
    def factored(self) -> bool:
        """Some part follows the parameter's shape: the update takes a whole parameter at a time."""
        return any(p.factored for p in self.parts)

    def next_cut(self, first: int, n: int) -> int:
        """Where a data parallel chunk may start in a parameter of ``n`` elements (NOTE [Chunks cut
        where the state allows]): the smallest element index ``>= first`` (``n``: the parameter's end)
        at which every part's piece starts whole: anywhere for elementwise parts, at a multiple of the
        block for blocked ones, at the edges only for an indivisible state."""
        if first <= 0 or first >= n:
            return max(first, 0) if first <= 0 else n
        if not self.divisible:
            return n
        unit = math.lcm(*(p.block for p in self.parts))
        return min(-(-first // unit) * unit, n)

    def nbytes(self, n: int, shape: Optional[Sequence[int]] = None) -> int:
        """Bytes of the state (master included) of a parameter of ``n`` elements (of ``shape``)."""
        return sum(p.numel(n, shape) * p.itemsize for p in self.parts)

    def offsets(self, numels: Sequence[int], shapes: Optional[Sequence[Sequence[int]]] = None) -> list[list[int]]:
        """Per part, where each parameter's piece starts in the part's buffer (parameters of these
        element counts and ``shapes``, in order); for an elementwise part, the parameter's offset in
        the bucket."""
        shapes_ = list(shapes) if shapes is not None else [None] * len(numels)
        out = []
        for p in self.parts:
            at, mine = 0, []
            for n, sh in zip(numels, shapes_):
                mine.append(at)
                at += p.numel(n, sh)
            out.append(mine)
        return out

    def joined(self, part_numels: Sequence[int]) -> tuple[list[int], int]:
        """The parts of one bucket (``part_numels`` elements each) back to back in one byte buffer,
        as one NVMe value holds them: each part's byte offset (aligned to the parts' largest element
        size) and the total bytes."""
        align = max(p.itemsize for p in self.parts)
        at, offsets = 0, []
        for p, n in zip(self.parts, part_numels):
            offsets.append(at)
            at += -(-n * p.itemsize // align) * align
        return offsets, at

    def describe(self) -> str:
        """One line: the parts and their bytes per parameter (an 8-bit part's scales counted)."""
        per = " + ".join(
            f"{p.name} {'(rows + columns) x ' if p.factored else 'per parameter ' if p.per_parameter else ''}"
            f"{p.itemsize / p.block:g}"
            for p in self.parts
        )
        return f"{self.kind}: {per} B/param"


def state_format(
    kind: str,
    *,
    master_dtype: torch.dtype = torch.float32,
    numel: Optional[int] = None,
    momentum: bool = False,
    initial_accumulator_value: float = 0.0,
    min_8bit_size: int = _quant.MIN_8BIT_NUMEL,
    generic_parts: Sequence[Any] = (),
    optimizer: Any = None,
) -> StateFormat:
    """The format of a parameter of ``numel`` elements under ``kind``, its parts :data:`FAMILIES`'
    row: SGD keeps a ``momentum_buffer`` only with ``momentum``; 8-bit Adam keeps fp32 moments
    (Adam's format) below ``min_8bit_size`` elements (NOTE [8-bit state]); ``master_dtype`` bf16 drops
    the fp32 master; a generic optimizer keeps the entries its probe found (``generic_parts``), run by
    a copy of ``optimizer`` (NOTE [Generic optimizers] in tiermem/config/generic_optim.py)."""
    known, fam = family(kind_of(kind, "state_format"), numel, min_8bit_size)
    opts = PartOptions(momentum, initial_accumulator_value, generic_parts)
    parts = (StatePart("master", master_dtype), *fam.parts(opts))
    options = {} if fam.update is not None else {"optimizer": optimizer}  # it steps itself, with a copy of it
    return StateFormat(known, parts, options, divisible=fam.divisible)


#: Adam with fp32 master and moments: 12 B/param, what TieredModel kept before formats
ADAM = state_format(Kind.ADAMW)


def _fused(fmt: StateFormat) -> Family:
    """``fmt``'s row, which has a fused update; a kind without one (a generic optimizer steps itself) is
    an error."""
    fam = FAMILIES.get(fmt.kind)
    if fam is None or fam.update is None or fam.record is None:
        fused = tuple(k.value for k, f in FAMILIES.items() if f.update is not None)
        raise ConfigError(
            f"tiermem: formats.update has no fused update for kind={fmt.kind!r}; pass a format of one of "
            f"{fused} (a generic optimizer's state is stepped by its own step())"
        )
    return fam


def hyper_record(fmt: StateFormat, hyper: Mapping[str, Any], *, step: int, grad_scale: float, clip_coef: float) -> Any:
    """A param group's hyperparameters (``hyper``, torch's names) for one update of ``step`` under
    ``fmt``'s kernel, as the typed record its kernel reads (AdamHyper, SGDHyper, ...), checked by the
    rules of the kind's functional entry, whose name its errors carry (NOTE [Checked once a step])."""
    record = _fused(fmt).record
    assert record is not None  # _fused refuses a row without one
    return record(hyper, step, grad_scale, clip_coef)


def update(
    fmt: StateFormat,
    master: torch.Tensor,
    state: Sequence[torch.Tensor],
    grad: torch.Tensor,
    record: Any,
    *,
    out: Optional[torch.Tensor],
    stochastic_round: Optional[StochasticRound] = None,
    shape: Optional[Sequence[int]] = None,
) -> None:
    """One fused update of one piece of state under ``fmt``'s kernel (its :data:`FAMILIES` row), its
    hyperparameters ``record`` (:func:`hyper_record`, checked once for the step); the gradients are
    known to be finite. A factored format updates one whole parameter of ``shape`` (its pieces flat)."""
    fam = _fused(fmt)
    assert fam.update is not None  # _fused refuses a row without one
    fam.update(master, state, grad, out, record, shape, stochastic_round)


def blocks_aligned(fmt: StateFormat, start: int) -> bool:
    """Whether a piece of a parameter starting at its element ``start`` keeps ``fmt``'s blocks whole."""
    return all(start % p.block == 0 for p in fmt.parts) and (start == 0 or not fmt.factored)


def per_param_bytes(fmt: StateFormat) -> float:
    """Bytes per parameter element of a large parameter (blocked parts amortised; a factored part's
    rows and columns are nothing beside a large matrix's elements)."""
    return sum(0.0 if p.factored or p.per_parameter else p.itemsize / p.block for p in fmt.parts)


__all__ = [
    "ADAM",
    "KINDS",
    "StateFormat",
    "StatePart",
    "blocks_aligned",
    "hyper_record",
    "per_param_bytes",
    "state_format",
    "update",
]
