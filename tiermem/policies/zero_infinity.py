"""ZeRO-Infinity: weights and optimizer state on NVMe, grads on the host, activations on the
device. Weights come to the device just in time for their module (prefetched in the order the
first step recorded) and the step streams the optimizer state through bounded host buffers.

# NOTE [Resident weights for inference]
A model built for inference (``optimizer=None``) keeps nothing on the host besides its weights'
way through, so ZeroInfinity bound to one (``ModelInfo.inference``) keeps as many weights on the host
as the host's limit holds (the ``Budgets(host=...)``, or the memory available), and only the rest
stay on NVMe and stream at each forward: each token of ``generate`` reads every weight once, so
what is resident is read from memory and what is not costs a read of the disk per token. Which
ones: those whose reads cost the most beyond their bytes.

- A read costs a request's latency plus its bytes over the bandwidth. Below about a MiB (NVMe's
  latency, ~0.1 ms, times its bandwidth, a few GB/s, is a few hundred KiB) the latency dominates:
  norms and biases, a request each for a few KiB. These go first, the smallest first.
- Of the rest, the largest go first. Every streamed byte costs the same at the disk, but a read is
  free only while compute hides it: a weight is fetched ahead within the device's room and has to
  land before its module runs. A 65 MB ``lm_head`` or embedding takes longer to read than a layer
  takes to run and stalls the forward each token, where the same bytes in 2-6 MB projections spread
  over the layers stream behind their compute. Measured on bench/generate.py's 220M Llama, half the
  weights on the host, a quarter as the device budget: the smallest first stalled 65-104 ms a token
  on the embedding and ``lm_head``; these kept resident instead, 13-17 ms, and 137 against 160 ms a
  token at batch 1, 168 against 212 at batch 16 (RESULTS 2026-12-07, fifth session).

Each weight is taken whole or not at all (one that does not fit leaves room for the next), ties in
forward order. The room is the host's limit less
what the model needs there with no weight resident (the planner's own footprint, page rounding
included), and the final choice is checked by the planner: past the limit, the weights chosen last
stay on NVMe. Training is not changed: its host holds the grads, and the weights' trip through
the step is another matter.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiermem.errors import checked_arguments
from tiermem.plan.policy import ModelInfo, PerClass, Policy
from tiermem.types import TensorClass, TensorInfo, Tier

_PAGE = 4096  # a host buffer takes whole pages (tiermem.plan.footprint.host_buffer_bytes)
#: a weight read from NVMe whose request costs more than its bytes, about (NOTE [Resident weights for inference])
LATENCY_BOUND = 1 << 20


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
        limit = model.limits[Tier.HOST]
        chosen = _chosen(model, limit - _host_need(model, HostResident(self, frozenset())))
        while chosen:  # the planner's word on the choice: past the limit, the last ones chosen go first
            over = _host_need(model, HostResident(self, frozenset(p.name for p in chosen))) - limit
            if over <= 0:
                break
            while chosen and over > 0:
                over -= _pages(chosen.pop().nbytes)
        return HostResident(self, frozenset(p.name for p in chosen))


def _host_need(model: ModelInfo, policy: Policy) -> int:
    """The host bytes the planner says ``policy`` needs for this model (0 without a planner)."""
    if model.evaluate is None:
        return 0
    return int(model.evaluate(policy, predict=False).need.get(Tier.HOST, 0))


def _pages(nbytes: int) -> int:
    return -(-max(nbytes, 1) // _PAGE) * _PAGE


def _chosen(model: ModelInfo, room: int) -> list[TensorInfo]:
    """The weights kept on the host within ``room`` bytes, in the order chosen: those under
    :data:`LATENCY_BOUND` the smallest first, then the others the largest first, each whole (NOTE
    [Resident weights for inference])."""
    ranked = sorted(
        enumerate(model.params),
        key=lambda ip: (
            ip[1].nbytes >= LATENCY_BOUND,
            ip[1].nbytes * (1 if ip[1].nbytes < LATENCY_BOUND else -1),
            ip[0],
        ),
    )
    chosen: list[TensorInfo] = []
    for _, p in ranked:
        if _pages(p.nbytes) <= room:
            chosen.append(p)
            room -= _pages(p.nbytes)
    return chosen


def resident_weights(model: ModelInfo, room: int) -> frozenset[str]:
    """The names of the weights kept on the host within ``room`` bytes (:func:`_chosen`)."""
    return frozenset(p.name for p in _chosen(model, room))


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
