"""What a run did with memory: peaks per tier and per (class, tier), bytes moved, stalls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from tiermem.errors import fmt_bytes
from tiermem.memory.base import Store
from tiermem.types import TensorClass, Tier


@dataclass
class Report:
    """What ``tm.report()`` returns: plain dicts keyed by :class:`~tiermem.Tier` and
    :class:`~tiermem.TensorClass`; ``str(report)`` is a table.

    Attributes:
        peak_bytes: peak managed bytes on each tier.
        class_peak_bytes: peak bytes of a class on a tier, keyed ``(TensorClass, Tier)``.
        bytes_moved: bytes copied from one tier to another, keyed ``(src, dst)``.
        stall_seconds: seconds the training thread waited on transfers, all tiers together.
        stall_seconds_per_tier: those seconds by the tier waited on.
        busy_seconds: seconds transfers ``(src, dst)`` were running (for :meth:`gbps`).
        budgets: each tier's budget in bytes.
        class_bytes_moved: bytes moved keyed ``(TensorClass, src, dst)``.
        steps: steps taken.
        n_params: trainable parameters.
        step_seconds: wall time spent inside ``step()``.
        rank: under data parallelism, this rank (the figures are its own).
        world: the number of ranks.
        collective_bytes: bytes this rank sent through collectives.
        placement: the policy that placed each tensor (a whole-model policy's decision in its repr).
        stages: seconds per step by stage, ``(predicted, measured)``; empty without a machine profile.
        weights_on_demand: per weight homed off the device, the reads that still waited for a fetch
            started on demand once the order of use was recorded (reads the prefetch did not foresee).
        activations_unplaced: per tensor subclass, the saved activations tiermem could neither place
            nor measure (a wrapper without ``__tensor_flatten__``: NOTE [Wrapper subclasses]).
        backward_again: under ``update_in_backward``, the backward passes run again over a kept
            graph (one per step not skipped, and one per micro-batch before a step's last outside
            ``tm.no_sync()``) and their seconds, updates included (NOTE [Updates in backward]).
    """

    peak_bytes: dict[Tier, int]
    class_peak_bytes: dict[tuple[TensorClass, Tier], int]
    bytes_moved: dict[tuple[Tier, Tier], int]
    stall_seconds: float
    stall_seconds_per_tier: dict[Tier, float] = field(default_factory=dict)
    busy_seconds: dict[tuple[Tier, Tier], float] = field(default_factory=dict)
    budgets: dict[Tier, int] = field(default_factory=dict)
    class_bytes_moved: dict[tuple[TensorClass, Tier, Tier], int] = field(default_factory=dict)
    steps: int = 0
    n_params: int = 0
    step_seconds: float = 0.0  # wall time spent inside step() calls
    rank: int = 0  # under data parallelism: this rank's figures, of ``world``
    world: int = 1
    collective_bytes: int = 0  # bytes this rank sent through collectives (reduce-scatter, all-gather, ...)
    placement: str = ""  # the policy that placed each tensor (a whole-model policy's decision in its repr)
    #: seconds per step by stage: (predicted by the cost model, measured); empty without a machine profile
    stages: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: weights homed off the device -> how many reads, once a step had recorded the order of use,
    #: still waited for a fetch started on demand: reads the prefetch schedule did not foresee
    weights_on_demand: dict[str, int] = field(default_factory=dict)
    #: tensor subclass -> saved activations of it left where they were, unmeasured (NOTE [Wrapper subclasses])
    activations_unplaced: dict[str, int] = field(default_factory=dict)
    #: update_in_backward: (second backward passes, their seconds with the updates they ran)
    backward_again: tuple[int, float] = (0, 0.0)

    def gbps(self, src: Tier, dst: Tier) -> float:
        """Achieved bandwidth of the transfers src -> dst while they ran (GB/s, 1e9 bytes).

        Args:
            src: the tier copied from.
            dst: the tier copied to.
        """
        busy = self.busy_seconds.get((src, dst), 0.0)
        return self.bytes_moved.get((src, dst), 0) / busy / 1e9 if busy > 0 else 0.0

    def __str__(self) -> str:
        return "\n".join(
            [
                self._headline(),
                *self._tier_lines(),
                *self._moved_lines(),
                *self._time_lines(),
                *self._unforeseen_lines(),
                *self._stage_lines(),
            ]
        )

    def _headline(self) -> str:
        """Steps, parameters and, under data parallelism, this rank and its collective bytes."""
        return f"tiermem report: {self.steps} steps, {self.n_params:,} trainable parameters" + (
            f"; rank {self.rank} of {self.world}, {fmt_bytes(self.collective_bytes)} through collectives"
            + (f" ({fmt_bytes(self.collective_bytes // self.steps)} per step)" if self.steps else "")
            if self.world > 1
            else ""
        )

    def _tier_lines(self) -> list[str]:
        """A row per tier used: its peak, budget, bytes per parameter and peak by class."""
        lines = [f"{'tier':<8}{'peak':>14}{'budget':>14}{'B/param':>10}   by class (peak)"]
        for tier in Tier:
            if tier not in self.peak_bytes:
                continue
            classes = ", ".join(
                f"{c.value} {fmt_bytes(n)}"
                for (c, t), n in sorted(self.class_peak_bytes.items(), key=lambda kv: kv[0][0].value)
                if t == tier and n
            )
            per = self.peak_bytes[tier] / self.n_params if self.n_params else 0.0
            budget = fmt_bytes(self.budgets[tier]) if tier in self.budgets else "-"
            lines.append(
                f"{tier.value:<8}{fmt_bytes(self.peak_bytes[tier]):>14}{budget:>14}{per:>10.2f}   {classes or '-'}"
            )
        return lines

    def _moved_lines(self) -> list[str]:
        """A row per pair of tiers bytes moved between: the bytes, their bandwidth, and by class."""
        moved = [(k, n) for k, n in self.bytes_moved.items() if n and k[0] != k[1]]
        if not moved:
            return []
        lines = [f"{'moved':<16}{'bytes':>14}{'GB/s':>10}   by class"]
        for (src, dst), n in sorted(moved, key=lambda kv: (kv[0][0].value, kv[0][1].value)):
            classes = ", ".join(
                f"{c.value} {fmt_bytes(b)}"
                for (c, s, d), b in sorted(self.class_bytes_moved.items(), key=lambda kv: kv[0][0].value)
                if (s, d) == (src, dst) and b
            )
            lines.append(
                f"{src.value + '->' + dst.value:<16}{fmt_bytes(n):>14}{self.gbps(src, dst):>10.2f}"
                + (f"   {classes}" if classes else "")
            )
        return lines

    def _time_lines(self) -> list[str]:
        """Seconds stalled on transfers, in ``step()`` and in backward passes run again."""
        stalls = ", ".join(f"{t.value} {s:.3f}s" for t, s in self.stall_seconds_per_tier.items() if s)
        lines = [
            f"stalled waiting on transfers: {self.stall_seconds:.3f}s"
            + (f" ({stalls})" if stalls else "")
            + (f"; time in step(): {self.step_seconds:.3f}s" if self.steps else "")
        ]
        if self.backward_again[0]:
            n, secs = self.backward_again
            lines.append(f"update in backward: {n} second backward passes, {secs:.3f}s with their updates")
        return lines

    def _unforeseen_lines(self) -> list[str]:
        """What tiermem did not foresee or could not place: weights fetched on demand, activations
        left unmeasured."""
        lines = []
        if self.weights_on_demand:
            top = sorted(self.weights_on_demand.items(), key=lambda kv: -kv[1])
            lines.append(
                f"weights fetched on demand (not prefetched): {sum(self.weights_on_demand.values())} reads; "
                + ", ".join(f"{k} x{n}" for k, n in top[:5])
                + (", ..." if len(top) > 5 else "")
            )
        if self.activations_unplaced:
            lines.append(
                "activations neither placed nor measured (tensor subclasses without __tensor_flatten__): "
                + ", ".join(f"{k} x{n}" for k, n in sorted(self.activations_unplaced.items()))
            )
        return lines

    def _stage_lines(self) -> list[str]:
        """Seconds per step by stage, predicted beside measured, and their sums."""
        if not self.stages:
            return []
        lines = [f"placement: {self.placement}", f"{'per step':<26}{'predicted':>12}{'measured':>12}"]
        for stage, (predicted, measured) in self.stages.items():
            lines.append(f"{stage:<26}{predicted * 1e3:>10.1f}ms{measured * 1e3:>10.1f}ms")
        p, m = (sum(v[i] for v in self.stages.values()) for i in (0, 1))
        lines.append(f"{'step':<26}{p * 1e3:>10.1f}ms{m * 1e3:>10.1f}ms")
        return lines


def collect(
    stores: Mapping[Tier, Store],
) -> tuple[dict[Tier, int], dict[tuple[TensorClass, Tier], int], dict[Tier, int]]:
    """Peaks per tier and per (class, tier), and the budgets, read off the stores' ledgers."""
    peak, class_peak, budgets = {}, {}, {}
    for tier, store in stores.items():
        peak[tier] = store.ledger.peak
        budgets[tier] = store.ledger.allowed
        for kind, n in store.ledger.kind_peak.items():
            if isinstance(kind, TensorClass):
                class_peak[(kind, tier)] = n
    return peak, class_peak, budgets
