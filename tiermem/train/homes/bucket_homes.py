"""Homes: each bucket's three homes, by bucket index, and what is done to all of them at once.

# NOTE [Homes]
A bucket's fp32 gradients, its optimizer state and its working weights each have a *home*: an
object that owns those bytes on one tier and answers the step, the checkpoint and ``detach()``
in the same words whatever that tier is. The step never asks where a bucket's grads are; it asks
the bucket's :class:`GradHome` for them. Three interfaces:

- :class:`GradHome`: where the device's gradient copies land during backward (``landing``), and
  the step's view of them where Adam runs (``read``, with a function that frees what it took).
- :class:`StateHome`: master weights and the optimizer's state, the parts of each bucket's state
  format (NOTE [State formats] in tiermem/optim/formats.py: fp32 master, ``exp_avg`` and
  ``exp_avg_sq`` for Adam); runs the step's update
  over its buckets (``step``), can undo a step when its tier keeps the previous value
  (``revertible``), and reads/writes whole buckets for checkpoints.
- :class:`WeightHome`: the low-precision working weights the module computes with: given their
  first value (``initialize``) and each update (``write``).

The interfaces and the homes in memory live in :mod:`tiermem.train.homes.grad_homes`,
:mod:`tiermem.train.homes.state_homes` and :mod:`tiermem.train.homes.weight_homes` (the words an
update is said in: :mod:`tiermem.train.homes.update_runs`); :func:`tiermem.train.layout.make_homes`
is the one place that maps a tier to the class that homes it. The NVMe homes live in
:mod:`tiermem.train.homes.nvme_grads` and :mod:`tiermem.train.homes.nvme_state`, the off-device
weights in :mod:`tiermem.train.weights.param_offload`. Adding a tier (another rank's memory) is one
more class per interface and one more row in ``make_homes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, TypeVar

from tiermem.handles import wait_all
from tiermem.plan.buckets import Bucket
from tiermem.train.homes.grad_homes import GradHome
from tiermem.train.homes.state_homes import StateHome
from tiermem.train.homes.weight_homes import WeightHome
from tiermem.types import Tier

H = TypeVar("H")  # a kind of home


@dataclass(frozen=True)
class Homes:
    """Each bucket's three homes, by bucket index."""

    grads: dict[int, GradHome]
    state: dict[int, StateHome]
    weights: dict[int, WeightHome]
    #: weight homes of no trainable bucket (frozen weights sharded over the ranks alone: NOTE
    #: [Frozen weights sharded over the ranks]), told of updates and iterations like the others
    also: tuple[WeightHome, ...] = ()

    @staticmethod
    def _unique(homes: Mapping[int, H]) -> list[H]:
        seen: dict[int, H] = {}
        for h in homes.values():
            seen.setdefault(id(h), h)
        return list(seen.values())

    def grad_homes(self) -> list[GradHome]:
        return self._unique(self.grads)

    def state_homes(self) -> list[StateHome]:
        """Revertible homes first: a step that fails there has changed nothing else yet."""
        return sorted(self._unique(self.state), key=lambda h: not h.revertible)

    def weight_homes(self) -> list[WeightHome]:
        return self._unique({**self.weights, **{-1 - i: h for i, h in enumerate(self.also)}})

    def begin_update(self) -> None:
        """Every weight home's cached device copies are about to be stale (an update, a roll back, a load)."""
        for home in self.weight_homes():
            home.begin_update()

    def compute_tier(self, b: Bucket) -> Tier:
        return self.state[b.index].compute_tier

    def built(self) -> None:
        """Every home's initial writes have landed (NOTE [Initial writes in flight]); after all
        were waited for, the first error is raised."""
        error: Optional[BaseException] = None
        every: list[StateHome | WeightHome] = [*self.state_homes(), *self.weight_homes()]
        for home in every:
            try:
                home.built()
            except BaseException as e:  # noqa: BLE001 - the others are drained first, then it is raised
                error = error or e
        if error is not None:
            raise error

    def add(self, other: "Homes") -> None:
        """The homes of buckets appended to the model (NOTE [Freezing and unfreezing])."""
        assert not (other.grads.keys() & self.grads.keys()), "appended buckets reuse an index"
        self.grads.update(other.grads)
        self.state.update(other.state)
        self.weights.update(other.weights)


def wait_gathered(homes: Homes, fill: int) -> None:
    """Every grad home brings its grads where Adam runs; returns when all have arrived."""
    wait_all([h for home in homes.grad_homes() for h in home.gather(fill)])
