"""TieredModel's calls that mirror the wrapped module's own: ``train``, ``eval``, ``training`` (as
``nn.Module``'s) and ``generate`` (a transformers model's, NOTE [Inference only] in
tiermem/model/inference.py). :class:`~tiermem.TieredModel` has them as its own methods.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator, Self

import torch

from tiermem.errors import ConfigError
from tiermem.model.inputs import cast_inputs
from tiermem.plan import kv_cache
from tiermem.plan.model_plan import ModelPlan
from tiermem.plan.policy import Policy
from tiermem.types import Tier

__all__ = ["ModuleCalls"]


class ModuleCalls:
    """The module-like calls of :class:`~tiermem.TieredModel`, over what the model holds."""

    module: torch.nn.Module
    dtype: torch.dtype
    device: torch.device
    _generating: Callable[[], contextlib.AbstractContextManager]  # the model's: a forward's phase and checks
    placement: Policy  # the policy bound to the model: where the KV cache goes (NOTE [The KV cache is placed])
    stores: dict[Tier, Any]  # each tier's store, whose ledger holds the KV cache while generate runs
    model_plan: ModelPlan  # its footprint: what each tier keeps beside the cache

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
        mode is as it was afterwards. Works on a model built to train too. The KV cache's bytes are
        placed by the policy and held in a tier's ledger while it runs: the device, or the host when
        the device is short (NOTE [The KV cache is placed]).

        Returns:
            What the module's ``generate`` returns (token ids, or its output object).

        Raises:
            ConfigError: the module has no ``generate`` method, or the prompt is longer than its
                positions (``config.max_position_embeddings``).
            OutOfTierMemory: no tier has room for the KV cache (before generate runs).
        """
        module = self.module
        gen = getattr(module, "generate", None)
        if not inspect.ismethod(gen):
            raise ConfigError(
                f"tiermem: tm.generate(...) runs the module's own generate(), and {type(module).__name__} has "
                f"none; call tm(...) for a forward, or wrap a model that generates (a transformers GenerationMixin)"
            )
        _check_prompt(module, args, kwargs)
        args, kwargs = cast_inputs((args, kwargs), self.dtype, self.device)
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad(), self._generating(), self._kv_cache_placed(args, kwargs) as offload:
                return gen(*args, **({**kwargs, "cache_implementation": "offloaded"} if offload else kwargs))
        finally:
            module.train(was_training)

    @contextlib.contextmanager
    def _kv_cache_placed(self, args: tuple, kwargs: dict) -> Iterator[bool]:
        """The KV cache of ``generate(*args, **kwargs)`` held on its tier for the block (NOTE [The KV
        cache is placed]); yields whether generate must keep it on the host (offloaded, on CUDA)."""
        cache = kv_cache.for_call(self.module, args, kwargs, self.dtype)
        if cache is None:  # not a transformers decoder's cache: nothing to place
            yield False
            return
        chosen = kv_cache.chosen_cache(kwargs, self.module)
        with kv_cache.placed(
            cache,
            policy=self.placement,
            ledgers={t: s.ledger for t, s in self.stores.items()},
            footprint=self.model_plan.tier_bytes(),
            device=self.device,
            chosen=chosen,
        ) as tier:
            yield kv_cache.offloaded(tier, self.device, chosen)


def _check_prompt(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """A prompt longer than the model's positions is refused before anything runs: a model with
    learned positions would index past its table, one with rotary positions would run outside what
    it was trained for, silently."""
    prompt, positions = kv_cache.prompt_of(args, kwargs), kv_cache.positions_of(module)
    if prompt is not None and positions is not None:
        if prompt.shape[1] > positions:
            raise ConfigError(
                f"tiermem: tm.generate(...): the prompt has {prompt.shape[1]} tokens and the model has "
                f"{positions} positions (config.max_position_embeddings); shorten the prompt to at most "
                f"{positions} tokens (and leave room for max_new_tokens); nothing was generated"
            )
