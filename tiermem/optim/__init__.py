"""The CPU Adam executor: a fused, single-pass Adam/AdamW update of fp32 master weights and moments
(low-precision gradients in, low-precision weights out), and a torch Optimizer built on it.

``adam_step`` is what TieredModel calls per bucket; ``CPUAdam`` is a drop-in ``torch.optim``
optimizer for CPU parameters; ``implementation()`` says which kernel runs here ("compiled" or
"fallback"; ``TIERMEM_NO_COMPILE=1`` forces the fallback, as ``compile_disabled()`` tells).
"""
from __future__ import annotations

from tiermem.optim.cpu_adam import CPUAdam
from tiermem.optim.functional import adam_step, compile_disabled, compile_seconds, implementation, warm_up

__all__ = ["CPUAdam", "adam_step", "compile_disabled", "compile_seconds", "implementation", "warm_up"]
