"""TieredModel's conveniences around the training calls: ``phase``, ``resident`` (weights held on the
device for a block), ``report()``, the weight sources, and its ``repr``.

None of them is part of a step: each reads what the model holds (``resident`` also hands the block's
writes to the model's state). The work is done in :mod:`tiermem.model.resident_block` and
:mod:`tiermem.model.model_report`; :class:`~tiermem.TieredModel` has them as its own methods.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from tiermem.checkpoint.view import ModelState
from tiermem.model.model_report import assemble as assemble_report
from tiermem.model.phase import Lifecycle, Phase
from tiermem.model.resident_block import resident as resident_block
from tiermem.observe.report import Report
from tiermem.plan.policy import Policy
from tiermem.train.layout import Layout
from tiermem.train.step.stepper import Stepper
from tiermem.transfer.collectives import Group

__all__ = ["ModelViews"]


class ModelViews:
    """The read-only views of :class:`~tiermem.TieredModel`, over the collaborators it holds."""

    module: torch.nn.Module
    policy: Policy
    precision: str
    placement: Policy
    _evaluator: Any
    stores: dict
    engine: Any
    stepper: Stepper
    layout: Layout
    group: Group
    activations: Any
    param_offload: Optional[Any]
    gathered: Optional[Any]
    _life: Lifecycle
    _state: ModelState
    _compute_seconds: float
    _settled: Callable[..., ModelState]  # StateCalls': the state with nothing in flight, the phase checked

    @property
    def phase(self) -> Phase:
        """Where in the training step the model is (NOTE [Step lifecycle])."""
        return self._life.phase

    def weight_sources(self) -> list:
        """The homes whose weights are OffDeviceWeights: ParamOffload (weights off the device in one
        process, and frozen ones), GatheredWeights (sharded over the ranks)."""
        return [s for s in (self.param_offload, self.gathered) if s is not None]

    @contextlib.contextmanager
    def resident(self, what: "torch.nn.Module | torch.Tensor | Iterable[torch.Tensor]") -> Iterator[None]:
        """Explicit access to weights outside ``tm(...)``: inside the block the parameters of
        ``what`` (a module of the model, a parameter, or several of either) are real tensors on
        the device, those homed off the device held there for the block. Writes into them (in
        place, under ``torch.no_grad()``: ``p.mul_(0.5)``, ``p.copy_(new)``, ``nn.init``) become the
        model's weights: when the block ends they reach the weights' home tier and the fp32 master
        weights the optimizer updates. Reads of an off-device weight outside such a block work too
        (fetched for each op); writes outside it are refused (NOTE [Parameters off the device]).
        Under ZeRO-3 it gathers sharded weights: enter it on every rank.

        Args:
            what: a module of the wrapped model, one of its parameters, or an iterable of either.
        """
        self._settled("resident()")
        with resident_block(what, self.module, self.weight_sources(), self._state):
            yield

    def report(self) -> Report:
        """What the run did with memory so far: peak bytes per tier and per (class, tier), bytes
        moved between tiers and their GB/s, seconds stalled on transfers, and, with a machine
        profile, predicted against measured seconds per stage. ``print(tm.report())`` shows a table.

        Returns:
            A :class:`~tiermem.Report` of plain dicts keyed by :class:`~tiermem.Tier` and
            :class:`~tiermem.TensorClass`.
        """
        return assemble_report(
            stores=self.stores,
            engine=self.engine,
            stepper=self.stepper,
            layout=self.layout,
            group=self.group,
            placement=self.placement,
            evaluator=self._evaluator,
            sources=self.weight_sources(),
            compute_seconds=self._compute_seconds,
            activations=self.activations.stats,
        )

    def __repr__(self) -> str:
        return (
            f"TieredModel({type(self.module).__name__}, policy={self.policy!r}, precision={self.precision!r}, "
            f"params={self.layout.n_params:,}, buckets={len(self.layout.buckets)})"
        )
