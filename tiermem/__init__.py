"""tiermem: a tiered memory manager for PyTorch training.

Every tensor of a training step has a class (params, grads, optimizer states, activations);
a policy gives each a home tier (device, host, NVMe); an async engine moves them ahead of use.
"""

from __future__ import annotations

from typing import Any

from tiermem.config.budgets import Budgets, parse_bytes
from tiermem.config.optimizers import SGD, Adafactor, Adagrad, Adam8bit, AdamW8bit, Lion
from tiermem.config.specs import Adam, AdamW, LossScale
from tiermem.config.torch_optim import optimizers
from tiermem.errors import ArgumentError, ConfigError, OutOfTierMemory, StoreError, TierMemError
from tiermem.handles import Handle
from tiermem.memory.nvme import NvmeStore
from tiermem.model.phase import Phase
from tiermem.model.tiered_model import StepResult, TieredModel
from tiermem.observe.report import Report
from tiermem.plan.policy import PerClass, Policy
from tiermem.types import StateKey, TensorClass, TensorInfo, Tier

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``tiermem.from_pretrained`` and ``tiermem.from_deepspeed_config`` are imported when first
    used: ``import tiermem`` imports no integration (tiermem/integrations/)."""
    if name == "from_pretrained":
        from tiermem.integrations.pretrained import from_pretrained

        return from_pretrained
    if name == "from_deepspeed_config":
        from tiermem.integrations.deepspeed.walk import from_deepspeed_config

        return from_deepspeed_config
    raise AttributeError(f"module 'tiermem' has no attribute {name!r}")


__all__ = [
    "Adafactor",
    "Adagrad",
    "Adam",
    "Adam8bit",
    "AdamW",
    "AdamW8bit",
    "ArgumentError",
    "Budgets",
    "ConfigError",
    "Handle",
    "Lion",
    "LossScale",
    "NvmeStore",
    "OutOfTierMemory",
    "PerClass",
    "Phase",
    "Policy",
    "Report",
    "SGD",
    "StateKey",
    "StepResult",
    "StoreError",
    "TensorClass",
    "TensorInfo",
    "TieredModel",
    "Tier",
    "TierMemError",
    "from_deepspeed_config",
    "from_pretrained",
    "optimizers",
    "parse_bytes",
    "__version__",
]
