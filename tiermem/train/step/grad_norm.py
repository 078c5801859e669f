"""The global gradient norm of a step, its clip coefficient, and what a step whose norm is not
finite does instead of updating.

The norm is computed as ``torch.nn.utils.clip_grad_norm_`` computes it: an fp32 norm per parameter
(``torch._foreach_norm``, one call per bucket), then the norm of those norms, in a fixed parameter
order, so that the rounding of the total (and so the clip coefficient) never depends on how a
policy grouped parameters into buckets. Under data parallelism each rank has the norms of its
pieces, combined by the group.

# NOTE [A stalled run is loud]
In bf16 and fp32 an overflow is not expected: a skipped step logs a warning with the names of the
parameters whose gradients are not finite, and ``max_skipped_steps`` (default 10) skipped steps
in a row raise a ``tiermem:`` error with that diagnosis, instead of a run that trains nothing
for hours. In fp16 skipping is the loss scaler's normal way to find its scale.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, NamedTuple, Optional

import torch

from tiermem.errors import TierMemError
from tiermem.plan.buckets import Bucket, Slot
from tiermem.train.homes.bucket_homes import Homes
from tiermem.transfer.collectives import Group

log = logging.getLogger(__name__)


class Norms(NamedTuple):
    """A step's gradient norms: the global one, and each parameter's that got a gradient."""

    total: torch.Tensor  # fp32 scalar
    names: list[str]  # the parameters that got a gradient, in parameter order
    each: torch.Tensor  # their norms, in that order

    def not_finite(self) -> list[str]:
        """The parameters whose gradients are not finite, in parameter order."""
        return [n for n, ok in zip(self.names, torch.isfinite(self.each).tolist()) if not ok]


def slot_norms(grads: torch.Tensor, slots: list[Slot]) -> dict[str, torch.Tensor]:
    """The fp32 L2 norm of each of ``slots`` in a bucket's flat ``grads``, by parameter name: one
    ``_foreach_norm`` call (what ``clip_grad_norm_`` computes for each parameter)."""
    if not slots:
        return {}
    views = [grads[s.offset : s.offset + s.numel] for s in slots]
    return dict(zip((s.name for s in slots), torch._foreach_norm(views, 2, dtype=torch.float32)))


def bucket_norms(
    buckets: Iterable[Bucket], homes: Homes, fill: int, received: Callable[[str], bool]
) -> dict[str, torch.Tensor]:
    """The norms of the ``received`` parameters' gradients, read bucket by bucket from their
    homes (gradient buffer ``fill``)."""
    per_slot: dict[str, torch.Tensor] = {}
    for b in buckets:
        mine = [s for s in b.slots if received(s.name)]
        if not mine:
            continue
        g, free = homes.grads[b.index].read(b, fill)
        try:
            per_slot.update(slot_norms(g, mine))
        finally:
            free()
    return per_slot


def global_norm(per_slot: dict[str, torch.Tensor], names: list[str], group: Group) -> Norms:
    """The norm over ``names`` (the parameters that got a gradient, in parameter order) of their
    norms ``per_slot`` (a parameter none of whose gradient lives on this rank counts 0)."""
    if not names:
        return Norms(torch.zeros((), dtype=torch.float32), [], torch.zeros(0))
    zero = torch.zeros((), dtype=torch.float32)
    each = group.norms(_on_host([per_slot.get(n, zero) for n in names]))
    return Norms(torch.linalg.vector_norm(each), names, each)


def clip_coefficient(grad_clip: Optional[float], norm: torch.Tensor) -> float:
    """What the gradients are multiplied by so that their norm is at most ``grad_clip``."""
    if grad_clip is None:
        return 1.0
    return torch.clamp(grad_clip / (norm + 1e-6), max=1.0).item()


def _on_host(norms: list[torch.Tensor]) -> torch.Tensor:
    """The per-parameter norms stacked in their order, with one device-to-host sync per device
    they live on (not one per parameter)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for n in norms:
        by_device.setdefault(n.device, []).append(n)
    if len(by_device) == 1:
        return torch.stack(norms).cpu()
    host = {d: torch.stack(ns).cpu() for d, ns in by_device.items()}
    ordered, seen = [], {d: 0 for d in host}
    for n in norms:
        ordered.append(host[n.device][seen[n.device]])
        seen[n.device] += 1
    return torch.stack(ordered)


class Skips:
    """Counts the steps skipped in a row because their gradients were not finite, and stops a run
    that trains nothing (NOTE [A stalled run is loud])."""

    def __init__(self, max_skipped: Optional[int]):
        self.max_skipped = max_skipped
        self.in_a_row = 0

    def stepped(self) -> None:
        """A step updated the weights."""
        self.in_a_row = 0

    def skipped(self, norm: float, norms: Norms) -> None:
        """A step skipped (not under fp16's loss scaling, where skipping is expected): a warning
        naming the parameters whose gradients are not finite; a ``tiermem:`` error after
        ``max_skipped`` in a row."""
        self.in_a_row += 1
        bad = norms.not_finite()
        shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        log.warning(
            "tiermem: gradient norm is %s; step skipped, weights unchanged (%d in a row); not finite: %s",
            norm,
            self.in_a_row,
            shown,
        )
        if self.max_skipped is not None and self.in_a_row >= self.max_skipped:
            raise TierMemError(
                f"tiermem: {self.in_a_row} steps in a row were skipped because the gradients are not "
                f"finite (in {shown}); the weights have not moved since. Lower the learning rate, check the "
                f"inputs and the loss for inf/NaN, or resume from the last checkpoint (raise "
                f"max_skipped_steps= to allow more)"
            )
