"""bf16 master weights with stochastic rounding (NOTE [Stochastic rounding bits] in tiermem/optim/kernels/sr.py):
the rounding is unbiased, reproducible, keyed by (seed, parameter, step, element) only (not by how a
tensor is cut into calls), and lets updates far below a bf16 ulp accumulate where rounding to
nearest loses them."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tiermem.optim import (
    StochasticRound,
    adafactor_step,
    adam8bit_step,
    adam_step,
    lion_step,
    quantize_blockwise,
    sgd_step,
)
from tiermem.optim.kernels import native as _native, sr as _sr

BF16 = torch.bfloat16


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def native_round(x: torch.Tensor, sr: StochasticRound, step: int) -> torch.Tensor:
    """x rounded stochastically by the native store: the streams kernel writes master + grad into a
    bf16 master, here 0 + x."""
    master, scratch = torch.zeros(x.numel(), dtype=BF16), torch.zeros(x.numel())  # scratch: the kernel's state
    keys = (ctypes.c_uint32 * 3)(*sr.keys(step))
    _native.library("elementwise").tm_streams(
        x.numel(), master.data_ptr(), 1, scratch.data_ptr(), None, x.data_ptr(), 0, None, -1, keys, 1
    )
    return master


def test_native_rounding_is_the_reference_rounding():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(100_003, generator=gen) * torch.exp(torch.randn(100_003, generator=gen) * 10)
    x[:4] = torch.tensor([0.0, -1e-40, 3.4e38, -3.4e38])  # 0, a subnormal, near bf16's largest (may round to inf)
    for seed, name, offset, step in ((0, "a", 0, 1), (7, "layer.0.weight", 123_456, 99), (1, "b", 2**32 - 5, 3)):
        sr = StochasticRound.for_parameter(seed, name, offset)
        want = _sr.round_bf16(x, sr.keys(step))
        assert torch.equal(bits(native_round(x, sr, step)), bits(want))
        finite = x[4:]  # one of the two bf16 neighbours of x
        assert ((want[4:].float() - finite).abs() <= finite.abs() * 2.0**-7).all()


def neighbours(value: float) -> tuple[float, float]:
    """The bf16 neighbours of value: towards zero and away from it."""
    b = torch.tensor([value]).view(torch.int32)
    low = (b & -65536).view(torch.float32).item()
    return low, (b & -65536 | 0).add(65536).view(torch.float32).item()


@pytest.mark.parametrize("value", [1.0 + 2.0**-10, 1.0 + 3 * 2.0**-9, -3.3e-3, 123.456])
def test_rounding_is_unbiased(value):
    """The mean of many roundings of one value (different elements; different steps of one element)
    is the value, within 5 standard deviations of the mean of that two-point distribution."""
    toward, away = neighbours(value)
    p = (value - toward) / (away - toward)  # the chance of rounding away from zero
    n = 200_000
    x = torch.full((n,), value)
    across_elements = _sr.round_bf16(x, StochasticRound.for_parameter(3, "w").keys(1)).double().mean().item()
    assert abs(across_elements - value) <= 5 * abs(away - toward) * (p * (1 - p) / n) ** 0.5
    sr, k = StochasticRound.for_parameter(3, "w", offset=17), 5000
    across_steps = torch.cat([_sr.round_bf16(x[:1], sr.keys(s)) for s in range(1, k + 1)]).double().mean().item()
    assert abs(across_steps - value) <= 5 * abs(away - toward) * (p * (1 - p) / k) ** 0.5


def test_bits_depend_on_seed_parameter_step_and_index_only():
    x = torch.rand(4096) + 1.0
    sr = StochasticRound.for_parameter(0, "w")
    first = _sr.round_bf16(x, sr.keys(1))
    assert torch.equal(bits(first), bits(_sr.round_bf16(x, StochasticRound.for_parameter(0, "w").keys(1))))
    for other in (
        StochasticRound.for_parameter(1, "w").keys(1),
        StochasticRound.for_parameter(0, "v").keys(1),
        sr.keys(2),
    ):
        assert (bits(_sr.round_bf16(x, other)) != bits(first)).float().mean() > 0.3
    # a slice keyed with its offset rounds as the whole did
    assert torch.equal(bits(_sr.round_bf16(x[1000:3000], sr.at(1000).keys(1))), bits(first[1000:3000]))


@pytest.mark.parametrize("kind", ["adam", "adam8bit", "sgd", "lion", "adafactor"])
def test_every_optimizer_rounds_the_same_in_any_cut(kind):
    """A bf16 parameter stepped whole, or cut into calls (bucketed) with the matching offsets, ends
    bit-identical; and the same seed reproduces the run."""
    n, cuts, steps = 8192, [0, 256, 4096, 8192], 3
    gen = torch.Generator().manual_seed(1)
    master0 = torch.randn(n, generator=gen).to(BF16)
    grads = [torch.randn(n, generator=gen) * 0.1 for _ in range(steps)]
    sr = StochasticRound.for_parameter(42, "block.fc.weight")

    def fresh():
        if kind == "adam8bit":
            return [*quantize_blockwise(torch.zeros(n), True), *quantize_blockwise(torch.zeros(n), False)]
        return [torch.zeros(n) for _ in range(2 if kind == "adam" else 1)]

    def update(master, state, grad, step, sr, a=0, b=n):
        if kind == "adam":
            adam_step(
                master[a:b],
                state[0][a:b],
                state[1][a:b],
                grad[a:b],
                step=step,
                lr=1e-3,
                beta1=0.9,
                beta2=0.99,
                eps=1e-8,
                weight_decay=0.1,
                stochastic_round=sr,
            )
        elif kind == "adam8bit":
            blk = slice(a // 256, (b + 255) // 256)
            adam8bit_step(
                master[a:b],
                state[0][a:b],
                state[1][blk],
                state[2][a:b],
                state[3][blk],
                grad[a:b],
                step=step,
                lr=1e-3,
                beta1=0.9,
                beta2=0.99,
                eps=1e-8,
                weight_decay=0.1,
                stochastic_round=sr,
            )
        elif kind == "sgd":
            sgd_step(master[a:b], state[0][a:b], grad[a:b], step=step, lr=1e-3, momentum=0.9, stochastic_round=sr)
        elif kind == "lion":
            lion_step(master[a:b], state[0][a:b], grad[a:b], step=step, lr=1e-4, stochastic_round=sr)
        else:  # Adafactor's reductions span the tensor: it is stepped whole, twice, from the same start
            adafactor_step(master, grad, step=step, variance=state[0], stochastic_round=sr)

    runs = []
    for cut in (False, True, False):
        master, state = master0.clone(), fresh()
        for i, g in enumerate(grads):
            if cut and kind != "adafactor":
                for a, b in zip(cuts[:-1], cuts[1:]):
                    update(master, state, g, i + 1, sr.at(a), a, b)
            else:
                update(master, state, g, i + 1, sr)
        runs.append(master)
    assert torch.equal(bits(runs[0]), bits(runs[1])) and torch.equal(bits(runs[0]), bits(runs[2]))
    assert (runs[0] != master0).any()


def test_small_updates_accumulate_where_round_to_nearest_loses_them():
    """1000 SGD steps of 1e-4 on weights of 1.0 (a bf16 ulp there is 2**-7 = 0.0078): rounding to
    nearest never moves them; stochastic rounding ends near 1.1 on average."""
    n = 4096
    master, grad = torch.ones(n, dtype=BF16), torch.full((n,), -1.0)
    sr = StochasticRound.for_parameter(0, "w")
    nearest = torch.ones(n, dtype=BF16)
    for step in range(1, 1001):
        sgd_step(master, None, grad, step=step, lr=1e-4, stochastic_round=sr)
        nearest = (nearest.float() + 1e-4).to(BF16)
    assert torch.equal(nearest, torch.ones(n, dtype=BF16))
    assert abs(master.double().mean().item() - 1.1) < 0.005
