"""``tm.resident(what)``'s block: the named parameters real tensors on the device, their writes the model's.

Split out of :mod:`tiermem.model.model_views` (which keeps the public method and its checks of the phase):
which homes hold each parameter, the blocks of those that hold weights off the device, and the
writes handed to the model's state when the block ends.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from tiermem.checkpoint.view import ModelState
from tiermem.errors import ConfigError


@contextlib.contextmanager
def resident(what: Any, module: torch.nn.Module, sources: list, state: ModelState) -> Iterator[None]:
    """The parameters of ``what`` resident for the block (``sources``: the model's weight sources,
    TieredModel.weight_sources()); what the block wrote goes to ``state`` when it ends."""
    params = params_of(what, module)
    filled: list[dict[str, torch.Tensor]] = []  # what each home's block wrote, once it ends
    with contextlib.ExitStack() as blocks:
        off = []
        for source in sources:
            mine = [n for n in params if n in source.homes]
            if mine:
                filled.append(blocks.enter_context(source.resident(mine)))
                off += mine
        on = {n: p for n, p in params.items() if n not in off}
        versions = {n: p._version for n, p in on.items()}
        yield
    written = {n: v for values in filled for n, v in values.items()}
    # a weight on the device may share its version counter with others of its bucket: the
    # elements that differ from their masters are what was written (ModelState.take_weights)
    changed = {**{n: p.detach() for n, p in on.items() if p._version != versions[n]}, **written}
    if changed:
        state.take_weights(changed)


def params_of(what: Any, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Canonical name -> parameter, for a module of ``module``, a parameter of it, or several."""
    names = {id(p): n for n, p in module.named_parameters()}
    items = [what] if isinstance(what, (torch.nn.Module, torch.Tensor)) else list(what)
    out: dict[str, torch.Tensor] = {}
    for item in items:
        for p in item.parameters() if isinstance(item, torch.nn.Module) else [item]:
            if not isinstance(p, torch.Tensor) or id(p) not in names:
                raise ConfigError(
                    f"tiermem: resident() takes modules and parameters of the wrapped model; got "
                    f"{type(p).__name__}{tuple(p.shape) if isinstance(p, torch.Tensor) else ''}, "
                    f"which is not one of its parameters"
                )
            out[names[id(p)]] = p
    return out
