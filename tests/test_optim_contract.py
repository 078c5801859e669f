"""The drop-in optimizers against torch.optim.Optimizer's whole contract (NOTE [Drop-in contract] in
tiermem/optim/dropin/shared.py): what torch accepts works as in torch (the installed torch is the oracle),
what a drop-in does not implement is refused by name, at construction and at load_state_dict; and the
8-bit Adam's updates stay within exact Adam's bound (NOTE [8-bit moment bound] in tiermem/optim/kernels/quant.py).
"""

from __future__ import annotations

import copy
import math
import pickle

import forked
import pytest
import torch

from tiermem import ConfigError
from tiermem.optim import (
    CPUSGD,
    CPUAdafactor,
    CPUAdagrad,
    CPUAdam,
    CPUAdam8bit,
    CPULion,
    adam8bit_step,
    dequantize_blockwise,
    quantize_blockwise,
)

DROPINS = {
    "CPUAdam": CPUAdam,
    "CPUAdam8bit": CPUAdam8bit,
    "CPUSGD": CPUSGD,
    "CPUAdagrad": CPUAdagrad,
    "CPULion": CPULion,
    "CPUAdafactor": CPUAdafactor,
}
# each drop-in's torch optimizer (CPULion has none), and the flags of it the drop-in does not implement
TORCH_TWIN = {
    "CPUAdam": (torch.optim.AdamW, ("amsgrad", "maximize", "capturable", "differentiable")),
    "CPUAdam8bit": (torch.optim.AdamW, ("amsgrad", "maximize", "capturable", "differentiable")),
    "CPUSGD": (torch.optim.SGD, ("differentiable",)),
    "CPUAdagrad": (torch.optim.Adagrad, ("differentiable",)),
    "CPUAdafactor": (torch.optim.Adafactor, ()),
}
REFUSED = [(name, flag) for name, (_, flags) in TORCH_TWIN.items() for flag in flags] + [
    ("CPULion", flag) for flag in ("amsgrad", "maximize", "capturable", "differentiable", "nesterov")
]
SGD_MOMENTUM = {"CPUSGD": {"momentum": 0.9}}  # so SGD keeps state too


def make(name: str, params, **kw):
    return DROPINS[name](params, **{**SGD_MOMENTUM.get(name, {}), **kw})


def model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3))


def train(opt: torch.optim.Optimizer, m: torch.nn.Module, steps: int = 2, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        m(torch.randn(5, 8, generator=g)).square().sum().backward()
        opt.step()


def weights(m: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()]


def snapshot(opt: torch.optim.Optimizer) -> tuple:
    """The optimizer's state and groups, deep-copied, to compare before and after a refusal."""
    state = {i: copy.deepcopy(opt.state[p]) for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return state, copy.deepcopy(groups), [len(g["params"]) for g in opt.param_groups]


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# -- 1. state allocations under another default dtype; the native kernels' boundary ----------------------
def _bf16_default_child() -> dict:
    torch.set_default_dtype(torch.bfloat16)
    out = {}
    for name in DROPINS:
        p = torch.nn.Parameter(torch.randn(64, 64, dtype=torch.float32))  # 4096: 8-bit state for CPUAdam8bit
        opt = make(name, [p])
        p.grad = torch.randn(64, 64, dtype=torch.float32)
        opt.step()
        opt.step()
        out[name] = (
            {k: v.dtype for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)},
            bool(p.isfinite().all()),
        )
    # the native kernel's boundary: a state tensor of the wrong dtype is a clear error, nothing changed
    p = torch.nn.Parameter(torch.randn(4096, dtype=torch.float32))
    opt = CPUAdam8bit([p])
    p.grad = torch.randn(4096, dtype=torch.float32)
    opt.step()
    opt.state[p]["exp_avg_absmax"] = opt.state[p]["exp_avg_absmax"].bfloat16()
    before = (p.detach().clone(), opt.state[p]["step"].clone())
    try:
        opt.step()
        out["boundary"] = "no error"
    except ConfigError as e:
        out["boundary"] = str(e)
    out["unchanged"] = torch.equal(before[0], p.detach()) and torch.equal(before[1], opt.state[p]["step"])
    return out


def test_state_is_fp32_under_a_bf16_default_dtype_and_kernels_check_what_they_read():
    """torch.set_default_dtype(torch.bfloat16) once made CPUAdam8bit's absmax bf16 and its kernel
    wrote fp32 past them (heap corruption): run in a child, which such a bug kills."""
    child = forked.run(_bf16_default_child)
    assert child.exitcode == 0, child.error or f"the child died (exit code {child.exitcode})"
    res = child.value
    for name in DROPINS:
        dtypes, finite = res[name]
        assert finite, name
        for key, dtype in dtypes.items():
            want = torch.uint8 if name == "CPUAdam8bit" and key in ("exp_avg", "exp_avg_sq") else torch.float32
            assert dtype == want, (name, key, dtype)
    assert res["boundary"].startswith("tiermem: CPUAdam8bit state 'exp_avg_absmax'"), res["boundary"]
    assert "torch.float32" in res["boundary"]
    assert res["unchanged"]


def test_the_native_call_checks_state_dtypes_itself():
    """The kernel boundary itself (not only the drop-in's step) refuses a state tensor of another dtype."""
    from tiermem.optim.kernels import dispatch as _run, native as _native

    lib = _run.native_library(_run.ADAM8BIT)
    if lib is None:
        pytest.skip("the native kernels cannot be built here")  # the boundary then is the checked run
    p, g = torch.zeros(4096), torch.zeros(4096)
    state = (
        torch.zeros(4096, dtype=torch.uint8),
        torch.zeros(16, dtype=torch.bfloat16),
        torch.zeros(4096, dtype=torch.uint8),
        torch.zeros(16),
    )
    with pytest.raises(ConfigError, match=r"^tiermem: adam8bit_step exp_avg_absmax is a torch.bfloat16 tensor"):
        _run.native_call(_run.ADAM8BIT, lib, p, state, g, _native.floats([0.0] * 15), None)


# -- 2. param groups as generators -------------------------------------------------------------------------
@pytest.mark.parametrize("name", DROPINS)
def test_a_group_given_as_a_generator_trains_as_in_torch(name):
    m = model()
    opt = make(name, [{"params": m[0].parameters()}, {"params": (p for p in m[1].parameters()), "lr": 1e-3}])
    oracle = torch.optim.SGD([{"params": m[0].parameters()}, {"params": m[1].parameters()}], lr=0.1)
    assert [len(g["params"]) for g in opt.param_groups] == [len(g["params"]) for g in oracle.param_groups] == [2, 2]
    before = weights(m)
    train(opt, m, steps=1)
    assert all(not torch.equal(a, b) for a, b in zip(before, weights(m)))


# -- 3. flags the drop-in does not implement: refused at construction and at load_state_dict ---------------
def _saved_state(name: str, flag: str) -> dict:
    """A state dict (after a step) of the drop-in's torch optimizer, or of the drop-in, with ``flag`` set."""
    m = model()
    if name in TORCH_TWIN:
        cls = TORCH_TWIN[name][0]
        kw = {"momentum": 0.9} if cls is torch.optim.SGD else {}
        twin = cls(m.parameters(), lr=1e-2, **kw)
    else:
        twin = make(name, m.parameters())
    train(twin, m, steps=1)
    sd = twin.state_dict()
    for group in sd["param_groups"]:
        group[flag] = True
    return sd


@pytest.mark.parametrize(("name", "flag"), REFUSED)
def test_a_flag_the_dropin_lacks_is_refused_by_load_state_dict_and_changes_nothing(name, flag):
    m = model()
    opt = make(name, m.parameters())
    train(opt, m, steps=1)
    before, w = snapshot(opt), weights(m)
    with pytest.raises(ConfigError, match=rf"^tiermem: {name} got {flag}=True in param group 0 .*set {flag}=False$"):
        opt.load_state_dict(_saved_state(name, flag))
    assert same(snapshot(opt), before)
    train(opt, m, steps=1)  # and it still steps as it did
    assert all(not torch.equal(a, b) for a, b in zip(w, weights(m)))


@pytest.mark.parametrize(("name", "flag"), REFUSED)
def test_a_flag_the_dropin_lacks_is_refused_in_a_given_param_group(name, flag):
    m = model()
    with pytest.raises(ConfigError, match=rf"^tiermem: {name} got {flag}=True in param group 0"):
        make(name, [{"params": m.parameters(), flag: True}])
    opt = make(name, m[0].parameters())
    with pytest.raises(ConfigError, match=rf"^tiermem: {name} got {flag}=True in param group 1"):
        opt.add_param_group({"params": m[1].parameters(), flag: True})
    assert len(opt.param_groups) == 1  # refused whole


@pytest.mark.parametrize("name", ["CPUAdam", "CPUAdam8bit"])
def test_torch_adamw_maximize_state_dict_no_longer_steps_the_wrong_way(name):
    """The reported case: a torch.optim.AdamW(maximize=True) state dict loaded into CPUAdam."""
    m = model()
    twin = torch.optim.AdamW(m.parameters(), lr=1e-2, maximize=True)
    opt = make(name, m.parameters())
    with pytest.raises(ConfigError, match="maximize=True"):
        opt.load_state_dict(twin.state_dict())
    assert opt.param_groups[0].get("maximize") is None


# -- 4. pickling and deepcopy keep the drop-in's own settings ---------------------------------------------
@pytest.mark.parametrize("name", DROPINS)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_keeps_its_settings_and_steps_as_the_original(name, how):
    m = model()
    kw = {"min_8bit_size": 16} if name == "CPUAdam8bit" else {}
    opt = make(name, m.parameters(), check_finite=False, **kw)
    train(opt, m, steps=1)
    m2, opt2 = copy.deepcopy((m, opt)) if how == "deepcopy" else pickle.loads(pickle.dumps((m, opt)))
    assert opt2.check_finite is False and opt2.last_step_skipped is False
    if name == "CPUAdam8bit":
        assert opt2.min_8bit_size == 16
    train(opt, m, steps=2, seed=5)
    train(opt2, m2, steps=2, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(weights(m), weights(m2)))


# -- 5. named_parameters(), and torch's named / unnamed state-dict rules -----------------------------------
@pytest.mark.parametrize("name", DROPINS)
def test_named_parameters_work_as_in_torch(name):
    m = model()
    opt = make(name, m.named_parameters())
    oracle = torch.optim.SGD(m.named_parameters(), lr=0.1)
    assert opt.param_groups[0]["param_names"] == oracle.param_groups[0]["param_names"]
    train(opt, m, steps=1)
    saved = opt.state_dict()
    assert saved["param_groups"][0]["param_names"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    # loading a named state dict into an unnamed optimizer takes the names, as torch does; an unnamed one
    # into a named optimizer keeps them
    unnamed = make(name, model().parameters())
    unnamed.load_state_dict(saved)
    oracle_unnamed = torch.optim.SGD(model().parameters(), lr=0.1)
    oracle_unnamed.load_state_dict(oracle.state_dict())
    assert unnamed.param_groups[0]["param_names"] == oracle_unnamed.param_groups[0]["param_names"]
    named = make(name, model().named_parameters())
    named.load_state_dict(make(name, model().parameters()).state_dict())
    assert named.param_groups[0]["param_names"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    # groups with and without names do not mix, as in torch
    with pytest.raises(ValueError, match="with/without names"):
        make(name, [{"params": m[0].named_parameters()}, {"params": m[1].parameters()}])


# -- 6. a plain-number step; 7. groups missing hyperparameters (older torch) --------------------------------
@pytest.mark.parametrize("name", DROPINS)
@pytest.mark.parametrize("step", [1, 1.0])
def test_a_state_dict_whose_step_is_a_number_loads_as_torch_converts_it(name, step):
    m = model()
    opt = make(name, m.parameters())
    train(opt, m, steps=1)
    ref_m = copy.deepcopy(m)
    ref = make(name, ref_m.parameters())
    ref.load_state_dict(opt.state_dict())
    sd = opt.state_dict()
    for s in sd["state"].values():
        s["step"] = step
    opt.load_state_dict(sd)
    for p in opt.param_groups[0]["params"]:
        assert opt.state[p]["step"].dtype == torch.float32 and opt.state[p]["step"].dim() == 0
    train(opt, m, steps=1)
    train(ref, ref_m, steps=1)
    assert all(torch.equal(a, b) for a, b in zip(weights(m), weights(ref_m)))
    assert all(float(opt.state[p]["step"]) == 2.0 for p in opt.param_groups[0]["params"])


@pytest.mark.parametrize("name", DROPINS)
def test_groups_missing_hyperparameters_take_the_defaults_as_torch_fills_them(name):
    m = model()
    opt = make(name, m.parameters())
    train(opt, m, steps=1)
    sd = opt.state_dict()
    missing = [k for k in opt.defaults if k not in ("lr", "momentum")]
    for k in missing:
        del sd["param_groups"][0][k]
    opt.load_state_dict(sd)
    for k in missing:
        assert opt.param_groups[0][k] == opt.defaults[k], k
    train(opt, m, steps=1)


# -- 8. a bf16 parameter swapped into a group under stochastic rounding -------------------------------------
@pytest.mark.parametrize("name", DROPINS)
def test_a_parameter_swapped_into_a_group_rounds_as_in_a_fresh_optimizer(name):
    torch.manual_seed(0)
    a, b = (torch.nn.Parameter(torch.randn(300, dtype=torch.bfloat16)) for _ in range(2))
    grad = torch.randn(300, dtype=torch.bfloat16)
    opt = make(name, [a], bf16_stochastic_round=True, sr_seed=7)
    a.grad = grad.clone()
    opt.step()
    opt.param_groups[0]["params"][0] = b  # swapped in by hand, as torch allows
    b0 = b.detach().clone()
    b.grad = grad.clone()
    opt.step()
    fresh = torch.nn.Parameter(b0)
    ref = make(name, [fresh], bf16_stochastic_round=True, sr_seed=7)
    fresh.grad = grad.clone()
    ref.step()
    assert torch.equal(b.detach(), fresh.detach())


# -- 9. a step is all or nothing -----------------------------------------------------------------------------
def test_a_refused_non_contiguous_8bit_parameter_changes_nothing():
    q = torch.nn.Parameter(torch.randn(4096))
    p = torch.nn.Parameter(torch.randn(64, 128).t())  # non-contiguous, 8-bit state
    opt = CPUAdam8bit([q, p])
    q.grad, p.grad = torch.randn(4096), torch.randn(128, 64)
    q0 = q.detach().clone()
    with pytest.raises(ConfigError, match="^tiermem: CPUAdam8bit got a non-contiguous parameter of shape"):
        opt.step()
    assert torch.equal(q.detach(), q0)
    assert len(opt.state) == 0  # no state made, no step counted


@pytest.mark.parametrize("name", DROPINS)
def test_a_step_refused_for_a_later_group_changes_no_earlier_one(name):
    m = model()
    opt = make(name, [{"params": m[0].parameters()}, {"params": m[1].parameters()}])
    train(opt, m, steps=1)
    opt.param_groups[1]["lr"] = -1.0  # a bad value set after construction
    before, w = snapshot(opt), weights(m)
    with pytest.raises(ConfigError, match="lr"):
        train(opt, m, steps=1)
    after = snapshot(opt)
    assert same(after[0], before[0])
    assert all(torch.equal(a, b) for a, b in zip(w, weights(m)))


# -- the rest of torch's contract: hooks, duplicate parameters ----------------------------------------------
@pytest.mark.parametrize("name", DROPINS)
def test_hooks_run_as_torch_runs_them(name):
    m = model()
    opt = make(name, m.parameters())
    calls: list[str] = []
    handles = [
        opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre")),
        opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post")),
        opt.register_state_dict_pre_hook(lambda o: calls.append("sd_pre")),
        opt.register_state_dict_post_hook(lambda o, sd: calls.append("sd_post")),
        opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_pre")),
        opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post")),
    ]
    train(opt, m, steps=1)
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre", "post", "sd_pre", "sd_post", "load_pre", "load_post"]
    for h in handles:
        h.remove()
    train(opt, m, steps=1)
    assert len(calls) == 6


@pytest.mark.parametrize("name", DROPINS)
def test_a_parameter_already_present_is_refused_as_torch_refuses_it(name):
    m = model()
    opt = make(name, m[0].parameters())
    oracle = torch.optim.SGD(m[0].parameters(), lr=0.1)
    with pytest.raises(ValueError) as torch_error:
        oracle.add_param_group({"params": [m[0].weight]})
    with pytest.raises(ValueError, match=str(torch_error.value)):
        opt.add_param_group({"params": [m[0].weight]})
    assert len(opt.param_groups) == 1


# -- 11. the 8-bit Adam's updates are bounded as exact Adam's ----------------------------------------------
def adam_update_bound(beta1: float, beta2: float, t: int) -> float:
    """The largest |m_hat| / sqrt(v_hat) exact Adam reaches at step t (eps = 0), derived in NOTE [8-bit
    moment bound]: sqrt(K_t) * sqrt(1 - beta2^t) / (1 - beta1^t), K_t = (1 - beta1)^2 / (1 - beta2) *
    sum_{j<t} (beta1^2 / beta2)^j. Computed here on its own, not by the library's function."""
    gamma = beta1 * beta1 / beta2
    k = (1 - beta1) ** 2 / (1 - beta2) * sum(gamma**j for j in range(t))
    return math.sqrt(k) * math.sqrt(1 - beta2**t) / (1 - beta1**t)


def _blowup_grads(n: int = 4096) -> list[torch.Tensor]:
    """Step 1: a gradient of 1 and one of 1e-4 in the same block of 256. The second's v is 1e-8 of the
    block's absmax, below the map's 1e-7, so it quantizes to 0 while its m (1e-4 of m's absmax) does
    not; then zero gradients: without the bound its update is lr * m_hat / eps, 7.4 at lr 1e-3."""
    g = torch.zeros(n)
    g[0], g[1] = 1.0, 1e-4
    return [g] + [torch.zeros(n) for _ in range(5)]


@pytest.mark.parametrize("path", ["dropin", "native", "reference"])
def test_an_8bit_update_never_exceeds_exact_adams_bound(path):
    lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8
    p = torch.nn.Parameter(torch.zeros(4096))
    opt = CPUAdam8bit([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.0)
    state = None
    for t, g in enumerate(_blowup_grads(), start=1):
        before = p.detach().clone()
        if path == "dropin":
            p.grad = g.clone()
            opt.step()
        else:
            if state is None:
                state = (
                    torch.zeros(4096, dtype=torch.uint8),
                    torch.zeros(16),
                    torch.zeros(4096, dtype=torch.uint8),
                    torch.zeros(16),
                )
            with torch.no_grad():
                adam8bit_step(p, *state, g, step=t, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=0.0, impl=path)
        # |dw| <= lr * bound, up to fp32 rounding: the update is ~10 fp32 operations, each off by at
        # most 2^-24 relative, so a factor 1 + 2^-18 (64 such roundings) holds it
        bound = lr * adam_update_bound(b1, b2, t) * (1 + 2.0**-18)
        worst = float((p.detach() - before).abs().max())
        assert worst <= bound, f"step {t}: |dw| = {worst} > {bound}"


def test_the_bound_changes_only_a_v_that_rounded_to_zero_and_native_equals_reference():
    """After the first step of the blow-up case, the stored state is fp32 Adam's moments quantized, but
    for the one v that rounded to 0 under a nonzero m: that one holds the smallest code whose value is
    at least m_q^2 / K_1; the native kernel and the reference store the same bits."""
    b1, b2 = 0.9, 0.999
    g = _blowup_grads()[0]
    states = {}
    for impl in ("native", "reference"):
        state = [
            torch.zeros(4096, dtype=torch.uint8),
            torch.zeros(16),
            torch.zeros(4096, dtype=torch.uint8),
            torch.zeros(16),
        ]
        adam8bit_step(
            torch.zeros(4096), *state, g, step=1, lr=1e-3, beta1=b1, beta2=b2, eps=1e-8, weight_decay=0.0, impl=impl
        )
        states[impl] = state
    for a, b in zip(states["native"], states["reference"]):
        assert torch.equal(a, b)
    m_codes, m_absmax, v_codes, v_absmax = states["native"]
    want_m = quantize_blockwise((1 - b1) * g, True)
    want_v = quantize_blockwise((1 - b2) * g * g, False)
    assert torch.equal(m_codes, want_m[0]) and torch.equal(m_absmax, want_m[1]) and torch.equal(v_absmax, want_v[1])
    changed = (v_codes != want_v[0]).nonzero().flatten().tolist()
    assert changed == [1] and int(want_v[0][1]) == 0
    m_q = float(dequantize_blockwise(m_codes, m_absmax, True)[1])
    k1 = (1 - b1) ** 2 / (1 - b2)
    values = dequantize_blockwise(torch.arange(256, dtype=torch.uint8).repeat(16), v_absmax[:1].repeat(16), False)[:256]
    target = m_q * m_q / k1
    assert float(values[int(v_codes[1])]) >= target * (1 - 2.0**-20)  # (target in double here, fp32 there)
    assert float(values[int(v_codes[1]) - 1]) < target
