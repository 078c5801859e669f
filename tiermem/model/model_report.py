"""``tm.report()``'s assembly: the stores' peaks, the engine's traffic and the step's stages, in one Report.

Split out of :mod:`tiermem.model.model_views`, which keeps the public method and its docstring and passes
the collaborators this reads (nothing here holds state of its own).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from tiermem.observe.report import Report, collect
from tiermem.plan.cost import against_measured


def assemble(
    *,
    stores: Any,
    engine: Any,
    stepper: Any,
    layout: Any,
    group: Any,
    placement: Any,
    evaluator: Any,
    sources: list,
    compute_seconds: float,
    activations: Any,
) -> Report:
    """The model's Report (``sources``: TieredModel.weight_sources(); ``compute_seconds``: the
    measured forward+backward of the training calls so far; ``activations``: their ActivationStats)."""
    peak, class_peak, budgets = collect(stores)
    st = engine.stats.snapshot()
    return Report(
        peak_bytes=peak,
        class_peak_bytes=class_peak,
        bytes_moved=st["bytes_moved"],
        stall_seconds=sum(st["stall_seconds"].values()),
        stall_seconds_per_tier=st["stall_seconds"],
        busy_seconds=st["busy_seconds"],
        budgets=budgets,
        steps=stepper.steps,
        class_bytes_moved=st["class_bytes_moved"],
        n_params=layout.n_params,
        step_seconds=stepper.seconds,
        rank=group.rank,
        world=group.world,
        collective_bytes=group.bytes_sent(),
        placement=repr(placement),
        stages=stages(stepper, placement, evaluator, compute_seconds),
        weights_on_demand=dict(sum((s.on_demand for s in sources), Counter())),
        backward_again=(0, 0.0) if stepper.passes is None else (stepper.passes.runs, stepper.passes.seconds),
        activations_unplaced=dict(activations.unplaced),
    )


def stages(stepper: Any, placement: Any, evaluator: Any, compute_seconds: float) -> dict[str, tuple[float, float]]:
    """Predicted against measured seconds per step, by stage (NOTE [Cost model]; the prediction fed
    the measured forward+backward); empty before a step, or when no machine profile exists and
    the placement needed none."""
    steps = stepper.steps
    predicted = evaluator.predict(placement, compute_seconds / steps) if steps else None
    if predicted is None:
        return {}
    return against_measured(
        predicted,
        forward_backward=compute_seconds / steps,
        grads_home=stepper.wait_seconds / steps,
        step=stepper.seconds / steps,
    )
