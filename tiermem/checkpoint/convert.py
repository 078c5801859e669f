"""A checkpoint of one state format loaded into a model of another (NOTE [State formats]).

# NOTE [Converting state formats]
A checkpoint stores each parameter's state as its format had it (8-bit codes and their absmax, no
expansion). Loaded into a model whose format for that parameter differs, the state is converted as
it is read, and the log says so once per load:

- Adam's fp32 moments into 8-bit ones: quantized (``quantize_blockwise``, exp_avg signed, exp_avg_sq
  unsigned): the moments lose what 8 bits cannot hold, as an 8-bit step would have lost it, but each
  on its own: the bound an 8-bit step keeps on v (NOTE [8-bit moment bound]) needs both moments, the
  step and the betas, so it holds from the first 8-bit step after the load on;
- 8-bit moments into fp32 ones: dequantized, exactly the values the 8-bit step used;
- fp32 master weights into bf16 ones (``bf16_stochastic_round``): rounded to nearest; bf16 into
  fp32: exact.

Any other difference (SGD's momentum buffer into Adam's moments, ...) keeps the plain check: the
names differ and the load is refused with the names missing and unexpected, nothing changed.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from tiermem.checkpoint.names import MASTER, SCALES, StateName
from tiermem.optim import dequantize_blockwise, quantize_blockwise

log = logging.getLogger(__name__)

#: the 8-bit moments (each with its absmax: :data:`tiermem.checkpoint.names.SCALES`), each with
#: whether its map is signed (NOTE [8-bit state])
MOMENTS = {"exp_avg": True, "exp_avg_sq": False}
assert set(MOMENTS) == set(SCALES), "every 8-bit moment has its absmax"

Shapes = dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]  # name -> (shape, dtypes accepted)
Held = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (shape, dtype) in the checkpoint
ReadInto = Callable[[str, torch.Tensor], None]


class Conversion:
    """Which of the model's tensors are converted from what a checkpoint holds, and the reader that
    converts them as the model asks for each."""

    def __init__(self, expected: Shapes, held: Held):
        self.quantize: set[str] = set()  # "exp_avg/<p>": fp32 in the checkpoint, 8-bit in the model
        self.dequantize: set[str] = set()  # "exp_avg/<p>": 8-bit in the checkpoint, fp32 in the model
        self.master: set[str] = set()  # "master/<p>": another float dtype there
        for name, (_, dtypes) in expected.items():
            if name not in held:
                continue
            n, have = StateName.parse(name), held[name][1]
            scale = n.scale
            if scale is not None and have == torch.float32 and dtypes == (torch.uint8,) and str(scale) not in held:
                self.quantize.add(name)
            elif scale is not None and have == torch.uint8 and dtypes == (torch.float32,) and str(scale) in held:
                self.dequantize.add(name)
            elif n.part == MASTER and have in (torch.float32, torch.bfloat16) and have not in dtypes:
                self.master.add(name)
        #: a quantized moment's codes and absmax, by name, from when either is asked for until both were
        self._quantized: dict[str, torch.Tensor] = {}

    def reconciled(self, expected: Shapes, held: Held) -> tuple[Shapes, Held]:
        """``expected`` and ``held`` with the converted tensors made to agree (the absmax the
        conversion makes or uses is not asked of the other side)."""
        expected, held = dict(expected), dict(held)
        for name in self.quantize:
            expected.pop(_scale_of(name), None)
            shape, _ = expected[name]
            expected[name] = (shape, (torch.float32,))
        for name in self.dequantize:
            held.pop(_scale_of(name), None)
            expected[name] = (held[name][0], (torch.uint8,))
        for name in self.master:
            shape, dtypes = expected[name]
            expected[name] = (shape, (*dtypes, held[name][1]))
        return expected, held

    def __bool__(self) -> bool:
        return bool(self.quantize or self.dequantize or self.master)

    def say(self, what: str) -> None:
        parts = []
        if self.quantize:
            parts.append(f"{len(self.quantize)} fp32 moments quantized to 8 bits")
        if self.dequantize:
            parts.append(f"{len(self.dequantize)} 8-bit moments dequantized to fp32")
        if self.master:
            parts.append(f"{len(self.master)} master weights converted between fp32 and bf16")
        log.info(
            "tiermem: %s has another optimizer state format than this model: %s (NOTE [Converting state formats])",
            what,
            ", ".join(parts),
        )

    def reader(self, read_into: ReadInto, held: Held) -> ReadInto:
        """``read_into`` for the model's names, converting where this conversion says. A quantized
        moment's codes and absmax come from one read of the checkpoint's fp32 moment, whichever of
        the two the model asks for first."""

        def quantized(moment: StateName, name: str) -> torch.Tensor:
            if name not in self._quantized:
                value = torch.empty(held[str(moment)][0], dtype=torch.float32)
                read_into(str(moment), value)
                codes, absmax = quantize_blockwise(value, signed=MOMENTS[moment.part])
                self._quantized.update({str(moment): codes, _scale_of(str(moment)): absmax})
            return self._quantized.pop(name)

        def read(name: str, target: torch.Tensor) -> None:
            n = StateName.parse(name)
            moment = n if name in self.quantize else n.moment
            if moment is not None and str(moment) in self.quantize:
                target.copy_(quantized(moment, name).view(target.shape))
            elif name in self.dequantize:
                codes = torch.empty(held[name][0], dtype=torch.uint8)
                absmax = torch.empty(held[_scale_of(name)][0], dtype=torch.float32)
                read_into(name, codes)
                read_into(_scale_of(name), absmax)
                target.copy_(dequantize_blockwise(codes, absmax, signed=MOMENTS[n.part]).view(target.shape))
            else:
                read_into(name, target)

        return read


def _scale_of(moment: str) -> str:
    """The name of the absmax of the 8-bit moment named ``moment`` (``exp_avg/<p>`` -> ``exp_avg_absmax/<p>``)."""
    scale = StateName.parse(moment).scale
    assert scale is not None, f"{moment!r} is not an 8-bit moment"
    return str(scale)
