"""A TieredModel built for inference only (``optimizer=None``): its parameters taken and given back,
and the training calls it refuses.

# NOTE [Inference only]
# ``TieredModel(module, policy, optimizer=None)`` (None given: left out, ``optimizer`` is AdamW())
# keeps the weights and nothing of a training step: no gradients, no master weights, no optimizer
# state. Every parameter is handled as a frozen one is (NOTE [Frozen weights keep one copy]): its
# working copy, in the working precision, at its PARAM home (the device, the host within its
# budget, NVMe), brought to the device by the same hooks, cache and recorded order as in training
# (NOTE [Parameters off the device]). In training an iteration of that order ends with the step's
# update; here it ends with each forward of the whole module (:func:`end_each_forward`: each token
# ``generate`` decodes), so later forwards follow the first one's trace and each forward's end
# fetches the next one's first weights ahead. To keep no second copy, each floating-point
# parameter takes the working dtype before planning (:meth:`Inference.take`: a tensor on the meta
# device only changes its dtype; a meta module's values then stream from ``weights=`` or its
# initialization straight into their homes in that dtype), so the working copy *is* the value:
# ``state_dict()``, ``detach()`` and ``save_pretrained()`` give it. ``requires_grad`` plays no
# part: every parameter is made frozen for the plan, and :meth:`Inference.give_back` hands the
# flags back as they were on ``detach()`` (a construction that fails gives back the tensors too).
# With no trainable parameter the plan has no bucket, so the footprint has no GRAD and no
# OPTIM_STATE bytes. ``tm.optimizer`` still lists the parameters in a group (torch refuses an
# optimizer of none; frozen parameters are listed so in training too), but ``tm.backward``,
# ``tm.step`` (and ``tm.optimizer.step()``) and ``add_param_group`` are refused with a ``tiermem:``
# error and change nothing; so are the options that only shape a step (grad_clip, overlap_step,
# update_in_backward), at construction. ``tm.generate(...)`` (tiermem/model/module_calls.py) runs
# the module's own ``generate`` in eval mode under ``torch.no_grad()`` on inputs moved to the
# device, the weights streamed by the hooks as for any forward; it works on a training model too.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import torch

from tiermem.errors import ConfigError
from tiermem.train.hooks import HookSet

__all__ = ["Inference", "building", "fold_linear_inputs", "end_each_forward", "refuse"]


class Inference:
    """The parameters of a module wrapped for inference: their ``requires_grad`` and tensors as
    given, changed by :meth:`take` and handed back by :meth:`give_back` / :meth:`undo`."""

    def __init__(self, module: torch.nn.Module):
        self._flags = [(p, p.requires_grad) for p in module.parameters()]  # tied weights once, in order
        self._data: list[tuple[torch.nn.Parameter, torch.Tensor]] = []  # until construction succeeds

    def take(self, dtype: torch.dtype) -> None:
        """Every parameter frozen, every floating-point one in ``dtype`` (its working copy is its value)."""
        for p, _ in self._flags:
            p.requires_grad_(False)
            if p.is_floating_point() and p.dtype != dtype:
                self._data.append((p, p.data))
                p.data = p.data.to(dtype)

    def built(self) -> None:
        """Construction succeeded: the tensors the module had are no longer kept."""
        self._data.clear()

    def undo(self) -> None:
        """Construction failed: the module's tensors and flags as they were."""
        for p, data in self._data:
            p.data = data
        self._data.clear()
        self.give_back()

    def give_back(self) -> None:
        """``detach()``: each parameter's ``requires_grad`` as it was given."""
        for p, flag in self._flags:
            p.requires_grad_(flag)


@contextlib.contextmanager
def building(inference: Optional[Inference], dtype: torch.dtype) -> Iterator[None]:
    """An inference-only model's parameters frozen and in ``dtype`` while it is built, as they were
    if building fails (NOTE [Inference only])."""
    if inference is None:
        yield
        return
    inference.take(dtype)
    try:
        yield
    except BaseException:
        inference.undo()
        raise
    inference.built()


def end_each_forward(module: torch.nn.Module, sources: Sequence[Any], hooks: HookSet) -> None:
    """After each forward of ``module``, every weight source's iteration ends (NOTE [Inference only])."""

    def ended(*_: Any) -> None:
        for source in sources:
            source.end_update()  # no update here: the iteration's end, the trace frozen and followed

    hooks.add(module.register_forward_hook(ended))


def fold_linear_inputs(module: torch.nn.Module, hooks: HookSet) -> None:
    """Each ``nn.Linear`` of ``module`` given a contiguous input when it has more than two dims.

    An inference-only model's weights do not require grad (NOTE [Inference only]), and torch's
    ``matmul`` then folds an input of more than two dims into one matrix product only where that
    needs no copy of it, its leading dims' strides nested; otherwise it multiplies it as a batch
    against the weight expanded to every row, a copy of the whole weight each call. With a weight
    that requires grad it always folds. The prefill's last-token slice (``hidden[:, -1:, :]``) is
    such an input, at batch 1 too, where ``is_contiguous()`` says True (a dim of size 1 ignores its
    stride): a bf16 ``lm_head`` of 32000 x 1024 took 258 ms for its copy at batch 1 and 1.79 s at
    batch 16, against 5.9 ms folded (torch 2.13, bench/RESULTS.md 2026-12-07). An input with
    fresh strides is folded either way; the copy costs a batch of activations."""

    def folded(_: torch.nn.Module, args: tuple[Any, ...]) -> Optional[tuple[Any, ...]]:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dim() > 2 and not _folds(x):
            return (x.clone(memory_format=torch.contiguous_format), *args[1:])
        return None

    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            hooks.add(m.register_forward_pre_hook(folded))


def _folds(x: torch.Tensor) -> bool:
    """Whether ``x`` (more than two dims) views as one matrix of rows without a copy, as torch's
    ``matmul`` checks before folding it."""
    size, stride = x.shape, x.stride()
    return all(stride[i] == stride[i + 1] * size[i + 1] for i in range(x.dim() - 2))


def refuse(call: str) -> ConfigError:
    """The error of a training call on an inference-only model."""
    return ConfigError(
        f"tiermem: {call}: this TieredModel was built for inference (optimizer=None): it keeps no "
        f"gradients and no optimizer state; to train, build it with an optimizer (leave optimizer= "
        f"out for tiermem.AdamW(), or pass one)"
    )
