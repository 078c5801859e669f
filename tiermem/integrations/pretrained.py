"""``tiermem.from_pretrained(path, ...)``: a transformers checkpoint straight into a TieredModel.

The model class comes from the checkpoint's ``config.json`` (its ``architectures``, else
``AutoModelForCausalLM``), is built on the meta device (no memory), and ``TieredModel(...,
weights=path)`` reads each tensor into its homes (NOTE [Models on the meta device]).
transformers is imported here only, when this is called.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from tiermem.errors import ConfigError
from tiermem.model.tiered_model import TieredModel
from tiermem.plan.policy import Policy

__all__ = ["from_pretrained"]


def _build(transformers: Any, config: Any) -> torch.nn.Module:
    """The model ``config`` describes, built in the current device context."""
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls(config)
    return transformers.AutoModelForCausalLM.from_config(config)


def from_pretrained(path: str | os.PathLike[str], policy: Optional[Policy] = None, **kwargs: Any) -> TieredModel:
    """A :class:`~tiermem.TieredModel` of the transformers model saved at ``path``, never whole in
    memory: built on the meta device, each weight read from the checkpoint into its home.

    Args:
        path: a directory with ``config.json`` and safetensors weights (what ``save_pretrained`` of
            transformers or of a TieredModel writes).
        policy: the placement policy (default: ZeroOffload).
        kwargs: the other arguments of :class:`~tiermem.TieredModel` (optimizer, precision, nvme_dir, ...).
    """
    try:
        import transformers
    except ImportError as e:
        raise ConfigError(
            "tiermem: from_pretrained needs transformers; pip install 'tiermem[hf]' (or build the model yourself "
            "and pass TieredModel(model, weights=path))"
        ) from e
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"tiermem: from_pretrained({path!r}): no config.json there; pass a directory transformers' "
            f"save_pretrained (or tm.save_pretrained) wrote"
        )
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = _build(transformers, config)
    return TieredModel(model, policy, weights=path, **kwargs)
