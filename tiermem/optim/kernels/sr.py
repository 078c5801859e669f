"""bf16 master weights with stochastic rounding: the per-call keys and the reference rounding.

NOTE [Stochastic rounding bits]
With ``bf16_stochastic_round`` the master weights are bf16 and every update, computed in fp32, is
rounded to one of the two bf16 neighbours of the result with probabilities proportional to the
distances (so the expected weight is the fp32 result, which round-to-nearest loses when updates are
below half a bf16 ulp). The 16 random bits an element needs are a pure function of
(seed, parameter, step, element index): ``r = (mix32(index ^ k1) ^ k2) >> 16``, where ``index`` is
the element's index in its parameter (mod 2^32), ``(k1, k2)`` are 32-bit keys drawn from the
parameter's 64-bit key and the step by xxh64, and mix32 is a 32-bit integer hash (xorshift-multiply,
constants from Wellons' hash-prospector, bias ~0.1). No generator state is consumed, so results do
not depend on how a parameter is cut into calls or buckets, on which thread runs them, or on the
order the parameters are stepped in: placement never changes the numbers. The rounding adds r to the
fp32 bit pattern below the bf16 mantissa and truncates (``(bits + r) >> 16``), which rounds |x| up
with probability (low 16 bits) / 2^16; NaN stays NaN. The native kernels and :func:`round_bf16` (torch
ops, the reference) compute the same bits.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional

import torch
import xxhash

from tiermem.config.rules import is_int
from tiermem.errors import ConfigError

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1


@dataclass(frozen=True)
class StochasticRound:
    """How to round an update into bf16 master weights: ``key`` identifies the parameter (and the
    run's seed), ``offset`` is the index in the parameter of the first element passed (so a slice of
    a parameter gets the same bits as the whole). Build one with :meth:`for_parameter`.

    Args:
        key: the parameter's 64-bit key (from the run's seed and its name).
        offset: the index in the parameter of the first element passed.
    """

    key: int
    offset: int = 0

    def __post_init__(self) -> None:
        for name in ("key", "offset"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ConfigError(f"tiermem: StochasticRound {name}={value!r} is invalid: it must be an int >= 0")
        object.__setattr__(self, "key", self.key & _M64)

    @classmethod
    def for_parameter(cls, seed: int, name: str, offset: int = 0) -> "StochasticRound":
        """The rounding of the parameter called ``name`` (e.g. its qualified name) in a run seeded
        with ``seed``.

        Args:
            seed: the run's seed, an int.
            name: the parameter's name.
            offset: the index of the first element passed.
        """
        if not is_int(seed):
            raise ConfigError(f"tiermem: StochasticRound seed={seed!r} is invalid: it must be an int")
        return cls(xxhash.xxh64_intdigest(name.encode(), seed=seed & _M64), offset)

    def at(self, offset: int) -> "StochasticRound":
        """The same rounding for a slice starting ``offset`` elements further on.

        Args:
            offset: elements from this one's first.
        """
        return StochasticRound(self.key, self.offset + offset)

    def keys(self, step: int) -> tuple[int, int, int]:
        """(k1, k2, offset mod 2^32) of one call at ``step``.

        Args:
            step: the update's 1-based step count.
        """
        h = xxhash.xxh64_intdigest(struct.pack("<QQ", self.key, step & _M64))
        return h & _M32, h >> 32, self.offset & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """mix32 of 32-bit values held in int64 (every product stays below 2^63)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def random_bits(n: int, keys: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """The 16 random bits (int64, in [0, 2^16)) of elements 0..n-1 of a call with these keys."""
    k1, k2, offset = keys
    index = (torch.arange(n, dtype=torch.int64, device=device) + offset) & _M32
    return (_mix32(index ^ k1) ^ k2) >> 16


def round_bf16(x: torch.Tensor, keys: tuple[int, int, int]) -> torch.Tensor:
    """``x`` (fp32, 1-D) rounded stochastically to bf16 (NOTE [Stochastic rounding bits]), in torch ops."""
    bits = x.view(torch.int32).to(torch.int64) & _M32
    top = (bits + random_bits(x.numel(), keys, x.device)) >> 16  # < 2^16 for every non-NaN x
    top = torch.where(top >= 1 << 15, top - (1 << 16), top).to(torch.int16)
    out = top.view(torch.bfloat16)
    return torch.where(torch.isnan(x), torch.full_like(out, float("nan")), out)


def check(master: torch.Tensor, stochastic_round: Optional[StochasticRound], where: str) -> None:
    """bf16 master weights come with a rounding, fp32 ones without."""
    if stochastic_round is not None and not isinstance(stochastic_round, StochasticRound):
        raise ConfigError(
            f"tiermem: {where}stochastic_round={stochastic_round!r} is invalid: pass a "
            f"tiermem.optim.StochasticRound or None"
        )
    if master.dtype == torch.bfloat16 and stochastic_round is None:
        raise ConfigError(
            f"tiermem: {where}master has dtype torch.bfloat16, which needs stochastic rounding: pass "
            f"stochastic_round=StochasticRound.for_parameter(seed, name), or keep master weights in "
            f"torch.float32"
        )
    if master.dtype == torch.float32 and stochastic_round is not None:
        raise ConfigError(
            f"tiermem: {where}stochastic_round applies to bf16 master weights, but master is "
            f"fp32; pass stochastic_round=None or bf16 master weights"
        )
    if master.dtype not in (torch.float32, torch.bfloat16):
        raise ConfigError(
            f"tiermem: {where}master has dtype {master.dtype}; master weights must be "
            f"torch.float32 (or torch.bfloat16 with stochastic_round)"
        )
