"""A DeepSpeed config's ``optimizer`` block as a tiermem optimizer spec: ``Adam``/``AdamW`` as
:class:`tiermem.AdamW`/:class:`tiermem.Adam`, ``Adagrad`` and ``Lion`` as tiermem's, with
DeepSpeed's defaults for what a block leaves out (NOTE [DeepSpeed config] in
:mod:`tiermem.integrations.deepspeed.walk`)."""

from __future__ import annotations

from typing import Any, Mapping

from tiermem.config.optimizers import Adagrad, Lion
from tiermem.config.specs import Adam, AdamW
from tiermem.errors import ConfigError
from tiermem.integrations.deepspeed.reader import ABSENT, NO_SUCH_SETTING, Reader, block, short

__all__ = ["OPTIMIZER_BLOCKS", "optimizer_spec"]

_ADAM_IGNORED = {
    k: "tiermem's Adam is its own fused kernel, on the CPU or the device by policy" for k in ("torch_adam", "fused")
}
#: Adam's hyperparameters: DeepSpeed's defaults for those the config leaves out
_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def optimizer_spec(r: Reader, cfg: Mapping):
    """The ``optimizer`` block as a tiermem spec, by :data:`OPTIMIZER_BLOCKS` (no block: AdamW)."""
    opt = block(cfg, "optimizer", "")
    kind = opt.get("type", "AdamW" if not opt else ABSENT)
    if kind is ABSENT or not isinstance(kind, str) or kind.lower() not in OPTIMIZER_BLOCKS:
        raise ConfigError(
            f"tiermem: DeepSpeed config optimizer.type={short(None if kind is ABSENT else kind)} is "
            f"not supported: tiermem runs the types {', '.join(repr(k) for k in OPTIMIZER_BLOCKS)} (in any "
            f'case); write "AdamW" (or another of them)'
        )
    for key in opt:
        if key not in ("type", "params"):
            r.note(f"optimizer.{key}", opt[key], NO_SUCH_SETTING)
    return OPTIMIZER_BLOCKS[kind.lower()](r, kind, block(opt, "params", "optimizer."))


def _adam_block(r: Reader, kind: str, params: Mapping):
    """``Adam``/``AdamW``: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``adam_w_mode``."""
    unknown = sorted(set(params) - {*_ADAM_DEFAULTS, "adam_w_mode", *_ADAM_IGNORED, "bias_correction", "amsgrad"})
    if unknown:
        raise ConfigError(
            f"tiermem: DeepSpeed config optimizer.params has {unknown}, which Adam does not take; "
            f"use lr, betas, eps, weight_decay, adam_w_mode"
        )
    if params.get("bias_correction", True) is not True or params.get("amsgrad", False) is not False:
        raise ConfigError(
            "tiermem: DeepSpeed config optimizer.params asks for Adam without bias correction or "
            "with amsgrad; tiermem's Adam is torch's default (bias_correction true, amsgrad false)"
        )
    for key in _ADAM_IGNORED:
        if key in params:
            r.note(f"optimizer.params.{key}", params[key], _ADAM_IGNORED[key])
    w_mode = params.get("adam_w_mode", True)
    if not isinstance(w_mode, bool) or (kind.lower() == "adamw" and not w_mode):
        raise ConfigError(
            f"tiermem: DeepSpeed config optimizer.params.adam_w_mode={short(w_mode)} with type "
            f'{kind!r}: write true/false with "Adam" (false: L2 penalty) or drop it with "AdamW"'
        )
    return _spec_of(r, AdamW if w_mode else Adam, params, _ADAM_DEFAULTS)


def _spec_of(r: Reader, spec: type, params: Mapping, defaults: dict[str, Any]):
    """``spec`` built from the block's ``params`` (``defaults``, DeepSpeed's, for what it leaves out)
    and the groups' overrides; the spec's own error, said as the block's."""
    hyper = {
        k: r.take(
            f"optimizer.params.{k}",
            params.get(k, ABSENT),
            k,
            default=default,
            norm=lambda v: tuple(v) if isinstance(v, list) else v,
        )  # JSON's betas are a list
        for k, default in defaults.items()
    }
    for key in ("no_decay", "no_decay_1d"):
        if key in r.overrides:
            hyper[key] = r.overrides[key]
    try:
        return spec(**hyper)
    except ConfigError as e:
        raise ConfigError(f"tiermem: DeepSpeed config optimizer block: {str(e).removeprefix('tiermem: ')}") from None


def _plain_block(spec: type, defaults: dict[str, Any]):
    """The reader of a ``params`` block that maps key for key onto ``spec`` (DeepSpeed's defaults
    for what it leaves out): Adagrad (``lr``, ``eps``, ``weight_decay``), Lion (``lr``, ``betas``,
    ``weight_decay``)."""

    def read(r: Reader, kind: str, params: Mapping):
        unknown = sorted(set(params) - set(defaults))
        if unknown:
            raise ConfigError(
                f"tiermem: DeepSpeed config optimizer.params has {unknown}, which {kind} does not take; "
                f"use {', '.join(defaults)}"
            )
        return _spec_of(r, spec, params, defaults)

    return read


#: DeepSpeed optimizer types tiermem runs (lowercase; the config's in any case), each with the
#: reader of its ``params`` block into a tiermem spec: one row per optimizer (DeepSpeed's CPU
#: Adagrad and Lion defaults for what a block leaves out)
OPTIMIZER_BLOCKS = {
    "adam": _adam_block,
    "adamw": _adam_block,
    "adagrad": _plain_block(Adagrad, {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0}),
    "lion": _plain_block(Lion, {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}),
}
