"""Two threads taking turns: the step's second backward and the update it feeds (NOTE [Updates in
backward] in :mod:`tiermem.train.step.in_backward`)."""

from __future__ import annotations

import threading
from typing import Callable, Optional


class Stopped(Exception):
    """Backward ended (or failed) before a bucket the update waits for landed."""


class Relay:
    """Two threads taking turns: the one running backward ("main") and the update
    (NOTE [Updates in backward]). The update runs until it waits for a bucket that has not landed; backward runs until
    it completes the bucket the update waits for. Exactly one of them runs at any time."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._turn = "main"
        self._landed: set[int] = set()
        self._waiting: Optional[int] = None
        self._closed = False  # backward is over: no more buckets will land
        self.finished = False
        self.error: Optional[BaseException] = None

    def start(self, update: Callable[[], None]) -> None:
        """Run ``update`` on its own thread until it first waits for a bucket (or ends)."""
        thread = threading.Thread(target=self._run, args=(update,), name="tiermem-update-in-backward", daemon=True)
        with self._cv:
            self._turn = "update"
            thread.start()
            self._cv.wait_for(lambda: self._turn == "main")

    def _run(self, update: Callable[[], None]) -> None:
        try:
            update()
        except BaseException as e:  # noqa: BLE001 - raised by the thread running backward, once backward is over
            self.error = e
        finally:
            with self._cv:
                self.finished = True
                self._turn = "main"
                self._cv.notify_all()

    # -- the update's side ---------------------------------------------------------------------------
    def wait_for(self, index: int) -> None:
        """Until bucket ``index`` has landed: backward runs meanwhile."""
        with self._cv:
            while index not in self._landed:
                if self._closed:
                    raise Stopped(f"backward ended before bucket {index}'s gradients landed")
                self._waiting, self._turn = index, "main"
                self._cv.notify_all()
                self._cv.wait_for(lambda: self._turn == "update")
            self._waiting = None
            self._landed.discard(index)

    # -- backward's side -----------------------------------------------------------------------------
    def landed(self, index: int) -> None:
        """Bucket ``index``'s gradients are on their way: the update takes it when it waits for it."""
        with self._cv:
            self._landed.add(index)
            if self._waiting == index and not self.finished:
                self._turn = "update"
                self._cv.notify_all()
                self._cv.wait_for(lambda: self._turn == "main")

    def close(self) -> None:
        """Backward is over (or failed): the update runs to its end, or fails waiting for a
        bucket that will not land."""
        with self._cv:
            self._closed = True
            if not self.finished:
                self._turn = "update"
                self._cv.notify_all()
                self._cv.wait_for(lambda: self.finished)
