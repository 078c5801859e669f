"""The backward passes of a step under ``update_in_backward=True`` (NOTE [Updates in backward] in
:mod:`tiermem.train.step.in_backward`): which backward keeps its graph, which lands in the accumulation
homes, and the step's second pass."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

import torch

from tiermem.train.step.grads import GradCollector
from tiermem.train.step.in_backward import WindowGrads


class Passes:
    """The backward passes of a step under update_in_backward (NOTE [Updates in backward]): a
    first pass keeping its graph, the same graph's backward again into the accumulation homes
    when another backward follows (it was not the step's last), or at the step, updating; and a
    backward inside ``tm.no_sync()``, straight into the accumulation homes (under data
    parallelism, kept on the device unsent, as the default step keeps them). Counts the passes
    over a kept graph and their seconds (``tm.report().backward_again``)."""

    def __init__(self, window: WindowGrads, grads: GradCollector):
        self.window, self.grads = window, grads
        self.runs = 0
        self.seconds = 0.0

    @property
    def kept(self) -> bool:
        """A backward of this step kept its graph: it is the step's last so far."""
        return self.window.graph is not None

    def prepare(self) -> None:
        """Before a backward: the accumulation homes, when it will accumulate (raises, changing
        nothing, when the budgets have no room for them)."""
        if self.kept or self.window.deferred:
            self.window.prepare()

    def replay(self) -> None:
        """The kept graph's backward again, landing in the accumulation homes, its graph freed: a
        backward follows, so the one that kept it was not the step's last. If it fails, the step's
        gradients are dropped (that micro-batch's are in neither place)."""
        graph = self.window.graph
        assert graph is not None, "replay() without a kept graph"
        self.window.graph = None
        self.grads.again(True)
        deferred = self.window.deferred
        self._defer(False)  # the backward that kept it ran outside no_sync(): its grads are sent
        try:
            with self.timed():
                self._accumulate(lambda: graph.backward())  # not kept: its activations go
        except BaseException:
            self.grads.drop()
            raise
        finally:
            self._defer(deferred)
            self.grads.again(False)

    def backward(self, scaled: torch.Tensor) -> None:
        """tm.backward()'s own pass: inside no_sync() one pass into the accumulation homes; else a
        first pass (the norms), its graph kept for the step or the next backward's replay."""
        if self.window.deferred:
            self._accumulate(lambda: scaled.backward())
            return
        self.window.first = True
        try:
            scaled.backward(retain_graph=True)
            self.grads.end_backward()
        finally:
            self.window.first = False
        self.window.graph = scaled

    def again(self) -> None:
        """The step's second pass, over the kept graph (the same graph and loss scale), the graph
        kept once more (a retry of a step that updated nothing)."""
        graph = self.window.graph
        assert graph is not None, "again() without a kept graph"
        graph.backward(retain_graph=True)
        self.grads.end_backward()

    def _accumulate(self, run: Callable[[], None]) -> None:
        """``run`` a backward whose gradients land in the accumulation homes; they have landed
        on return (the window reads them when the step's last backward adds to them). Inside
        no_sync() under data parallelism they stay on the device, unsent (NOTE [Updates in
        backward]): a later pass or the step sends them."""
        self.window.accumulate(True)
        try:
            run()
            self.grads.end_backward()
            if self.window.sharded and self.window.deferred:
                self.grads.wait_copies()  # kept on the device, sent by a later backward or the step
            else:
                self.grads.settle()  # its copies and NVMe flushes landed (a failure drops the step's grads)
        finally:
            self.window.accumulate(False)
        self.grads.accumulated()

    def _defer(self, on: bool) -> None:
        """Every GRAD home deferring its communication or not (as ``tm.no_sync()`` sets them)."""
        for home in self.grads.homes.grad_homes():
            home.defer(on)

    def drop_graph(self) -> None:
        """The kept graph goes, the gradients stay (a step that failed after updating some buckets)."""
        self.window.graph = None

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Counts one pass over a kept graph and its seconds, updates included."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.runs += 1
            self.seconds += time.perf_counter() - t0
