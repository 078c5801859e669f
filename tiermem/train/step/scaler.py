"""Dynamic loss scaling for fp16, with the defaults of ``torch.amp.GradScaler`` unless a
:class:`tiermem.LossScale` says otherwise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tiermem.config.specs import LossScale


@dataclass
class LossScaler:
    """Multiply the loss by ``scale`` before backward; on overflow skip the step and halve it
    (never below ``min_scale``); after ``growth_interval`` clean steps in a row, double it.
    Disabled (scale 1.0) unless fp16."""

    enabled: bool
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0
    min_scale: Optional[float] = None

    @classmethod
    def of(cls, enabled: bool, spec: Optional[LossScale]) -> "LossScaler":
        if spec is None:
            return cls(enabled=enabled)
        return cls(
            enabled=enabled, scale=spec.init_scale, growth_interval=spec.growth_interval, min_scale=spec.min_scale
        )

    def __post_init__(self) -> None:
        if not self.enabled:
            self.scale = 1.0

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            if self.min_scale is not None:
                self.scale = max(self.scale, self.min_scale)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
