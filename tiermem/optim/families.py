"""``state_layout``: the state tensors each kernel family takes, for planners, budgets and homes.

The integrator (TieredModel's homes, ``tiermem plan``, the NVMe footprint) sizes and allocates
optimizer state without running an optimizer: this says, for a parameter's shape, which flat state
tensors the functional entry takes, in its positional order (Adafactor's by keyword), with their
element counts and dtypes. Master weights are not state: 4 bytes a parameter in fp32, 2 in bf16 with
stochastic rounding.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from tiermem.errors import ConfigError
from tiermem.optim.adafactor import state_numels
from tiermem.optim.kernels import quant as _quant

KINDS = ("adam", "adamw", "adam8bit", "adamw8bit", "sgd", "adagrad", "lion", "adafactor")


def state_layout(
    kind: str, shape: Sequence[int], *, momentum: float = 0.0, min_8bit_size: int = _quant.MIN_8BIT_NUMEL
) -> dict[str, tuple[int, torch.dtype]]:
    """name -> (elements, dtype) of the state of one parameter of ``shape`` under ``kind`` (one of
    ``KINDS``). SGD has a ``momentum_buffer`` only with ``momentum``; 8-bit Adam keeps fp32 moments
    (Adam's layout) below ``min_8bit_size`` elements (NOTE [8-bit state]).

    Args:
        kind: ``"adam"``, ``"adamw"``, ``"adam8bit"``, ``"adamw8bit"``, ``"sgd"``, ``"adagrad"``,
            ``"lion"`` or ``"adafactor"``.
        shape: the parameter's shape.
        momentum: SGD's momentum (a buffer exists only when it is not 0).
        min_8bit_size: the fewest elements 8-bit Adam keeps 8-bit moments for.
    """
    if kind not in KINDS:
        raise ConfigError(f"tiermem: state_layout kind={kind!r} is unknown; pass one of {KINDS}")
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    f32 = torch.float32
    if kind in ("adam8bit", "adamw8bit") and n >= min_8bit_size:
        blocks = _quant.num_blocks(n)
        return {
            "exp_avg": (n, torch.uint8),
            "exp_avg_absmax": (blocks, f32),
            "exp_avg_sq": (n, torch.uint8),
            "exp_avg_sq_absmax": (blocks, f32),
        }
    if kind in ("adam", "adamw", "adam8bit", "adamw8bit"):
        return {"exp_avg": (n, f32), "exp_avg_sq": (n, f32)}
    if kind == "sgd":
        return {"momentum_buffer": (n, f32)} if momentum != 0 else {}
    if kind == "adagrad":
        return {"state_sum": (n, f32)}
    if kind == "lion":
        return {"exp_avg": (n, f32)}
    return {name: (k, f32) for name, k in state_numels(shape).items()}


def state_bytes(kind: str, shape: Sequence[int], **options) -> int:
    """The bytes of :func:`state_layout`'s tensors.

    Args:
        kind: as :func:`state_layout` takes it.
        shape: the parameter's shape.
        **options (Any): :func:`state_layout`'s keywords (``momentum``, ``min_8bit_size``).
    """
    return sum(k * torch.empty((), dtype=dt).element_size() for k, dt in state_layout(kind, shape, **options).values())
