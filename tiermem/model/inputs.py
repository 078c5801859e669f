"""What ``tm(...)`` does to its inputs: floating-point tensors cast to the working precision, every
tensor moved to the device, wherever it sits in the arguments.

Containers are opened with ``torch.utils._pytree``'s node registry (tuples, lists, NamedTuples,
dicts and whatever else is registered with it, as ``torch.compile`` and ``torch.export`` open
them), one level at a time (``tree_map`` would leave a reference cycle per call, from its
recursive closure, for the GC to find on every forward); two kinds it leaves as leaves are opened
here too: any ``Mapping`` (transformers' ``BatchEncoding``, a dict subclass) and dataclass
instances. Each container comes back as its own type with the same contents, converted; a
container that cannot be rebuilt with converted contents is refused with a ``tiermem:`` error,
never passed on unconverted. :func:`check_loss` is what ``tm.backward(loss)`` accepts.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from tiermem.errors import ConfigError

__all__ = ["cast_inputs", "check_loss"]


def cast_inputs(obj: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """``obj`` with every tensor on ``device`` and every floating-point one in ``dtype`` (one copy
    at most; a tensor already so is passed as it is)."""
    x = obj
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)
    if not pytree.tree_is_leaf(x):  # a container pytree knows
        node = pytree.SUPPORTED_NODES[pytree._get_node_type(x)]
        children, context = node.flatten_fn(x)
        return node.unflatten_fn([cast_inputs(c, dtype, device) for c in children], context)
    if isinstance(x, Mapping):
        return _mapping(x, {k: cast_inputs(v, dtype, device) for k, v in x.items()})
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _dataclass(x, dtype, device)
    return x


def _mapping(x: Mapping, converted: dict) -> Mapping:
    """``x`` as its own type with the ``converted`` values."""
    if all(converted[k] is v for k, v in x.items()):
        return x  # nothing to convert
    if isinstance(x, MutableMapping):
        out = copy.copy(x)  # keeps what else the instance holds (BatchEncoding's encodings)
        for k, v in converted.items():
            out[k] = v
        return out
    try:
        return type(x)(converted)  # type: ignore[call-arg]
    except Exception as e:  # noqa: BLE001 - any way of failing means it cannot be rebuilt
        raise ConfigError(
            f"tiermem: tm(...) got a {type(x).__name__} (a read-only Mapping) holding tensors to move "
            f"or cast, and cannot rebuild it ({type(e).__name__}: {e}); pass a dict instead"
        ) from None


def _dataclass(x: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """A copy of the dataclass instance ``x`` with each field converted (frozen ones too; no
    ``__init__`` or ``__post_init__`` runs again)."""
    changed = {}
    for f in dataclasses.fields(x):
        value = getattr(x, f.name)
        new = cast_inputs(value, dtype, device)
        if new is not value:
            changed[f.name] = new
    if not changed:
        return x
    out = copy.copy(x)
    for name, value in changed.items():
        object.__setattr__(out, name, value)
    return out


def check_loss(loss: Any) -> None:
    """What ``tm.backward(loss)`` accepts: a scalar tensor that requires grad."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError(
            f"tiermem: backward() needs a scalar loss tensor, got "
            f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}; "
            f"reduce the loss to one number (e.g. .mean())"
        )
    if not loss.requires_grad:
        raise ConfigError(
            "tiermem: backward() got a loss that does not require grad; compute it from "
            "tm(...) outside torch.no_grad() and with the module in train mode"
        )
