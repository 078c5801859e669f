"""tiermem's CPU optimizers: fused, single-pass updates of fp32 (or bf16, stochastically rounded) master
weights and their state (low-precision gradients in, low-precision weights out), and drop-in torch
optimizers built on them.

Functional entries (what TieredModel calls per bucket; one style, see tiermem/optim/steps.py):
``adam_step``, ``adam8bit_step``, ``sgd_step``, ``adagrad_step``, ``lion_step``, ``adafactor_step``;
``state_layout`` says which state tensors each takes, ``quantize_blockwise``/``dequantize_blockwise``
convert 8-bit state, ``StochasticRound`` keys bf16 master weights; ``StateFormat`` (``state_format``) is
what one parameter's state is made of inside TieredModel (NOTE [State formats]). Drop-in ``torch.optim``
optimizers for CPU parameters: ``CPUAdam``, ``CPUAdam8bit``, ``CPUSGD``, ``CPUAdagrad``, ``CPULion``,
``CPUAdafactor``. ``implementation()`` says which Adam kernel runs here ("native", "compiled" or "fallback";
``TIERMEM_NO_COMPILE=1`` forces the fallback, as ``compile_disabled()`` tells, and the reference
kernels for the others).
"""

from __future__ import annotations

from tiermem.optim.adafactor import adafactor_step
from tiermem.optim.adam_impl import compile_disabled, compile_seconds, implementation, warm_up
from tiermem.optim.dropin.cpu_adafactor import CPUAdafactor
from tiermem.optim.dropin.cpu_adagrad import CPUAdagrad
from tiermem.optim.dropin.cpu_adam import CPUAdam
from tiermem.optim.dropin.cpu_adam8bit import CPUAdam8bit
from tiermem.optim.dropin.cpu_lion import CPULion
from tiermem.optim.dropin.cpu_sgd import CPUSGD
from tiermem.optim.families import state_bytes, state_layout
from tiermem.optim.formats import StateFormat, StatePart, state_format  # noqa: F401  (tiermem.optim.formats has their docs)
from tiermem.optim.functional import adam_step
from tiermem.optim.kernels.sr import StochasticRound
from tiermem.optim.steps import (
    adagrad_step,
    adam8bit_step,
    dequantize_blockwise,
    lion_step,
    quantize_blockwise,
    sgd_step,
)

__all__ = [
    "CPUAdafactor",
    "CPUAdagrad",
    "CPUAdam",
    "CPUAdam8bit",
    "CPULion",
    "CPUSGD",
    "StochasticRound",
    "adafactor_step",
    "adagrad_step",
    "adam8bit_step",
    "adam_step",
    "compile_disabled",
    "compile_seconds",
    "dequantize_blockwise",
    "implementation",
    "lion_step",
    "quantize_blockwise",
    "sgd_step",
    "state_bytes",
    "state_layout",
    "warm_up",
]
