"""8-bit Adam (NOTE [8-bit state] in tiermem/optim/kernels/quant.py): the native quantizer and kernel against
the torch-ops reference bit for bit, the quantization error bound, one step against fp32 Adam, a
tiny model trained 200 steps against torch's AdamW, the block layout, and CPUAdam8bit's state."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tolerance import EPS32, GRAD_ULPS, fma_parity, fp32_bound
from torch import nn

from tiermem import ConfigError
from tiermem.optim import (
    CPUAdam,
    CPUAdam8bit,
    StochasticRound,
    adam8bit_step,
    adam_step,
    dequantize_blockwise,
    quantize_blockwise,
    state_bytes,
    state_layout,
)
from tiermem.optim.adam_hyper import AdamHyper
from tiermem.optim.hypers import adam_scalars
from tiermem.optim.kernels import native as _native, quant as _quant

BF16 = torch.bfloat16
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def assert_bits_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    assert torch.equal(a.view(ints), b.view(ints)), f"{(a != b).sum().item()} elements differ"


def values(kind: str, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    if kind == "wide":  # magnitudes over 20 decades: every decade of the map, and below it
        x = x * torch.exp(torch.randn(n, generator=gen) * 8)
    elif kind == "sparse":
        x = x * (torch.rand(n, generator=gen) < 0.05)
    elif kind == "negative max":
        x[n // 2] = -10 * x.abs().max()
    return x


# -- the quantizer ------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(
    kind=st.sampled_from(["normal", "wide", "sparse", "negative max"]),
    n=st.integers(1, 5000),
    signed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_native_quantizer_is_bit_identical_to_reference(kind, n, signed, seed):
    x = values(kind, n, seed)
    x = x if signed else x.abs()
    codes, absmax = quantize_blockwise(x, signed)
    want_codes, want_absmax = _quant.reference_quantize(x, signed)
    assert_bits_equal(codes, want_codes)
    assert_bits_equal(absmax, want_absmax)
    got = torch.empty(n)  # the native dequantizer, as the kernel dequantizes
    _native.library("adam8bit").tm_dequantize(
        n, codes.data_ptr(), absmax.data_ptr(), int(signed), got.data_ptr(), _quant.CONSTANTS.data_ptr(), 1
    )
    assert_bits_equal(got, dequantize_blockwise(codes, absmax, signed))


def _error_bound(x: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """Half the cell of each element's decade (relative to its block's absmax), or all of it below
    the map's smallest magnitude (1e-7), plus fp32 rounding of the value."""
    scale = absmax.repeat_interleave(_quant.BLOCK)[: x.numel()]
    a = torch.where(scale > 0, x.abs() / scale, 0.0)
    d = _quant.decades_of(a)
    width = _quant._slots(signed)[4][d]
    half_cell = torch.where(
        d == _quant.ZERO_SLOT, _quant.STARTS[0], torch.where(d == _quant.ONE_SLOT, 1 - _quant.ONE_EDGE, width / 2)
    )
    return (half_cell + 4 * torch.finfo(torch.float32).eps) * scale


@pytest.mark.parametrize("kind", ["normal", "wide", "sparse", "negative max"])
@pytest.mark.parametrize("signed", [True, False])
def test_quantization_error_is_within_half_a_cell(kind, signed):
    x = values(kind, 100_003, 7)
    x = x if signed else x.abs()
    codes, absmax = quantize_blockwise(x, signed)
    error = (dequantize_blockwise(codes, absmax, signed) - x).abs()
    assert (error <= _error_bound(x, absmax, signed)).all()
    blocks = torch.nn.functional.pad(x, (0, 256 - x.numel() % 256)).view(-1, 256)
    assert torch.equal(absmax, blocks.abs().amax(1))
    worst = (error / absmax.repeat_interleave(256)[: x.numel()].clamp(min=1e-30)).max().item()
    assert worst <= (0.9 / 63 / 2 if signed else 0.9 / 128 / 2) + 2.0**-21  # the top decade's half cell


def test_the_largest_element_of_a_block_survives_exactly():
    x = torch.randn(1024) * 1e-3
    x[3], x[300], x[600] = 5.0, -5.0, 1e-30  # a positive and a negative block maximum
    codes, absmax = quantize_blockwise(x, True)
    back = dequantize_blockwise(codes, absmax, True)
    assert back[3].item() == 5.0 and back[300].item() == -5.0
    assert dequantize_blockwise(*quantize_blockwise(torch.zeros(300), False), False).abs().max().item() == 0.0


def test_maps_are_increasing_and_hold_zero_and_one():
    for signed, m in ((True, _quant.MAP_SIGNED), (False, _quant.MAP_UNSIGNED)):
        positive = m[:128][1:127] if signed else m[1:255]
        assert (positive[1:] > positive[:-1]).all()
        assert m[0].item() == 0.0 and (m[127] if signed else m[255]).item() == 1.0
        assert positive.min().item() > 1e-7 and positive.max().item() < 1.0
    assert torch.equal(_quant.MAP_SIGNED[128:], -_quant.MAP_SIGNED[:128])


def _edge_values() -> torch.Tensor:
    """Blocks whose absmax is 1 (so y = x exactly) holding every decade start and its fp32 neighbours,
    every power of two from 2^-40 to 1 and its neighbours, and the values of all 256 codes of both maps:
    where a vector quantizer's decade or a rounding could go wrong."""
    starts = _quant.STARTS
    pow2 = 2.0 ** torch.arange(-40, 1, dtype=torch.float32)
    core = torch.cat([starts, pow2, _quant.MAP_SIGNED.abs(), _quant.MAP_UNSIGNED, torch.tensor([1e-30, 0.0])])
    x = torch.cat([core, torch.nextafter(core, torch.tensor(0.0)), torch.nextafter(core, torch.tensor(2.0))])
    x = x[x <= 1.0]
    blocks = torch.nn.functional.pad(x, (0, -x.numel() % 255)).view(-1, 255)
    x = torch.cat([torch.ones(blocks.shape[0], 1), blocks], dim=1).view(-1)  # absmax 1 in every block
    return torch.cat([x, -x.flip(0)])


@pytest.mark.parametrize("signed", [True, False])
def test_native_quantizer_at_every_decade_and_octave_edge(signed):
    """The vector quantizers find the decade from the fp32 exponent (AVX-512: a per-octave table; AVX2:
    (e - 127) * 77 >> 8, the octave table's first decade): at the edges they agree with the reference."""
    x = _edge_values()
    x = x if signed else x.abs()
    codes, absmax = quantize_blockwise(x, signed)
    want_codes, want_absmax = _quant.reference_quantize(x, signed)
    assert_bits_equal(codes, want_codes)
    assert_bits_equal(absmax, want_absmax)


def test_the_avx2_decade_formula_is_the_octave_table():
    first = _quant.CONSTANTS[168:200]  # per exponent e (slot e % 32): the decade at the octave's start
    for e in range(103, 128):
        assert (((e - 127) * 77) >> 8) + 7 == first[e % 32].item()


@pytest.mark.parametrize("n", [1, 255, 257, 4096 + 33, 70_001])
def test_vector_paths_equal_the_portable_scalar_path(n):
    """The library as built here (AVX-512 or AVX2 where the CPU has them) and its portable scalar build
    (-DTM_PORTABLE) compute the same bits: quantize, dequantize, and three kernel steps."""
    libs = [_native.library("adam8bit"), _native.portable_library("adam8bit")]
    x = values("wide", n, n)
    qc = _quant.CONSTANTS
    gen = torch.Generator().manual_seed(n)
    master0, state0 = torch.randn(n, generator=gen), _state(n, n)
    grads = [(torch.randn(n, generator=gen) * 0.1).to(BF16) for _ in range(3)]
    scalars = [_native.floats(adam_scalars(AdamHyper(step=i + 4, **HP))) for i in range(3)]
    results = []
    for lib in libs:
        got = []
        for signed in (True, False):
            xs = x if signed else x.abs()
            codes, absmax = torch.empty(n, dtype=torch.uint8), torch.empty(_quant.num_blocks(n))
            lib.tm_quantize(n, xs.data_ptr(), int(signed), codes.data_ptr(), absmax.data_ptr(), qc.data_ptr(), 1)
            back = torch.empty(n)
            lib.tm_dequantize(n, codes.data_ptr(), absmax.data_ptr(), int(signed), back.data_ptr(), qc.data_ptr(), 1)
            got += [codes, absmax, back]
        master, state, out = master0.clone(), [t.clone() for t in state0], torch.empty(n, dtype=BF16)
        for g, s in zip(grads, scalars):
            lib.tm_adam8bit(
                n,
                master.data_ptr(),
                0,
                *(t.data_ptr() for t in state),
                g.data_ptr(),
                1,
                out.data_ptr(),
                1,
                s,
                qc.data_ptr(),
                None,
                1,
            )
        results.append([*got, master, *state, out])
    for got, want in zip(*results):
        assert_bits_equal(got, want)


# -- the kernel -------------------------------------------------------------------------------------
def _state(n: int, seed: int):
    """8-bit state as after some steps: quantized random moments."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=gen) * 1e-2
    v = torch.rand(n, generator=gen) ** 4 * 1e-4
    return [*quantize_blockwise(m, True), *quantize_blockwise(v, False)]


@pytest.mark.numerics
@settings(max_examples=25, deadline=None)
@given(
    n=st.sampled_from([1, 255, 256, 257, 4096, 70_001]),
    grad_dtype=st.sampled_from([torch.float32, BF16]),
    bf16_master=st.booleans(),
    adamw=st.booleans(),
    beta1=st.sampled_from([0.9, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_native_kernel_agrees_with_reference(n, grad_dtype, bf16_master, adamw, beta1, seed):
    """Bit for bit where torch's eager kernels fuse the multiply-adds the native one does (NOTE [FMA
    parity]); else one step to rounding: the weights to NOTE [Arithmetic tolerances] (a step updates
    them from the fp32 moments), a code at most one apart (a moment a rounding apart may land on the
    neighbouring code), the scales to rounding. Not more steps there: after a flipped code the next
    update moves by lr * (one code's step) / sqrt(v), a quantization step, not a rounding."""
    gen = torch.Generator().manual_seed(seed)
    master0 = torch.randn(n, generator=gen).to(BF16 if bf16_master else torch.float32)
    state0 = _state(n, seed)
    grads = [(torch.randn(n, generator=gen) * 0.1).to(grad_dtype) for _ in range(3)]
    grads = grads if fma_parity() else grads[:1]
    sr = StochasticRound.for_parameter(seed, "w") if bf16_master else None
    results, moved = [], 0.0
    for impl in ("native", "reference"):
        master, state, out = master0.clone(), [t.clone() for t in state0], torch.empty(n, dtype=BF16)
        for i, g in enumerate(grads):
            before = master.double()
            adam8bit_step(
                master,
                *state,
                g,
                step=i + 4,
                **{**HP, "beta1": beta1},
                adamw=adamw,
                out=out,
                stochastic_round=sr,
                grad_scale=2.0,
                clip_coef=0.5,
                impl=impl,
            )
            moved = max(moved, (master.double() - before).abs().max().item())
        results.append([master, *state, out])
    if fma_parity():
        for got, want in zip(*results):
            assert_bits_equal(got, want)
        return
    dm, dv = _moment_roundings(master0, state0, grads[0], beta1=beta1, adamw=adamw)
    c1, c2 = 1 - beta1**4, 1 - HP["beta2"] ** 4  # the one step taken is the 4th
    rms = (dequantize_blockwise(results[1][3], results[1][4], False).double() / c2).sqrt()
    for got, want in zip(*results):
        if got.dtype == torch.uint8:
            assert (got.int() - want.int()).abs().max().item() <= 1
            continue
        if got is results[0][2] or got is results[0][4]:  # the scales: each a rounding of its block's largest
            bound = fp32_bound(want, steps=1, step_size=want.abs().max().item())
            bound = bound + _per_block(dm if got is results[0][2] else dv, want.numel())
        else:  # the weights: u = m_hat / (sqrt(v_hat) + eps) over the quantized new v, the same codes in both
            bound = fp32_bound(want, steps=1, step_size=moved) + HP["lr"] * dm / (c1 * (rms + HP["eps"]))
        ratio = ((got.double() - want.double()).abs() / bound).max().item()
        assert ratio <= 1.0, f"{ratio:.3g} times the bound"


def _moment_roundings(master, state, g, *, beta1: float, adamw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """How far the new moments of two correct 8-bit Adam kernels may be apart, element by element,
    where one fuses the multiply-adds the other rounds (no FMA parity), beyond NOTE [Arithmetic
    tolerances]: the gradient the step folds, g' = g * grad_scale * clip (+ wd * w for Adam's L2
    decay), is ``GRAD_ULPS`` ulps of its largest term apart (dg'), m = b1 * m_old + (1 - b1) * g'
    that much of its largest term plus (1 - b1) * dg', v = b2 * v_old + (1 - b2) * g'**2 that much of
    itself plus 2 * (1 - b2) * |g'| * dg'. Where the terms cancel, these are many ulps of the result
    (which is why a relative bound does not hold there); from the reference's own inputs."""
    b2, wd = HP["beta2"], HP["weight_decay"]
    scaled = g.double() * 2.0 * 0.5  # grad_scale=2.0, clip_coef=0.5 as the test steps
    decay = torch.zeros_like(scaled) if adamw else wd * master.double()
    gp = scaled + decay
    m_old = beta1 * dequantize_blockwise(state[0], state[1], True).double()
    v = b2 * dequantize_blockwise(state[2], state[3], False).double() + (1 - b2) * gp * gp
    dgp = GRAD_ULPS * EPS32 * torch.maximum(scaled.abs(), decay.abs())
    dm = GRAD_ULPS * EPS32 * torch.maximum(m_old.abs(), (1 - beta1) * gp.abs()) + (1 - beta1) * dgp
    dv = GRAD_ULPS * EPS32 * v + 2 * (1 - b2) * gp.abs() * dgp
    return dm, dv


def _per_block(d: torch.Tensor, blocks: int) -> torch.Tensor:
    """The largest of ``d`` in each block of 256 elements (a block's scale is its largest magnitude)."""
    padded = torch.zeros(blocks * 256, dtype=d.dtype)
    padded[: d.numel()] = d
    return padded.view(blocks, 256).amax(1)


def test_one_step_against_fp32_adam():
    """From the same (dequantized) moments, one 8-bit step moves the weights as fp32 Adam does (to the
    rounding of one multiplication that replaces a division, see adam_math8), and its new moments are
    fp32 Adam's within the quantization error bound."""
    n = 100_000
    state = _state(n, 1)
    m0, v0 = dequantize_blockwise(*state[:2], True), dequantize_blockwise(*state[2:], False)
    gen = torch.Generator().manual_seed(4)
    master0, grad = torch.randn(n, generator=gen), (torch.randn(n, generator=gen) * 0.1).to(BF16)
    master, fp32 = master0.clone(), [master0.clone(), m0.clone(), v0.clone()]
    adam8bit_step(master, *state, grad, step=5, **HP)
    adam_step(*fp32, grad, step=5, **HP, out=torch.empty(n, dtype=BF16))  # a variant test_optim.py compiles
    update = (fp32[0] - master0).abs()  # the denominator differs by an ulp at most: the update by 2**-22 of itself
    assert ((master - fp32[0]).abs() <= 2.0**-22 * update + torch.finfo(torch.float32).eps * master0.abs()).all()
    assert (master != fp32[0]).float().mean() < 0.05
    for (codes, absmax), want, signed in ((state[:2], fp32[1], True), (state[2:], fp32[2], False)):
        error = (dequantize_blockwise(codes, absmax, signed) - want).abs()
        assert (error <= _error_bound(want, absmax, signed)).all()


def test_a_tensor_cut_at_block_boundaries_updates_as_one_call():
    n, cuts = 5000, [0, 256, 2560, 4864, 5000]  # multiples of 256, and a short last block
    state0, master0 = _state(n, 2), torch.randn(n)
    grad = torch.randn(n) * 0.1
    whole, state = master0.clone(), [t.clone() for t in state0]
    adam8bit_step(whole, *state, grad, step=3, **HP)
    parts, cut_state = master0.clone(), [t.clone() for t in state0]
    for a, b in zip(cuts[:-1], cuts[1:]):
        blocks = slice(a // 256, math.ceil(b / 256))
        adam8bit_step(
            parts[a:b],
            cut_state[0][a:b],
            cut_state[1][blocks],
            cut_state[2][a:b],
            cut_state[3][blocks],
            grad[a:b],
            step=3,
            **HP,
        )
    for got, want in zip([parts, *cut_state], [whole, *state]):
        assert_bits_equal(got, want)


def test_nonfinite_gradient_changes_nothing():
    n = 3000
    state, master = _state(n, 3), torch.randn(n)
    grad = torch.randn(n)
    grad[2999] = math.nan
    before = [t.clone() for t in (master, *state)]
    assert adam8bit_step(master, *state, grad, step=2, **HP) is True
    for a, b in zip([master, *state], before):
        assert_bits_equal(a, b)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(exp_avg_absmax=torch.zeros(3)), r"exp_avg_absmax has 3 elements but master's 1000 need 4"),
        (dict(exp_avg=torch.zeros(1000)), r"exp_avg has dtype torch.float32; it must be torch.uint8"),
        (dict(master=torch.zeros(2000)[::2]), r"adam8bit_step takes contiguous tensors"),
    ],
)
def test_caller_errors(bad, match):
    args = dict(
        master=torch.zeros(1000),
        exp_avg=torch.zeros(1000, dtype=torch.uint8),
        exp_avg_absmax=torch.zeros(4),
        exp_avg_sq=torch.zeros(1000, dtype=torch.uint8),
        exp_avg_sq_absmax=torch.zeros(4),
        grad=torch.zeros(1000),
    )
    args.update(bad)
    with pytest.raises(ConfigError, match=match):
        adam8bit_step(*args.values(), step=1, **HP)


def test_state_layout():
    assert state_layout("adamw8bit", (64, 100)) == {
        "exp_avg": (6400, torch.uint8),
        "exp_avg_absmax": (25, torch.float32),
        "exp_avg_sq": (6400, torch.uint8),
        "exp_avg_sq_absmax": (25, torch.float32),
    }
    assert state_layout("adam8bit", (10, 10)) == state_layout("adam", (10, 10))  # below the 8-bit threshold
    assert state_bytes("adamw8bit", (1 << 20,)) == 2 * (1 << 20) + 2 * 4 * 4096  # 2 B/param + the scales
    assert state_bytes("adamw", (1 << 20,)) == 8 * (1 << 20)


# -- training (tiny models: one intra-op thread, see conftest.one_thread) ----------------------------------
X = torch.randn(4096, 32, generator=torch.Generator().manual_seed(1))


def _teacher_data():
    gen = torch.Generator().manual_seed(11)
    w1, w2 = torch.randn(32, 64, generator=gen) * 0.5, torch.randn(64, 8, generator=gen) * 0.5
    return torch.tanh(X @ w1) @ w2 + 0.3 * torch.randn(4096, 8, generator=gen)


Y = _teacher_data()


def mlp(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 8)).to(dtype)


def run_steps(model: nn.Module, opt, gen: torch.Generator, steps: int) -> None:
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        idx = torch.randint(0, 4096, (128,), generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(X[idx].to(dtype)).float(), Y[idx]).backward()
        opt.step()


def train(model: nn.Module, opt, steps: int = 200) -> float:
    """Mini-batches of a noisy teacher's outputs; returns the final loss on all of them."""
    run_steps(model, opt, torch.Generator().manual_seed(2), steps)
    with torch.no_grad():
        return nn.functional.mse_loss(model(X.to(next(model.parameters()).dtype)).float(), Y).item()


def test_tiny_mlp_trains_within_one_percent_of_fp32_adamw(one_thread):
    """200 steps; the 1% is meaningful here: 20% less lr, or 10 fewer steps, end 1.6-3.7% away."""
    model = mlp()
    want = train(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01))
    model = mlp()
    opt = CPUAdam8bit(model.parameters(), lr=3e-3, weight_decay=0.01, min_8bit_size=1024)
    got = train(model, opt)
    assert abs(got - want) <= 0.01 * want, (got, want)
    kinds = {name: {k: v.dtype for k, v in opt.state[p].items()} for name, p in model.named_parameters()}
    assert kinds["2.weight"]["exp_avg"] == torch.uint8 and kinds["2.bias"]["exp_avg"] == torch.float32
    model = mlp()
    slower = train(model, torch.optim.AdamW(model.parameters(), lr=2.5e-3, weight_decay=0.01))
    assert abs(slower - want) > 0.01 * want  # the tolerance tells a different run apart


@pytest.mark.parametrize(
    "opt",
    [
        lambda ps: CPUAdam(ps, lr=3e-3, weight_decay=0.01, bf16_stochastic_round=True, sr_seed=0),
        lambda ps: CPUAdam8bit(
            ps, lr=3e-3, weight_decay=0.01, min_8bit_size=1024, bf16_stochastic_round=True, sr_seed=0
        ),
    ],
    ids=["adamw", "adamw8bit"],
)
def test_bf16_weights_with_stochastic_rounding_train_as_fp32(one_thread, opt):
    model = mlp()
    want = train(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01))
    model = mlp(BF16)
    got = train(model, opt(model.parameters()))
    assert abs(got - want) <= 0.01 * want, (got, want)


def test_cpuadam8bit_state_dict_round_trip(one_thread):
    model, gen = mlp(), torch.Generator().manual_seed(2)
    opt = CPUAdam8bit(model.parameters(), lr=3e-3, min_8bit_size=1024)
    run_steps(model, opt, gen, 3)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state()})
    run_steps(model, opt, gen, 4)
    resumed, gen2 = mlp(), torch.Generator()
    resumed.load_state_dict(saved["model"])
    gen2.set_state(saved["gen"])
    opt2 = CPUAdam8bit(resumed.parameters(), lr=3e-3, min_8bit_size=1024)
    opt2.load_state_dict(saved["opt"])
    run_steps(resumed, opt2, gen2, 4)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
