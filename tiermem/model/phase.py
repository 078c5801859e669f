"""The phase of a training step, as one field checked at every public call.

# NOTE [Step lifecycle]
A TieredModel is always in exactly one :class:`Phase`. The public calls move it:

    IDLE --tm(x)--> FORWARD --returns--> IDLE (or GRADS_READY, when earlier micro-batches wait)
    IDLE / GRADS_READY --tm.backward()--> BACKWARD --returns--> GRADS_READY
                                                   --raises--> IDLE (the step's grads are dropped)
    GRADS_READY --tm.step()--> STEPPING --returns--> IDLE
                                        --raises--> GRADS_READY (grads kept: retry) or IDLE (dropped)
    any --tm.detach()--> DETACHED (final; also on leaving ``with TieredModel(...) as tm:``)

A model dropped in any phase but DETACHED gives back its threads, memory, files and lock when
it is collected, without restoring the module's weights (NOTE [A dropped model lets go] in
:mod:`tiermem.model.lifetime`).

A call that its phase does not allow (a step from inside a backward hook, a forward after
detach) raises a ``tiermem:`` error naming the phase and what to do, before anything changes.
Under overlap_step an update of the previous step may be running in the background in any
phase; that is the stepper's to track (it lands at the next step, save or detach).
"""

from __future__ import annotations

import contextlib
from enum import Enum
from typing import Iterator

from tiermem.errors import ConfigError


class Phase(Enum):
    """Where in the training step a :class:`~tiermem.TieredModel` is (``tm.phase``).

    A call that its phase does not allow (``tm.step()`` from a backward hook, ``tm.save()`` from a
    forward hook, anything after ``detach()``) is refused with a ``tiermem:`` error before anything
    changes (NOTE [Step lifecycle]).
    """

    IDLE = "idle"  # no gradients wait for a step
    FORWARD = "forward"  # inside tm(...)
    BACKWARD = "backward"  # inside tm.backward(...)
    GRADS_READY = "grads ready"  # backward ran; its gradients wait for tm.step()
    STEPPING = "stepping"  # inside tm.step()
    DETACHED = "detached"  # tm.detach() gave the module back


#: the phases each public call may start from
ALLOWED: dict[str, frozenset[Phase]] = {
    "forward": frozenset({Phase.IDLE, Phase.GRADS_READY}),
    "backward": frozenset({Phase.IDLE, Phase.GRADS_READY}),
    "step": frozenset({Phase.IDLE, Phase.GRADS_READY}),
    "state": frozenset({Phase.IDLE, Phase.GRADS_READY}),  # save, load, state_dict, detach, report
}

_FIX = {
    Phase.DETACHED: "this TieredModel was detached; wrap the module again to keep training",
    Phase.FORWARD: "it was called from inside tm(...) (a forward hook or the module itself); call it after "
    "the forward returns",
    Phase.BACKWARD: "it was called from inside tm.backward() (a backward or grad hook); call it after backward returns",
    Phase.STEPPING: "it was called from inside tm.step() (an lr scheduler or hook); call it after the step returns",
}


class Lifecycle:
    """Holds the phase; :meth:`enter` checks a call against :data:`ALLOWED` and moves the phase."""

    def __init__(self) -> None:
        self.phase = Phase.IDLE

    def check(self, call: str, name: str | None = None) -> None:
        """Refuse ``call`` (a key of :data:`ALLOWED`; the error says ``name``, default ``call``)
        unless the phase allows it."""
        if self.phase not in ALLOWED[call]:
            raise ConfigError(
                f"tiermem: {name or call} is not allowed while the model is {self.phase.value}: {_FIX[self.phase]}"
            )

    @contextlib.contextmanager
    def during(self, call: str, phase: Phase) -> Iterator[None]:
        """Check ``call``, hold ``phase`` while it runs, and go back to the phase it started from
        (the caller sets the outcome with :meth:`to` afterwards)."""
        self.check(call)
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            if self.phase is phase:
                self.phase = before

    def to(self, phase: Phase) -> None:
        self.phase = phase
