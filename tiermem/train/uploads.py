"""Where Adam writes a bucket's new low-precision weights, and how they reach their home."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tiermem.handles import Handle, wait_all, wait_all_quietly
from tiermem.train.layout import compute_tier
from tiermem.types import Tier

if TYPE_CHECKING:
    from tiermem.train.stepper import Stepper


class Uploads:
    """Where Adam writes a bucket's new low-precision weights, and their upload to the device:
    in place when the state is on the device, ``param_out`` with overlap_step, else one of two
    staging buffers per tier, reused once its previous upload has finished."""

    def __init__(self, stepper: "Stepper"):
        self.s = stepper
        self.turn = 0
        self.inflight: dict[tuple[Tier, int], list[Handle]] = {}

    def target(self, b) -> torch.Tensor:
        buf = self.s.layout.buffers[b.index]
        if buf.param_out is not None:
            return buf.param_out
        tier = compute_tier(b)
        if tier == Tier.DEVICE and buf.param is not None:
            return buf.param
        which = (tier, self.turn % len(self.s.layout.staging[tier]))
        with self.s.tracer.span("wait staging", "stall"):
            wait_all(self.inflight.pop(which, ()))  # ordering: its last upload has left the buffer
        self._current = which
        return self.s.layout.staging[tier][which[1]][:b.numel]

    def done(self, b, out: torch.Tensor, runs) -> None:
        buf = self.s.layout.buffers[b.index]
        if buf.param_out is not None or (compute_tier(b) == Tier.DEVICE and b.param_tier == Tier.DEVICE):
            return
        self.inflight[self._current] = self.s._upload(b, out, runs)  # overlaps Adam on the next bucket
        self.turn += 1

    def finish(self, quiet: bool = False) -> None:
        handles = [h for hs in self.inflight.values() for h in hs]
        self.inflight.clear()
        with self.s.tracer.span("wait uploads", "stall"):
            (wait_all_quietly if quiet else wait_all)(handles)


def slots_in(bucket, runs) -> list:
    """The slots of ``bucket`` that the update ``runs`` cover."""
    return [s for s in bucket.slots if any(a <= s.offset < e for a, e, _ in runs)]
