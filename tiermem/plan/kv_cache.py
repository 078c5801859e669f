"""The KV cache of one ``tm.generate(...)`` call: its bytes, from the model's config and the call's
arguments, and its place, the tier the policy gives it, held in that tier's ledger while generate
runs (NOTE [The KV cache is placed]). ``tiermem plan --generate`` sizes it with the same functions.

# NOTE [The KV cache is placed]
# A transformers decoder's ``generate`` keeps a key and a value per layer, per sequence and per
# position it has seen: ``2 x layers x batch x kv_heads x tokens x head_dim`` elements of the
# model's working dtype (:func:`kv_cache`). The config gives ``num_hidden_layers``,
# ``num_key_value_heads`` (else ``num_attention_heads``: no grouped-query attention) and
# ``head_dim`` (else ``hidden_size // num_attention_heads``) (:meth:`KvShape.of`); the call gives
# the batch, its rows times ``max(num_beams, num_return_sequences)`` as generate expands them, and
# the tokens, ``max_length - 1`` as generate sizes its cache (the last token is never fed back):
# ``max_length`` is the prompt plus ``max_new_tokens``, else ``max_length`` as given, else the
# prompt plus 20 within ``max_position_embeddings`` (transformers' default), each read from the
# call, then its ``generation_config``, then the model's (:func:`for_call`). This is the most the
# cache holds: sliding-window layers (which keep fewer positions), caches whose keys and values
# differ in width (multi-head latent attention) and a ``past_key_values`` given with positions
# already in it are counted as full layers of this shape. A module without such a config (not a
# transformers decoder, an encoder-decoder, whose cache also holds cross-attention, or a call with
# ``use_cache=False``) gets no KV placement; its generate still runs.
#
# Before generate runs, :func:`placed` asks the bound policy where an ACTIVATION named
# ``"kv_cache"`` of those bytes goes. The device, when the policy says so and its budget has room
# beside what the plan's footprint keeps there for the weights; else the host (an NVMe answer too:
# no transformers cache lives in files), when it has room beside its own footprint. The bytes are
# reserved in that tier's ledger, counted as ACTIVATION (``tm.report()`` shows them in the
# class peaks), and released when generate returns or raises. On CUDA a cache on the host is
# transformers' offloaded one (``cache_implementation="offloaded"``; it still keeps a layer or two
# on the device at a time, not counted here); on a CPU device host and device are the same memory,
# so the host's ledger alone counts it and the cache is the ordinary one. A cache the caller chose
# (``past_key_values``, or a ``cache_implementation`` in the call or a generation config) is never
# replaced: on CUDA it is counted where it lives (the host for an offloaded one, else the device).
# When no tier has room the call is refused before generate runs, with a ``tiermem:``
# OutOfTierMemory naming the bytes, the shape, each tier's room and what to change; nothing changed.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import torch

from tiermem.errors import OutOfTierMemory, fmt_bytes
from tiermem.plan.policy import Policy, checked_place
from tiermem.types import TensorClass, TensorInfo, Tier

log = logging.getLogger(__name__)

__all__ = [
    "KEY",
    "KvCache",
    "KvShape",
    "chosen_cache",
    "for_call",
    "kv_cache",
    "offloaded",
    "placed",
    "positions_of",
    "prompt_of",
    "tier_for",
]

#: The name the policy is asked about and the ledgers hold the cache under.
KEY = "kv_cache"

_DEFAULT_NEW_TOKENS = 20  # what transformers' generate adds to the prompt when no length is given


@dataclass(frozen=True)
class KvShape:
    """What a decoder's config says of its KV cache: the layers, the key/value heads and their width."""

    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: Any) -> Optional["KvShape"]:
        """The shape read from ``config`` (a transformers config, or a config.json's dict; a
        multimodal one's text config), or None when it is not a decoder's (NOTE [The KV cache is placed])."""
        if config is None:
            return None
        if not isinstance(config, Mapping) and callable(getattr(config, "get_text_config", None)):  # a transformers one
            config = config.get_text_config(decoder=True)
        elif (
            isinstance(config, Mapping)
            and "hidden_size" not in config
            and isinstance(config.get("text_config"), Mapping)
        ):
            config = config["text_config"]
        layers, heads, hidden = (_field(config, k) for k in ("num_hidden_layers", "num_attention_heads", "hidden_size"))
        encoder_decoder = (
            config.get("is_encoder_decoder")
            if isinstance(config, Mapping)
            else getattr(config, "is_encoder_decoder", None)
        )
        if not layers or not heads or encoder_decoder is True:
            return None
        if isinstance(config, Mapping) and "num_key_value_heads" not in config and any(config.get(k) for k in _GROUPED):
            return None  # its KV heads are not the attention heads, and not said in a way read here
        kv_heads = _field(config, "num_key_value_heads") or heads
        head_dim = _field(config, "head_dim") or (hidden // heads if hidden else None)
        return cls(layers, kv_heads, head_dim) if head_dim else None

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """One position of one sequence: a key and a value in every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype.itemsize


#: the names a config.json gives these fields under, transformers' own first (GPT-2's after it:
#: a transformers config object maps them itself, by its ``attribute_map``; a dict does not).
#: ``tiermem plan --config`` counts parameters by the same names
CONFIG_NAMES = {
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
}
#: keys of a config.json that group the KV heads in a way these fields do not say (multi-query
#: attention, Falcon's and ChatGLM's KV heads): without ``num_key_value_heads`` its shape is unknown
_GROUPED = ("multi_query", "multi_query_attention", "multi_query_group_num", "num_kv_heads", "n_head_kv", "kv_n_heads")


def _field(config: Any, name: str) -> Optional[int]:
    """``config``'s whole-number field ``name`` (attribute or key, or a key it goes by in a
    config.json), or None."""
    if isinstance(config, Mapping):
        value = next((config[k] for k in CONFIG_NAMES.get(name, (name,)) if k in config), None)
    else:
        value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclass(frozen=True)
class KvCache:
    """The KV cache of one generate call: its bytes and what they are made of."""

    nbytes: int
    shape: KvShape
    batch: int  # sequences: the prompts' rows times the beams or the sequences returned per prompt
    tokens: int  # positions each sequence's cache holds
    dtype: torch.dtype

    @property
    def layers(self) -> int:
        return self.shape.layers

    def describe(self) -> str:
        """``"1.50 MiB (2 layers x batch 6 x 13 tokens x 2 KV heads x 8 head dim, keys and values in bfloat16)"``."""
        s = self.shape
        return (
            f"{fmt_bytes(self.nbytes)} ({s.layers} layers x batch {self.batch} x {self.tokens} tokens x "
            f"{s.kv_heads} KV heads x {s.head_dim} head dim, keys and values in {str(self.dtype).removeprefix('torch.')})"
        )


def kv_cache(shape: KvShape, batch: int, max_length: int, dtype: torch.dtype) -> KvCache:
    """The cache generate builds for ``batch`` sequences of up to ``max_length`` tokens (prompt and
    new ones) in ``dtype``: ``max_length - 1`` positions each, the last token never fed back."""
    tokens = max(max_length - 1, 0)
    return KvCache(shape.bytes_per_token(dtype) * batch * tokens, shape, batch, tokens, dtype)


def prompt_of(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Optional[torch.Tensor]:
    """The prompt of ``generate(*args, **kwargs)``, rows by tokens (by width, for ``inputs_embeds``):
    its first positional argument, else ``input_ids``, ``inputs`` or ``inputs_embeds``; None without one."""
    prompt = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs", kwargs.get("inputs_embeds")))
    return prompt if isinstance(prompt, torch.Tensor) and prompt.dim() >= 2 else None


def positions_of(module: Any) -> Optional[int]:
    """The positions ``module``'s config gives it (``max_position_embeddings``), or None."""
    return _field(getattr(module, "config", None), "max_position_embeddings")


def for_call(module: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], dtype: torch.dtype) -> Optional[KvCache]:
    """The cache ``module.generate(*args, **kwargs)`` builds, or None when there is none to place
    (no decoder config, no prompt tensor, ``use_cache=False``; NOTE [The KV cache is placed])."""
    shape = KvShape.of(getattr(module, "config", None))
    prompt = prompt_of(args, kwargs)
    if shape is None or prompt is None:
        return None
    configs = [kwargs.get("generation_config"), getattr(module, "generation_config", None)]

    def setting(name: str) -> Any:
        if kwargs.get(name) is not None:
            return kwargs[name]
        return next((getattr(c, name) for c in configs if getattr(c, name, None) is not None), None)

    if setting("use_cache") is False:
        return None
    rows, length = prompt.shape[0], prompt.shape[1]
    if setting("max_new_tokens") is not None:
        max_length = length + int(setting("max_new_tokens"))
    elif setting("max_length") is not None:
        max_length = int(setting("max_length"))
    else:
        max_length = length + _DEFAULT_NEW_TOKENS
        positions = positions_of(module)
        max_length = min(max_length, positions) if positions else max_length
    expand = max(int(setting("num_beams") or 1), int(setting("num_return_sequences") or 1))
    return kv_cache(shape, rows * expand, max_length, dtype)


def tier_for(nbytes: int, asked: Tier, room: Mapping[Tier, int]) -> Optional[Tier]:
    """Where a cache of ``nbytes`` goes when the policy says ``asked`` and each tier has ``room``
    bytes free: the device if asked and it fits, else the host if it fits, else None."""
    return next(iter(_fitting(nbytes, asked, room)), None)


def _fitting(nbytes: int, asked: Tier, room: Mapping[Tier, int]) -> list[Tier]:
    """The tiers a cache of ``nbytes`` may take, in the order it tries them (:func:`tier_for`)."""
    order = (Tier.DEVICE, Tier.HOST) if asked is Tier.DEVICE else (Tier.HOST,)
    return [t for t in order if nbytes <= room.get(t, 0)]


def offloaded(tier: Tier, device: torch.device, chosen: Optional[str]) -> bool:
    """Whether generate must be told to keep a cache placed on ``tier`` on the host
    (``cache_implementation="offloaded"``): on the host of an accelerator, unless the caller chose a cache."""
    return tier is Tier.HOST and device.type != "cpu" and chosen is None


def chosen_cache(kwargs: Mapping[str, Any], module: Any) -> Optional[str]:
    """The cache the caller (or the model's generation config) chose, in words, or None."""
    if kwargs.get("past_key_values") is not None:
        return "past_key_values"
    for config in (kwargs, kwargs.get("generation_config"), getattr(module, "generation_config", None)):
        impl = (
            config.get("cache_implementation")
            if isinstance(config, Mapping)
            else getattr(config, "cache_implementation", None)
        )
        if impl is not None:
            return f"cache_implementation={impl!r}"
    return None


@contextlib.contextmanager
def placed(
    cache: KvCache,
    *,
    policy: Policy,
    ledgers: Mapping[Tier, Any],
    footprint: Mapping[Tier, int],
    device: torch.device,
    chosen: Optional[str],
) -> Iterator[Tier]:
    """``cache`` reserved on its tier for the block (NOTE [The KV cache is placed]): yields the
    tier; released when the block ends, raising or not. ``ledgers``: each tier's ledger;
    ``footprint``: the bytes the model's plan keeps on each tier; ``chosen``: the caller's own
    cache, or None. Refuses before the block when no tier has room.

    Raises:
        OutOfTierMemory: no tier the cache may take has room for it.
    """
    if chosen is not None and device.type != "cpu":  # it lives where the caller's choice keeps it
        asked = Tier.HOST if "offloaded" in chosen else Tier.DEVICE
        room = {asked: _room(ledgers, footprint, asked)}
    else:
        asked = checked_place(policy, _info(cache))
        room = {t: _room(ledgers, footprint, t) for t in (Tier.DEVICE, Tier.HOST)}
    tier = _reserve(cache, ledgers, _fitting(cache.nbytes, asked, room))
    if tier is None:
        raise _refusal(cache, ledgers, room, chosen)
    log.debug("tiermem: the KV cache of this generate call, %s, on the %s", cache.describe(), tier)
    try:
        yield tier
    finally:
        ledgers[tier].release(KEY)


def _reserve(cache: KvCache, ledgers: Mapping[Tier, Any], tiers: list[Tier]) -> Optional[Tier]:
    """The first of ``tiers`` whose ledger takes the cache (one may hold more than its plan now)."""
    for tier in tiers:
        try:
            ledgers[tier].reserve(KEY, cache.nbytes, TensorClass.ACTIVATION, label="the KV cache")
        except OutOfTierMemory:
            continue
        return tier
    return None


def _info(cache: KvCache) -> TensorInfo:
    s = cache.shape
    shape = (2, s.layers, cache.batch, s.kv_heads, cache.tokens, s.head_dim)
    return TensorInfo(KEY, TensorClass.ACTIVATION, cache.nbytes, shape, cache.dtype, module="")


def _room(ledgers: Mapping[Tier, Any], footprint: Mapping[Tier, int], tier: Tier) -> int:
    """The bytes ``tier`` has beside what the plan keeps there (and what its ledger holds now,
    less what a cache on it gives back: a ledger with reclaimers counts its plan alone)."""
    ledger = ledgers.get(tier)
    if ledger is None:
        return 0
    held: int = footprint.get(tier, 0) if ledger.reclaimers else max(footprint.get(tier, 0), ledger.used)
    allowed: int = ledger.allowed  # the ledger is duck-typed here (plan/ sits below memory/): its budget
    return max(allowed - held, 0)


def _refusal(
    cache: KvCache, ledgers: Mapping[Tier, Any], room: Mapping[Tier, int], chosen: Optional[str]
) -> OutOfTierMemory:
    last = Tier.HOST if Tier.HOST in room else next(iter(room))
    ledger = ledgers[last]
    rooms = "; ".join(f"{t} {fmt_bytes(n)} free of {fmt_bytes(ledgers[t].allowed)}" for t, n in room.items())
    mine = (
        f"; {chosen} keeps it on the {last}: leave it out to let tiermem place the cache"
        if chosen is not None and len(room) == 1
        else ""
    )
    raise_ = " or ".join(
        f"Budgets({t.value}=...) to at least {fmt_bytes(ledgers[t].allowed - n + cache.nbytes)}"
        for t, n in room.items()
    )
    return OutOfTierMemory(
        tier=last,
        key="the KV cache of tm.generate(...)",
        asked=cache.nbytes,
        used=ledger.allowed - room[last],
        allowed=ledger.allowed,
        hint=(
            f"the KV cache needs {cache.describe()} and no tier has room for it beside the weights "
            f"({rooms}){mine}; generate fewer sequences at once (a smaller batch, num_beams or "
            f"num_return_sequences) or fewer tokens (max_new_tokens), or raise {raise_}; nothing was generated"
        ),
    )
