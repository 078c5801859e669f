"""Where ``tiermem plan`` gets a parameter count: a number, a model factory, or a config.json."""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

import torch

from tiermem.errors import ConfigError
from tiermem.plan.kv_cache import CONFIG_NAMES

logger = logging.getLogger(__name__)

_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


@dataclass(frozen=True)
class ModelSize:
    trainable: int
    frozen: int
    source: str  # what the count came from, for the printed plan
    note: str = ""  # assumptions made while counting

    @property
    def total(self) -> int:
        return self.trainable + self.frozen


def parse_count(text: str) -> int:
    """``"7.5e9"``, ``"7.5B"``, ``"125M"``, ``"1000"`` -> an exact whole number of parameters."""
    s = text.strip()
    suffix = s[-1:].lower() if s[-1:].isalpha() and s[-1:].lower() != "e" else ""
    try:
        value = Decimal(s[: len(s) - len(suffix)]) * _COUNT_SUFFIX[suffix]
    except (InvalidOperation, KeyError):
        value = None
    if value is None or not value.is_finite() or value <= 0 or value != value.to_integral_value():
        raise ConfigError(
            f"tiermem: --params {text!r} is not a whole number of parameters; write e.g. 7.5e9, 7.5B or 125M"
        )
    return int(value)


def from_factory(spec: str) -> ModelSize:
    """Build ``pkg.mod:factory`` (a callable returning a module, or a module object) on the meta
    device, so no memory is allocated, and count its parameters (tied ones once)."""
    model = load_model(spec)
    trainable = frozen = 0
    for p in model.parameters():  # parameters() yields a tied parameter once
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    return ModelSize(trainable, frozen, source=f"--model {spec}")


class StandIn(torch.nn.Module):
    """A model known by its parameter count only, as ``layers`` equal layers on the meta device (in
    the order forward uses them), for planners that place parameters one by one."""

    def __init__(self, trainable: int, frozen: int = 0, *, layers: int = 48):
        super().__init__()
        layers = max(1, min(layers, trainable))
        sizes = [trainable // layers + (1 if i < trainable % layers else 0) for i in range(layers)]
        self.layers = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(n, device="meta")) for n in sizes)
        if frozen:
            self.frozen = torch.nn.Parameter(torch.empty(frozen, device="meta"), requires_grad=False)


def load_model(spec: str) -> torch.nn.Module:
    """The module ``pkg.mod:factory`` names (a callable returning one, built on the meta device, or
    a module object)."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ConfigError(
            f"tiermem: --model {spec!r} is not 'package.module:factory'; write the module "
            f"path, a colon and the name of a function or nn.Module in it"
        )
    if os.getcwd() not in sys.path:  # like `python -m`: modules in the current directory import
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - any failure in user code is reported as one line
        raise ConfigError(
            f"tiermem: cannot import {mod_name!r} for --model: {type(e).__name__}: {e}; "
            f"check the module path (it must import from the current directory)"
        ) from None
    try:
        obj: Any = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ConfigError(
            f"tiermem: module {mod_name!r} has no attribute {attr!r}; check the name after the colon in --model"
        ) from None
    return obj if isinstance(obj, torch.nn.Module) else _build(spec, obj)


def _build(spec: str, factory: Any) -> torch.nn.Module:
    if not callable(factory):
        raise ConfigError(
            f"tiermem: --model {spec!r} names a {type(factory).__name__}, not a callable "
            f"or an nn.Module; name a function that returns the model"
        )
    try:
        with torch.device("meta"):  # shapes only: a 70B model costs no memory
            model = factory()
    except Exception as e:  # noqa: BLE001 - user code; reported as one line
        raise ConfigError(
            f"tiermem: calling {spec} failed: {type(e).__name__}: {e}; make the factory callable with no arguments"
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"tiermem: {spec}() returned a {type(model).__name__}, not an nn.Module; return the model")
    return model


# NOTE [Counting a config.json]
# Two decoder-only families cover most configs users hold:
# - GPT-2 style (model_type gpt2, gpt_neo, gptj, opt, ...): learned position embeddings, LayerNorm
#   with weight and bias, biases on every linear layer, a two-matrix MLP.
# - everything else counts as Llama style: RMSNorm (weight only), gated three-matrix MLP, no biases
#   unless `attention_bias` / `mlp_bias` say so, grouped-query attention through
#   `num_key_value_heads`, and `num_local_experts` MLPs plus a router for Mixtral-style MoE.
# `tie_word_embeddings` defaults to True, as in transformers' PretrainedConfig.
_GPT2_STYLE = {"gpt2", "gpt_neo", "gptj", "gpt_bigcode", "opt", "biogpt", "codegen"}
_KEYS = {  # our name -> the names families use for it
    "hidden": CONFIG_NAMES["hidden_size"],
    "layers": CONFIG_NAMES["num_hidden_layers"],
    "heads": CONFIG_NAMES["num_attention_heads"],
    "vocab": ("vocab_size",),
}


def _get(cfg: dict, ours: str, path: str) -> int:
    for key in _KEYS[ours]:
        if cfg.get(key) is not None:
            return int(cfg[key])
    raise ConfigError(
        f"tiermem: {path} has none of {', '.join(_KEYS[ours])}; give a Hugging Face "
        f"style config.json of a decoder-only model"
    )


def from_config(path: str) -> ModelSize:
    """Count the parameters of a Hugging Face style ``config.json`` (see NOTE [Counting a config.json])."""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except OSError as e:
        raise ConfigError(
            f"tiermem: cannot read --config {path!r}: {e.strerror}; give the path of a config.json"
        ) from None
    except ValueError as e:
        raise ConfigError(f"tiermem: --config {path!r} is not valid JSON ({e}); give a config.json") from None
    if not isinstance(cfg, dict):
        raise ConfigError(
            f"tiermem: --config {path!r} holds a {type(cfg).__name__}, not a JSON object; give a config.json"
        )
    cfg = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
    n, note = count_config(cfg, path)
    return ModelSize(n, 0, source=f"--config {path}", note=note)


def count_config(cfg: dict, path: str = "config") -> tuple[int, str]:
    """Parameter count of a decoder-only transformer config, and the family it was counted as."""
    h, layers = _get(cfg, "hidden", path), _get(cfg, "layers", path)
    heads, vocab = _get(cfg, "heads", path), _get(cfg, "vocab", path)
    tied = bool(cfg.get("tie_word_embeddings", True))
    inter = cfg.get("intermediate_size") or cfg.get("n_inner") or cfg.get("ffn_dim") or 4 * h
    head_out = 0 if tied else vocab * h
    if cfg.get("model_type") in _GPT2_STYLE:
        positions = int(cfg.get("n_positions") or cfg.get("max_position_embeddings") or 0)
        attn = 4 * h * h + 4 * h
        mlp = 2 * h * inter + inter + h
        norms = 2 * 2 * h
        total = vocab * h + positions * h + layers * (attn + mlp + norms) + 2 * h + head_out
        return total, f"counted as a GPT-2 style decoder ({cfg.get('model_type')})"
    head_dim = int(cfg.get("head_dim") or h // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    attn = h * q + 2 * h * kv + q * h
    if cfg.get("attention_bias"):
        attn += q + 2 * kv + h
    experts = int(cfg.get("num_local_experts") or 1)
    mlp = 3 * h * inter + (2 * inter + h if cfg.get("mlp_bias") else 0)
    moe = experts * mlp + (h * experts if experts > 1 else 0)
    total = vocab * h + layers * (attn + moe + 2 * h) + h + head_out
    kind = "Llama style decoder" + (f", {experts} experts per layer" if experts > 1 else "")
    return total, f"counted as a {kind}; {'tied' if tied else 'untied'} embeddings"
