"""Built-in placement policies, installed as ``tiermem.policies``."""

from __future__ import annotations

from tiermem.policies.activation_offload import ActivationOffload
from tiermem.policies.auto import Auto
from tiermem.policies.keep_on_device import KeepOnDevice
from tiermem.policies.zero_infinity import ZeroInfinity
from tiermem.policies.zero_offload import ZeroOffload

__all__ = ["ActivationOffload", "Auto", "KeepOnDevice", "ZeroInfinity", "ZeroOffload"]
