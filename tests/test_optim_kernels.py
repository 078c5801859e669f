"""The native kernels of SGD, Adagrad, Lion and bf16-master Adam against their reference kernels, bit
for bit where torch's eager kernels fuse the same multiply-adds, else to rounding (NOTE [FMA parity];
tests/tolerance.py) (every dtype combination, sizes on both sides of the vector width and of the parallel
threshold, grad_scale and clip_coef), and their promises: a tensor cut into calls at any offsets
updates as one call, a non-finite gradient changes nothing, unscaling and clipping equal doing them
first, non-contiguous tensors work, and callers' mistakes are one-line tiermem: errors.

The native library is built once per machine (a few seconds, then cached); these tests stay on it.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tolerance import assert_kernel_agrees, assert_within

from tiermem import ConfigError, TierMemError
from tiermem.optim import StochasticRound, adagrad_step, adam_step, lion_step, sgd_step
from tiermem.optim.kernels import dispatch as _run, native as _native

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
SIZES = st.one_of(st.sampled_from([1, 2, 15, 16, 17, 257, 1021, 40_000]), st.integers(1, 3000))
KINDS = ("sgd", "sgd_nesterov", "adagrad", "lion", "adam")


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    assert torch.equal(a.view(ints), b.view(ints)), f"{(a.float() != b.float()).sum().item()} elements differ"


def make(kind: str, n: int, seed: int, master_dtype=FP32):
    """master and state of ``kind`` (state values as after a few steps: non-zero, positive sums)."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen).to(master_dtype)
    if kind == "adam":
        return master, [torch.randn(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 1e-4]
    if kind == "adagrad":
        return master, [torch.rand(n, generator=gen) * 1e-2]
    return master, [torch.randn(n, generator=gen) * 1e-2]


def step(kind: str, master, state, grad, i: int, **kw) -> bool:
    """One update of ``kind`` at step ``i`` (hyperparameters that exercise every branch)."""
    if kind.startswith("sgd"):
        nesterov = kind == "sgd_nesterov"
        return sgd_step(
            master,
            state[0],
            grad,
            step=i,
            lr=0.03,
            momentum=0.9,
            dampening=0.0 if nesterov else 0.2,
            nesterov=nesterov,
            weight_decay=0.01,
            maximize=not nesterov,
            **kw,
        )
    if kind == "adagrad":
        return adagrad_step(master, state[0], grad, step=i, lr=0.05, lr_decay=0.01, weight_decay=0.01, **kw)
    if kind == "lion":
        return lion_step(master, state[0], grad, step=i, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, **kw)
    impl = kw.pop("impl", None)
    impl = {"native": "compiled", "reference": "reference", None: None}[impl]
    return adam_step(
        master,
        state[0],
        state[1],
        grad,
        step=i,
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.1,
        impl=impl,
        **kw,
    )


def run(kind, master, state, grads, *, out_dtype=None, sr=None, first=1, moves=None, **kw):
    """[master, *state, out] after a step per gradient; ``moves`` gets, per tensor, the most one step
    changed an element (the step size of NOTE [Arithmetic tolerances]; out: as master)."""
    master, state = master.clone(), [t.clone() for t in state]
    out = torch.full(master.shape, 7.0, dtype=out_dtype) if out_dtype is not None else None
    moved = [0.0] * (1 + len(state))
    for i, g in enumerate(grads):
        before = [t.double() for t in (master, *state)]
        assert step(kind, master, state, g, first + i, out=out, stochastic_round=sr, **kw) is False
        for j, (t, b) in enumerate(zip((master, *state), before)):
            moved[j] = max(moved[j], (t.double() - b).abs().max().item() if t.numel() else 0.0)
    if moves is not None:
        moves.extend(moved + (moved[:1] if out is not None else []))
    return [master, *state] + ([out] if out is not None else [])


def assert_same_update(got: list, want: list, moves: list, steps: int) -> None:
    """The native kernel's results against the reference's (NOTE [FMA parity]: bit for bit where
    torch's eager kernels fuse the same multiply-adds; else to rounding)."""
    for g, w, moved in zip(got, want, moves):
        assert_kernel_agrees(g, w, steps=steps, step_size=moved)


# -- native == reference ----------------------------------------------------------------------------
@pytest.mark.numerics
@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    n=SIZES,
    grad_dtype=st.sampled_from([FP32, BF16, FP16]),
    out_dtype=st.sampled_from([None, BF16, FP32, FP16]),
    bf16_master=st.booleans(),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([(1.0, 1.0), (1024.0, 1.0), (3.0, 0.37)]),
)
def test_native_agrees_with_reference(kind, n, grad_dtype, out_dtype, bf16_master, seed, scale):
    if kind == "adam" and not bf16_master:
        bf16_master = True  # fp32-master Adam is the compiled kernel's (tests/test_optim.py)
    master, state = make(kind, n, seed, BF16 if bf16_master else FP32)
    gen = torch.Generator().manual_seed(seed + 1)
    grads = [(torch.randn(n, generator=gen) * 0.1).to(grad_dtype) for _ in range(3)]
    sr = StochasticRound.for_parameter(seed, "w", offset=seed) if bf16_master else None
    kw = dict(out_dtype=out_dtype, sr=sr, grad_scale=scale[0], clip_coef=scale[1])
    moves: list[float] = []
    want = run(kind, master, state, grads, impl="reference", moves=moves, **kw)
    got = run(kind, master, state, grads, impl="native", **kw)
    assert_same_update(got, want, moves, len(grads))
    if out_dtype is not None:  # out is the new master, converted
        assert_bits_equal(got[-1], got[0].to(out_dtype))


def test_default_is_native_on_the_cpu():
    master, state = make("lion", 100, 0)
    grads = [torch.randn(100)]
    for w, g in zip(run("lion", master, state, grads, impl="native"), run("lion", master, state, grads)):
        assert_bits_equal(g, w)
    assert _native.available("elementwise")


# -- cutting a tensor into calls ---------------------------------------------------------------------
# (fp32-master Adam is the compiled kernel's: tests/test_optim.py::test_views_into_a_flat_buffer)
@pytest.mark.parametrize("kind, bf16_master", [(k, b) for k in KINDS for b in (False, True) if k != "adam" or b])
def test_views_into_a_flat_buffer_update_as_one_call(kind, bf16_master):
    total, cuts = 70_001, [0, 1, 2, 5, 1000, 1001, 40_000, 70_001]  # odd offsets, a part over the parallel threshold
    master, state = make(kind, total, 3, BF16 if bf16_master else FP32)
    grads = [(torch.randn(total) * 0.1).to(BF16) for _ in range(2)]
    sr = StochasticRound.for_parameter(5, "layer.weight") if bf16_master else None
    want = run(kind, master, state, grads, out_dtype=BF16, sr=sr)
    master, state, out = master.clone(), [t.clone() for t in state], torch.zeros(total, dtype=BF16)
    for i, g in enumerate(grads):
        for a, b in zip(cuts[:-1], cuts[1:]):
            step(
                kind,
                master[a:b],
                [t[a:b] for t in state],
                g[a:b],
                i + 1,
                out=out[a:b],
                stochastic_round=None if sr is None else sr.at(a),
            )
    for w, g in zip(want, [master, *state, out]):
        assert_bits_equal(g, w)


# -- found_inf: nothing changes ------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    n=st.integers(1, 5000),
    where=st.floats(0, 1, exclude_max=True),
    bad=st.sampled_from([math.inf, -math.inf, math.nan]),
    grad_dtype=st.sampled_from([FP32, BF16, FP16]),
    impl=st.sampled_from(["native", "reference", None]),
)
def test_nonfinite_grad_changes_nothing(kind, n, where, bad, grad_dtype, impl):
    master, state = make(kind, n, n, BF16 if kind == "adam" else FP32)
    grad = (torch.randn(n) * 0.1).to(grad_dtype)
    grad[int(where * n)] = bad
    out = torch.full((n,), 7.0, dtype=BF16)
    before = [t.clone() for t in (master, *state, out)]
    sr = StochasticRound.for_parameter(0, "w") if kind == "adam" else None
    assert step(kind, master, state, grad, 2, out=out, stochastic_round=sr, impl=impl) is True
    for a, b in zip([master, *state, out], before):
        assert_bits_equal(a, b)


def test_check_finite_false_skips_the_check():
    master, (buf,) = make("sgd", 100, 0)
    grad = torch.zeros(100)
    grad[5] = math.inf
    assert sgd_step(master, buf, grad, step=2, lr=0.1, momentum=0.9, check_finite=False) is False
    assert not torch.isfinite(master[5])  # the caller promised finite gradients: it gets what it asked


# -- grad_scale and clip_coef ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sgd", "adagrad", "lion"])
@pytest.mark.parametrize("grad_scale, clip_coef", [(65536.0, 1.0), (3.0, 0.7)])
def test_scale_and_clip_equal_unscaling_and_clipping_first(kind, grad_scale, clip_coef):
    master, state = make(kind, 777, 3)
    grads = [(torch.randn(777) * 0.1).to(BF16) for _ in range(3)]
    got = run(kind, master, state, grads, grad_scale=grad_scale, clip_coef=clip_coef)
    prepared = []
    for g in grads:  # what torch.amp.GradScaler.unscale_ and clip_grad_norm_ do to a gradient
        g = g.float()
        inv_scale = torch.tensor(grad_scale, dtype=torch.float64).reciprocal().float()
        torch._amp_foreach_non_finite_check_and_unscale_([g], torch.zeros(1), inv_scale)
        prepared.append(g.mul_(torch.tensor(clip_coef, dtype=torch.float32)))
    for w, g in zip(run(kind, master, state, prepared), got):
        assert_bits_equal(g, w)


# -- strides ----------------------------------------------------------------------------------------------
@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["sgd", "adagrad", "lion"])
def test_non_contiguous_tensors_are_updated_correctly(kind):
    master, state = make(kind, 1000, 5)
    grad = torch.randn(1000) * 0.1
    t = lambda x: x.reshape(40, 25).t()  # noqa: E731 - transposed: not contiguous
    got = run(kind, t(master), [t(s) for s in state], [t(grad)])
    moves: list[float] = []
    want = run(kind, master, state, [grad], moves=moves)
    assert_same_update([g.t().reshape(-1) for g in got], want, moves, 1)


# -- without a compiler ---------------------------------------------------------------------------------
def test_without_native_kernels_the_reference_runs_and_says_so(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(_native, "_LIBS", {name: _native._Library(name) for name in _native.LIBRARIES})
    monkeypatch.setattr(_run, "_said", set())
    monkeypatch.setenv("TIERMEM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    master, state = make("lion", 300, 1)
    grads = [torch.randn(300)]
    with caplog.at_level("WARNING", logger="tiermem.optim"):
        got = run("lion", master, state, grads)
        run("lion", master, state, grads)
    for w, g in zip(run("lion", master, state, grads, impl="reference"), got):
        assert_bits_equal(g, w)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len([m for m in warned if "no-such-compiler" in m]) == 1  # the build failure, once, with its reason
    assert len([m for m in warned if "run as torch ops" in m]) == 1
    with pytest.raises(TierMemError, match="native CPU optimizer kernels are unavailable here"):
        run("lion", master, state, grads, impl="native")


def test_env_turns_native_off(monkeypatch):
    monkeypatch.setenv("TIERMEM_NO_COMPILE", "1")
    assert not _native.available("elementwise")
    master, state = make("sgd", 99, 1)
    grads = [torch.randn(99)]
    for w, g in zip(run("sgd", master, state, grads, impl="reference"), run("sgd", master, state, grads)):
        assert_bits_equal(g, w)


# -- errors a caller can make -----------------------------------------------------------------------------
def _sgd(**over):
    n = over.pop("n", 8)
    args = dict(master=torch.zeros(n), momentum_buffer=torch.zeros(n), grad=torch.zeros(n))
    kw = dict(step=1, lr=1e-3, momentum=0.9)
    for k, v in over.items():
        (args if k in args else kw)[k] = v
    return sgd_step(args.pop("master"), args.pop("momentum_buffer"), args.pop("grad"), **kw)


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(step=0), r"sgd_step step=0 is invalid.*>= 1"),
        (dict(lr=-1.0), r"sgd_step lr=-1.0 is invalid.*>= 0"),
        (dict(momentum=-0.5), r"sgd_step momentum=-0.5 is invalid"),
        (dict(nesterov=True, dampening=0.1), r"nesterov=True needs momentum > 0 and dampening = 0"),
        (dict(nesterov=1), r"sgd_step nesterov=1 is invalid.*True or False"),
        (dict(momentum_buffer=None), r"momentum=0.9 needs a momentum_buffer"),
        (dict(momentum=0.0), r"momentum=0.0 takes no momentum_buffer"),
        (dict(momentum_buffer=torch.zeros(9)), r"momentum_buffer has 9 elements but master's 8 need 8"),
        (
            dict(momentum_buffer=torch.zeros(8, dtype=BF16)),
            r"momentum_buffer has dtype torch.bfloat16; it must be torch.float32",
        ),
        (dict(grad=torch.zeros(8, dtype=torch.float64)), r"grad has dtype torch.float64"),
        (dict(grad=torch.zeros(9)), r"grad has shape \(9,\) but master has \(8,\)"),
        (dict(out=torch.zeros(8, dtype=torch.int32)), r"out has dtype torch.int32"),
        (
            dict(master=torch.zeros(8, dtype=BF16)),
            r"sgd_step master has dtype torch.bfloat16, which needs stochastic rounding",
        ),
        (dict(stochastic_round=StochasticRound(1)), r"stochastic_round applies to bf16 master weights"),
        (dict(stochastic_round=3), r"stochastic_round=3 is invalid"),
        (dict(master=torch.zeros(8, dtype=FP16)), r"master has dtype torch.float16"),
        (dict(grad=torch.zeros(8, device="meta")), r"grad is on meta but master is on cpu"),
        (dict(impl="fast"), r"impl='fast' is unknown"),
    ],
)
def test_caller_errors(over, match):
    with pytest.raises(ConfigError, match=match) as e:
        _sgd(**over)
    assert str(e.value).startswith("tiermem:")


def test_aliased_buffers_are_refused():
    t = torch.zeros(8)
    with pytest.raises(ConfigError, match="share memory"):
        lion_step(t, t, torch.zeros(8), step=1, lr=1e-3)


@pytest.mark.parametrize(
    "make_bad, match",
    [
        (
            lambda: lion_step(torch.zeros(4), torch.zeros(4), torch.zeros(4), step=1, lr=1e-3, beta1=1.5),
            r"lion_step beta1=1.5 is invalid: it must be a number in \[0, 1\]",
        ),
        (
            lambda: adagrad_step(torch.zeros(4), torch.zeros(4), torch.zeros(4), step=1, lr=1e-3, lr_decay=-1.0),
            r"adagrad_step lr_decay=-1.0 is invalid",
        ),
        (
            lambda: adagrad_step(torch.zeros(4), torch.zeros(4), torch.zeros(4), step=1, lr=1e-3, eps=math.nan),
            r"adagrad_step eps=nan is invalid",
        ),
        (lambda: StochasticRound(-1), r"StochasticRound key=-1 is invalid"),
        (lambda: StochasticRound.for_parameter("0", "w"), r"StochasticRound seed='0' is invalid"),
    ],
)
def test_more_caller_errors(make_bad, match):
    with pytest.raises(ConfigError, match=match):
        make_bad()


# -- Adafactor: native passes against the reference ------------------------------------------------------
@pytest.mark.numerics
@settings(max_examples=15, deadline=None)
@given(
    shape=st.sampled_from([(1,), (4097,), (1, 1), (37, 53), (2, 3, 40, 9), (300, 129)]),
    grad_dtype=st.sampled_from([FP32, BF16]),
    bf16_master=st.booleans(),
    wd=st.sampled_from([0.0, 0.01]),
    seed=st.integers(0, 2**16),
)
def test_adafactor_native_matches_reference(shape, grad_dtype, bf16_master, wd, seed):
    """The sums are taken in double in another order than the reference's, and the reference's torch
    ops fuse the multiply-adds the CPU's kernels fuse: the results agree to rounding (NOTE
    [Arithmetic tolerances]), each step moving a value by at most the reference's largest move."""
    from tiermem.optim import adafactor_step
    from tiermem.optim.adafactor import state_numels

    gen = torch.Generator().manual_seed(seed)
    master0 = torch.randn(shape, generator=gen).to(BF16 if bf16_master else FP32)
    grads = [(torch.randn(shape, generator=gen) * 0.1).to(grad_dtype) for _ in range(3)]
    sr = StochasticRound.for_parameter(seed, "w") if bf16_master else None
    results, moves = [], []
    for impl in ("native", "reference"):
        master = master0.clone()
        state = {k: torch.zeros(v) for k, v in state_numels(shape).items()}
        out = torch.empty(shape, dtype=BF16)
        moved = [0.0] * (2 + len(state))
        for i, g in enumerate(grads):
            before = [t.double() for t in (master, out, *state.values())]
            assert (
                adafactor_step(
                    master, g, step=i + 1, lr=0.05, weight_decay=wd, out=out, stochastic_round=sr, impl=impl, **state
                )
                is False
            )
            after = [master, out, *state.values()]
            moved = [max(m, (t.double() - b).abs().max().item()) for m, t, b in zip(moved, after, before)]
        moved[1] = moved[0]  # out is the new master, converted (its first value is garbage)
        results.append([master, out, *state.values()])
        moves = moved
    for got, want, step in zip(*results, moves):
        assert_within(got, want, steps=len(grads), step_size=step)
    assert_bits_equal(results[0][1], results[0][0].to(BF16))


def test_adafactor_nonfinite_grad_changes_nothing_and_wrong_state_is_refused():
    from tiermem.optim import adafactor_step

    master, row, col, grad = torch.randn(20, 30), torch.rand(20), torch.rand(30), torch.randn(20, 30)
    grad[19, 29] = math.inf
    before = [t.clone() for t in (master, row, col)]
    assert adafactor_step(master, grad, step=2, row_var=row, col_var=col) is True
    for a, b in zip((master, row, col), before):
        assert_bits_equal(a, b)
    with pytest.raises(ConfigError, match=r"factors a tensor of shape \(20, 30\): pass row_var and col_var"):
        adafactor_step(master, grad, step=2, variance=torch.zeros(600))
    with pytest.raises(ConfigError, match=r"keeps a full variance for a tensor of shape \(600,\)"):
        adafactor_step(master.view(-1), grad.view(-1), step=2, row_var=row, col_var=col)
    with pytest.raises(ConfigError, match=r"row_var has 21 elements but master's 600 need 20"):
        adafactor_step(master, grad, step=2, row_var=torch.zeros(21), col_var=col)
    with pytest.raises(ConfigError, match=r"shape=\(7, 7\) has 49 elements but master has 600"):
        adafactor_step(master, grad, step=2, row_var=row, col_var=col, shape=(7, 7))
    with pytest.raises(ConfigError, match=r"adafactor_step d=0.5 is invalid"):
        adafactor_step(master, grad, step=2, row_var=row, col_var=col, d=0.5)


# (grad dtype, out dtype, adamw, beta1): variants tests/test_optim.py compiles anyway
@pytest.mark.parametrize(
    "grad_dtype, out_dtype, adamw, beta1",
    [(BF16, BF16, True, 0.9), (FP32, None, True, 0.95), (FP16, FP16, False, 0.8), (BF16, FP32, False, 0.3)],
)
def test_native_fp32_adam_is_the_compiled_kernel(grad_dtype, out_dtype, adamw, beta1):
    """CPUAdam steps fp32 weights with the native kernel (NOTE [Drop-in speed]); adam_step with the
    compiled one. Both are the reference bit for bit, so each other."""
    from tiermem.optim.adam_hyper import AdamHyper

    master0, state0 = make("adam", 40_003, 9)
    grads = [(torch.randn(40_003) * 0.1).to(grad_dtype) for _ in range(3)]
    hp = dict(lr=1e-3, beta1=beta1, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=adamw)
    results = []
    for native in (False, True):
        master, state = master0.clone(), [t.clone() for t in state0]
        out = torch.full(master.shape, 7.0, dtype=out_dtype) if out_dtype is not None else None
        for i, g in enumerate(grads):
            if native:
                _run.run(
                    _run.ADAM,
                    master,
                    state,
                    g,
                    out,
                    AdamHyper(step=i + 1, **hp),
                    stochastic_round=None,
                    check_finite=True,
                    impl="native",
                )
            else:
                adam_step(master, *state, g, step=i + 1, out=out, impl="compiled", **hp)
        results.append([master, *state] + ([out] if out is not None else []))
    for got, want in zip(*results):
        assert_bits_equal(got, want)
