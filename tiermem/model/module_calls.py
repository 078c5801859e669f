"""TieredModel's calls that mirror the wrapped module's own: ``train``, ``eval``, ``training`` (as
``nn.Module``'s) and ``generate`` (a transformers model's, NOTE [Inference only] in
tiermem/model/inference.py). :class:`~tiermem.TieredModel` has them as its own methods.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Self

import torch

from tiermem.errors import ConfigError
from tiermem.model.inputs import cast_inputs

__all__ = ["ModuleCalls"]


class ModuleCalls:
    """The module-like calls of :class:`~tiermem.TieredModel`, over what the model holds."""

    module: torch.nn.Module
    dtype: torch.dtype
    device: torch.device
    _generating: Callable[[], contextlib.AbstractContextManager]  # the model's: a forward's phase and checks

    def train(self, mode: bool = True) -> Self:
        """Set the module's training mode, as ``nn.Module.train``; returns ``self``.

        Args:
            mode: True for training (activations saved and placed by the policy), False for eval.
        """
        self.module.train(mode)
        return self

    def eval(self) -> Self:
        """``train(False)``: forwards run as in evaluation; returns ``self``."""
        return self.train(False)

    @property
    def training(self) -> bool:
        """The module's training mode."""
        return self.module.training

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own ``generate(*args, **kwargs)`` (a transformers model's: greedy, sampling,
        beam search), in eval mode under ``torch.no_grad()``, its tensors moved to the device as in
        ``tm(...)`` and the weights streamed from their homes (NOTE [Inference only]); the module's
        mode is as it was afterwards. Works on a model built to train too.

        Returns:
            What the module's ``generate`` returns (token ids, or its output object).

        Raises:
            ConfigError: the module has no ``generate`` method.
        """
        module = self.module
        gen = getattr(module, "generate", None)
        if gen is None or not callable(gen) or not inspect.ismethod(gen):
            raise ConfigError(
                f"tiermem: tm.generate(...) runs the module's own generate(), and {type(module).__name__} has "
                f"none; call tm(...) for a forward, or wrap a model that generates (a transformers GenerationMixin)"
            )
        args, kwargs = cast_inputs((args, kwargs), self.dtype, self.device)
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad(), self._generating():
                return gen(*args, **kwargs)
        finally:
            module.train(was_training)
