"""ZeRO-Infinity: weights and optimizer state on NVMe, grads on the host, activations on the
device. Weights come to the device just in time for their module (prefetched in the order the
first step recorded) and the step streams the optimizer state through bounded host buffers.

# NOTE [Resident weights for inference]
A model built for inference (``optimizer=None``) keeps nothing on the host besides its weights'
way through, so ZeroInfinity bound to one (``ModelInfo.inference``) keeps as many weights on the host
as the host's limit holds (the ``Budgets(host=...)``, or the memory available), and only the rest
stay on NVMe and stream at each forward: each token of ``generate`` reads every weight once, so
what is resident is read from memory and what is not costs a read of the disk per token. Which
ones: those whose re-read costs the most per byte they hold. Reading ``n`` bytes from NVMe costs
a request's latency plus ``n`` over the bandwidth, so its cost per byte falls as ``n`` grows, for
any latency and bandwidth: the smallest weights first (norms, biases: a request each for a few
KiB), then larger ones, each taken whole while it fits; ties in forward order. The room is the
host's limit less what the model needs there with no weight resident (the planner's own footprint,
page rounding included), and the final choice is checked by the planner: a weight that would pass
the limit stays on NVMe. Training is not changed: its host holds the grads, and the weights' trip
through the step is another matter.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiermem.errors import checked_arguments
from tiermem.plan.policy import ModelInfo, PerClass, Policy
from tiermem.types import TensorClass, TensorInfo, Tier

_PAGE = 4096  # a host buffer takes whole pages (tiermem.plan.footprint.host_buffer_bytes)


@checked_arguments
class ZeroInfinity(PerClass):
    """ZeRO-Infinity: weights and optimizer state on NVMe, grads on the host, activations on the
    device; needs ``nvme_dir``. Takes no arguments. For inference (``optimizer=None``) the weights
    the host's limit holds stay there and only the rest stream from NVMe (NOTE [Resident weights
    for inference])."""

    homes = {
        TensorClass.PARAM: Tier.NVME,
        TensorClass.OPTIM_STATE: Tier.NVME,
        TensorClass.GRAD: Tier.HOST,
        TensorClass.ACTIVATION: Tier.DEVICE,
    }

    def for_model(self, model: ModelInfo) -> Policy:
        if not model.inference or Tier.HOST not in model.limits:
            return self
        room = model.limits[Tier.HOST] - _host_need(model, HostResident(self, frozenset()))
        on_host = resident_weights(model, room)
        while on_host and model.evaluate is not None:  # the planner's word on the choice
            if _host_need(model, HostResident(self, on_host)) <= model.limits[Tier.HOST]:
                break
            largest = max((p for p in model.params if p.name in on_host), key=lambda p: p.nbytes)
            on_host = on_host - {largest.name}
        return HostResident(self, on_host)


def _host_need(model: ModelInfo, policy: Policy) -> int:
    """The host bytes the planner says ``policy`` needs for this model (0 without a planner)."""
    if model.evaluate is None:
        return 0
    return int(model.evaluate(policy, predict=False).need.get(Tier.HOST, 0))


def resident_weights(model: ModelInfo, room: int) -> frozenset[str]:
    """The weights kept on the host within ``room`` bytes: the smallest first, each whole (NOTE
    [Resident weights for inference])."""
    chosen: set[str] = set()
    order = sorted(enumerate(model.params), key=lambda ip: (ip[1].nbytes, ip[0]))
    for _, p in order:
        size = -(-max(p.nbytes, 1) // _PAGE) * _PAGE
        if size > room:
            break  # the rest are no smaller
        chosen.add(p.name)
        room -= size
    return frozenset(chosen)


@dataclass(frozen=True)
class HostResident(Policy):
    """``ZeroInfinity()`` bound to a model built for inference: the weights ``on_host`` on the host,
    the other weights on NVMe, the rest as ``base`` places it (NOTE [Resident weights for inference])."""

    base: ZeroInfinity
    on_host: frozenset[str]

    def place(self, info: TensorInfo) -> Tier:
        if info.kind is TensorClass.PARAM:
            return Tier.HOST if info.param in self.on_host else Tier.NVME
        return self.base.place(info)

    def places_activations_by_module(self) -> bool:
        return self.base.places_activations_by_module()

    def __repr__(self) -> str:
        return f"{self.base!r} ({len(self.on_host)} weights resident on the host)"
