"""What a checkpoint, ``state_dict()`` and ``detach()`` see of a TieredModel, in two jobs over one core:

- :class:`StateReader` (:mod:`.reading`): what a save, ``state_dict()``, ``save_pretrained()`` and
  ``detach()`` read out;
- :class:`StateWriter` (:mod:`.writing`): what a load must find in a checkpoint and writes in, and
  what user code wrote into the weights;
- :class:`StateCore` (:mod:`.core`): what both reach (the module, layout, step counts, process
  group, this process's pieces of each bucket) and whether the last load failed part way.

Every tensor is named by parameter (:class:`tiermem.checkpoint.names.StateName`: ``master/<param>``,
``exp_avg/<param>``, ... for each part of its state format, NOTE [State formats];
``frozen/<param>``, ``buffers/<buffer>``), never by bucket. :class:`ModelState` is the three as a
TieredModel holds them; :mod:`tiermem.checkpoint` takes its reader to save and its writer to load
and knows nothing else of the model.
"""

from __future__ import annotations

import torch

from tiermem.checkpoint.view.core import HYPER, MEMBERS, PartPieces, Piece, StateCore
from tiermem.checkpoint.view.reading import StateReader
from tiermem.checkpoint.view.writing import StateWriter

__all__ = ["HYPER", "MEMBERS", "ModelState", "PartPieces", "Piece", "StateCore", "StateReader", "StateWriter"]


class ModelState:
    """A TieredModel's state as a checkpoint sees it: ``core``, its ``reader`` and its ``writer``,
    built over one core. The model's own calls (guarding a half-loaded model, ``state_dict()``,
    ``detach()``, a resident block's writes) go to the one of them that does that job."""

    def __init__(self, core: StateCore):
        self.core = core
        self.reader = StateReader(core)
        self.writer = StateWriter(core)

    def check_loaded(self, call: str) -> None:
        """:meth:`StateCore.check_loaded`: refuse ``call`` while a failed load left the model half loaded."""
        self.core.check_loaded(call)

    def module_state(self) -> dict[str, torch.Tensor]:
        """:meth:`StateReader.module_state`: ``module.state_dict()``'s keys, fp32 weights."""
        return self.reader.module_state()

    def fp32_weights(self) -> dict[str, torch.Tensor]:
        """:meth:`StateReader.fp32_weights`: every parameter name -> a CPU copy of its fp32 value."""
        return self.reader.fp32_weights()

    def take_weights(self, values: dict[str, torch.Tensor]) -> None:
        """:meth:`StateWriter.take_weights`: what user code wrote into the weights becomes the masters."""
        self.writer.take_weights(values)
