"""Optimizers beyond Adam inside TieredModel (NOTE [State formats] in tiermem/optim/formats.py): SGD,
Adagrad, Lion and 8-bit AdamW, with fp32 or bf16 (stochastically rounded) master weights, on every
tier. Oracles: torch.optim.SGD/Adagrad and torch.optim.AdamW in plain for-loops (each to rounding,
NOTE [Arithmetic tolerances] in tests/tolerance.py, a step bounded by the oracle's largest), Lion as the paper
writes it (in this file), and for 8-bit AdamW torch's AdamW whose moments are quantized and
dequantized after every step (quantized as the 8-bit kernels store them: _quant.quantize_moments)."""

from __future__ import annotations

import functools
import json
import logging
import struct

import pytest
import torch
from models import TinyGPT, gpt_batch, gpt_loss
from tolerance import assert_within, fp32_bound

import tiermem
from tiermem import ConfigError, PerClass, TensorClass, Tier, TieredModel, TierMemError
from tiermem.checkpoint import file as checkpoint
from tiermem.optim import dequantize_blockwise, quantize_blockwise
from tiermem.optim.kernels import quant as _quant
from tiermem.policies import KeepOnDevice, ZeroInfinity, ZeroOffload

STEPS = 4
SMALL_8BIT = 256  # TinyGPT's matrices are below bitsandbytes' 4096: quantize those of 256 elements and more


class StateOnNvme(PerClass):
    homes = {
        TensorClass.PARAM: Tier.DEVICE,
        TensorClass.ACTIVATION: Tier.DEVICE,
        TensorClass.GRAD: Tier.NVME,
        TensorClass.OPTIM_STATE: Tier.NVME,
    }


POLICIES = {
    "zero_offload": ZeroOffload,
    "keep_on_device": KeepOnDevice,
    "zero_infinity": ZeroInfinity,
    "state_on_nvme": StateOnNvme,
}


class PaperLion(torch.optim.Optimizer):
    """Lion as Chen et al. (2023) write it (Program 1): ``c = b1*m + (1-b1)*g``; ``p -= lr*(sign(c) +
    wd*p)``; ``m = b2*m + (1-b2)*g``."""

    def __init__(self, params, lr: float, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                c = m * b1 + p.grad * (1 - b1)
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(torch.sign(c), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


def quantized_moments(opt: torch.optim.Optimizer, min_size: int = SMALL_8BIT, *, bound: bool = True) -> None:
    """After a torch AdamW step: each large parameter's moments as 8-bit state holds them (quantized
    together, NOTE [8-bit moment bound]; ``bound=False``: each on its own, as a checkpoint's load does)."""
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            m, v = st["exp_avg"], st["exp_avg_sq"]
            if m.numel() >= min_size:
                b1, b2 = group["betas"]
                if bound:
                    q = _quant.quantize_moments(m.view(-1), v.view(-1), step=int(st["step"]), beta1=b1, beta2=b2)
                else:
                    q = (*quantize_blockwise(m.view(-1), signed=True), *quantize_blockwise(v.view(-1), signed=False))
                m.copy_(dequantize_blockwise(q[0], q[1], signed=True).view(m.shape))
                v.copy_(dequantize_blockwise(q[2], q[3], signed=False).view(v.shape))


def torch_loop(make, *, after=None, steps: int = STEPS, moves: list[float] | None = None) -> dict:
    """The weights after ``steps`` steps of ``make``'s optimizer; ``moves`` gets how far each step
    moved the weights at most (the step size of NOTE [Arithmetic tolerances])."""
    torch.manual_seed(0)
    m = TinyGPT()
    opt = make(m.parameters())
    for i in range(steps):
        before = [p.detach().clone() for p in m.parameters()]
        x, y = gpt_batch(i)
        gpt_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
        if after is not None:
            after(opt)
        if moves is not None:
            moves.append(max((p.detach() - b).abs().max().item() for p, b in zip(m.parameters(), before)))
    return m.state_dict()


def oracle(make, **kw) -> tuple[dict, float]:
    """torch's for-loop run of ``make`` and the most one of its steps moved a weight."""
    moves: list[float] = []
    return torch_loop(make, moves=moves, **kw), max(moves)


def assert_rounding_apart(got: dict, want: dict, step_size: float, steps: int = STEPS) -> None:
    """NOTE [Arithmetic tolerances]: ``got`` is ``want`` after ``steps`` fp32 steps of at most
    ``step_size`` (twice the oracle's largest: the two runs' steps are the same to rounding)."""
    assert_within(got, want, steps=steps, step_size=2 * step_size)


def tiered(
    make,
    *,
    policy: str = "zero_offload",
    precision: str = "fp32",
    steps: int = STEPS,
    tmp_path=None,
    bucket_size: int = 4000,
    start: int = 0,
    tm_out: list | None = None,
) -> dict:
    torch.manual_seed(0)
    m = TinyGPT()
    nvme = {"nvme_dir": str(tmp_path)} if policy in ("zero_infinity", "state_on_nvme") else {}
    tm = TieredModel(
        m, POLICIES[policy](), optimizer=make(m.parameters()), precision=precision, bucket_size=bucket_size, **nvme
    )
    for i in range(start, start + steps):
        x, y = gpt_batch(i)
        tm.backward(gpt_loss(tm(x), y))
        tm.step()
    out = tm.state_dict()
    if tm_out is not None:
        tm_out.append(tm)
    else:
        tm.detach()
    return out


def diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


TORCH = {
    "sgd": lambda ps, **v: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, **v),
    "sgd_dampened": lambda ps, **v: torch.optim.SGD(
        ps, lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01, maximize=True, **v
    ),
    "sgd_plain": lambda ps, **v: torch.optim.SGD(ps, lr=0.05, **v),
    "adagrad": lambda ps, **v: torch.optim.Adagrad(
        ps, lr=0.05, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1, **v
    ),
}


@functools.cache
def torch_reference(kind: str) -> tuple[dict, float]:
    """torch's for-loop result and its largest step."""
    return oracle(lambda ps: TORCH[kind](ps, foreach=False))


@pytest.mark.numerics
@pytest.mark.parametrize("kind", list(TORCH))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_torch_sgd_and_adagrad_given_as_optimizer_match_torch_on_every_tier(kind, policy, tmp_path):
    ref, step = torch_reference(kind)
    got = tiered(lambda ps: TORCH[kind](ps), policy=policy, tmp_path=tmp_path)
    assert_rounding_apart(got, ref, step)
    assert diff(got, torch_loop(lambda ps: torch.optim.SGD(ps, lr=0.0))) > 1e-3  # it trained


@functools.cache
def lion_reference() -> tuple[dict, float]:
    return oracle(lambda ps: PaperLion(ps, lr=1e-3, weight_decay=0.1))


@pytest.mark.numerics
@pytest.mark.parametrize("policy", list(POLICIES))
def test_lion_matches_the_papers_update_on_every_tier(policy, tmp_path):
    ref, step = lion_reference()
    got = tiered(lambda ps: tiermem.Lion(ps, lr=1e-3, weight_decay=0.1), policy=policy, tmp_path=tmp_path)
    assert_rounding_apart(got, ref, step)  # the sign is the same in both: c is never at its rounding here
    assert diff(got, torch_loop(lambda ps: torch.optim.SGD(ps, lr=0.0))) >= 1e-3 * STEPS * 0.9  # sign steps of lr


@functools.cache
def adamw_8bit_reference() -> tuple[dict, float, dict]:
    """torch's for-loop AdamW with its moments quantized after every step (the oracle), its largest
    step, and plain fp32 AdamW."""
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False)  # noqa: E731
    ref, step = oracle(make, after=quantized_moments)
    return ref, step, torch_loop(make)


@pytest.mark.numerics
@pytest.mark.parametrize("policy", list(POLICIES))
def test_adamw_8bit_is_torch_adamw_with_8bit_moments_on_every_tier(policy, tmp_path):
    ref, step, plain = adamw_8bit_reference()
    got = tiered(
        lambda ps: tiermem.AdamW8bit(ps, lr=1e-2, weight_decay=0.1, min_8bit_size=SMALL_8BIT),
        policy=policy,
        tmp_path=tmp_path,
    )
    # The same quantization of moments a rounding apart gives the same codes, except where a value lies
    # at a code's edge (or at the edge of NOTE [8-bit moment bound]'s rule): there the code flips and
    # moves its element by a quantization step, far more than rounding but far less than one step of
    # lr. So: every element within NOTE [Arithmetic tolerances]' bound but at most 1 in 1,000, and
    # those within lr of the oracle; 8-bit moments move the weights away from fp32 AdamW's by far more.
    flipped, total = 0, 0
    for k, want in ref.items():
        bound = fp32_bound(want, steps=STEPS, step_size=2 * step)
        off = (got[k] - want).abs() > bound
        flipped += int(off.sum())
        total += want.numel()
        assert float((got[k] - want).abs().max()) <= 1e-2, k  # lr: one code flip moves less than a step
    assert flipped <= total // 1000, (flipped, total)
    with pytest.raises(AssertionError):
        assert_rounding_apart(got, plain, 10 * step)


def test_bitsandbytes_and_torchao_8bit_adamw_map_by_class_name_without_importing_them():
    def fake(module: str, name: str, **defaults):
        cls = type(name, (torch.optim.Optimizer,), {"__module__": module})
        cls.__init__ = lambda self, ps, **kw: torch.optim.Optimizer.__init__(self, ps, {**defaults, **kw})
        return cls

    m = TinyGPT()
    bnb = fake(
        "bitsandbytes.optim.adamw",
        "PagedAdamW8bit",
        lr=1e-3,
        betas=(0.9, 0.99),
        eps=1e-8,
        weight_decay=0.01,
        amsgrad=False,
        optim_bits=8,
        min_8bit_size=4096,
        percentile_clipping=100,
        max_unorm=0.0,
        is_paged=True,
    )
    tm = TieredModel(m, optimizer=bnb(m.parameters(), lr=3e-3), precision="fp32")
    g = tm.optimizer.param_groups[0]
    assert (g["lr"], g["betas"]) == (3e-3, (0.9, 0.99))
    tm.detach()
    ao = fake(
        "torchao.optim.adam",
        "AdamW8bit",
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.01,
        amsgrad=False,
        block_size=256,
        bf16_stochastic_round=True,
    )
    m2 = TinyGPT()
    tm = TieredModel(m2, optimizer=ao(m2.parameters()), precision="bf16")  # its bf16_stochastic_round taken
    x, y = gpt_batch(0)
    tm.backward(gpt_loss(tm(x), y))
    tm.step()
    tm.detach()
    clipped = bnb(m.parameters(), percentile_clipping=5)
    with pytest.raises(
        ConfigError, match=r"tiermem: the PagedAdamW8bit given as optimizer= sets percentile_clipping=5"
    ):
        TieredModel(m, optimizer=clipped)


SR_SPECS = {
    "adamw": lambda ps: tiermem.AdamW(ps, lr=1e-2, bf16_stochastic_round=True),
    "sgd": lambda ps: tiermem.SGD(ps, lr=0.05, momentum=0.9, bf16_stochastic_round=True),
    "adagrad": lambda ps: tiermem.Adagrad(ps, lr=0.05, bf16_stochastic_round=True),
    "lion": lambda ps: tiermem.Lion(ps, lr=1e-3, weight_decay=0.1, bf16_stochastic_round=True),
    "adamw8bit": lambda ps: tiermem.AdamW8bit(ps, lr=1e-2, min_8bit_size=SMALL_8BIT, bf16_stochastic_round=True),
    "adamw8bit_fp32_master": lambda ps: tiermem.AdamW8bit(ps, lr=1e-2, min_8bit_size=SMALL_8BIT),
}


@pytest.mark.parametrize("kind", list(SR_SPECS))
def test_bf16_is_bit_identical_across_policies_and_bucket_sizes(kind, tmp_path):
    base = tiered(SR_SPECS[kind], precision="bf16")
    for policy, bucket_size in (
        ("keep_on_device", 4000),
        ("zero_offload", 100_000),
        ("zero_infinity", 1000),
        ("state_on_nvme", 4000),
    ):
        got = tiered(SR_SPECS[kind], precision="bf16", policy=policy, bucket_size=bucket_size, tmp_path=tmp_path)
        assert diff(got, base) == 0.0, (policy, bucket_size)


def test_stochastic_rounding_keeps_updates_round_to_nearest_loses():
    """bf16 master weights with stochastic rounding follow fp32 masters closely; an update far below
    half a bf16 ulp still moves them on average, where rounding to nearest would drop it."""
    fp32 = tiered(lambda ps: tiermem.AdamW(ps, lr=1e-2), precision="bf16")
    sr = tiered(SR_SPECS["adamw"], precision="bf16")
    assert 0 < diff(sr, fp32) < 0.05
    tm_out: list = []
    tiered(lambda ps: tiermem.SGD(ps, lr=1e-5, bf16_stochastic_round=True), precision="bf16", steps=8, tm_out=tm_out)
    tm = tm_out[0]
    moved = diff(tm.state_dict(), torch_loop(lambda ps: torch.optim.SGD(ps, lr=0.0)))
    assert moved > 0  # lr 1e-5 is below half an ulp of most weights: round-to-nearest would leave them all
    tm.detach()


def _footer(path) -> dict:
    data = open(path, "rb").read()
    tail = struct.Struct("<QQ")
    n, _ = tail.unpack(data[-len(checkpoint.MAGIC) - tail.size : -len(checkpoint.MAGIC)])
    start = len(data) - len(checkpoint.MAGIC) - tail.size - n
    return json.loads(data[start : start + n])


@pytest.mark.parametrize("policy", ["zero_offload", "zero_infinity"])
def test_checkpoint_stores_8bit_state_as_it_is_and_resumes_bit_exact(policy, tmp_path):
    make = SR_SPECS["adamw8bit"]
    whole = tiered(make, precision="bf16", steps=4)
    tm_out: list = []
    (tmp_path / "a").mkdir()
    tiered(make, precision="bf16", steps=2, policy=policy, tmp_path=tmp_path / "a", tm_out=tm_out)
    tm_out[0].save(str(tmp_path / "ckpt.tm"))
    tm_out[0].detach()
    dtypes = {e["name"]: e["dtype"] for e in _footer(tmp_path / "ckpt.tm")["tensors"]}
    assert dtypes["master/blocks.0.fc.weight"] == "bfloat16"
    assert dtypes["exp_avg/blocks.0.fc.weight"] == dtypes["exp_avg_sq/blocks.0.fc.weight"] == "uint8"
    assert dtypes["exp_avg_absmax/blocks.0.fc.weight"] == "float32"
    assert dtypes["exp_avg/blocks.0.ln.weight"] == "float32"  # below min_8bit_size: fp32 moments
    torch.manual_seed(0)
    (tmp_path / "b").mkdir()
    nvme = {"nvme_dir": str(tmp_path / "b")} if policy == "zero_infinity" else {}
    m = TinyGPT()
    tm = TieredModel(m, POLICIES[policy](), optimizer=make(m.parameters()), precision="bf16", bucket_size=1000, **nvme)
    tm.load(str(tmp_path / "ckpt.tm"))
    for i in range(2, 4):
        x, y = gpt_batch(i)
        tm.backward(gpt_loss(tm(x), y))
        tm.step()
    assert diff(tm.state_dict(), whole) == 0.0
    tm.detach()


def _saved(make, path, precision: str = "fp32", steps: int = 2) -> None:
    tm_out: list = []
    tiered(make, precision=precision, steps=steps, tm_out=tm_out)
    tm_out[0].save(str(path))
    tm_out[0].detach()


def _resumed(make, path, precision: str = "fp32") -> dict:
    torch.manual_seed(0)
    m = TinyGPT()
    tm = TieredModel(m, optimizer=make(m.parameters()), precision=precision, bucket_size=4000)
    tm.load(str(path))
    for i in range(2, 4):
        x, y = gpt_batch(i)
        tm.backward(gpt_loss(tm(x), y))
        tm.step()
    out = tm.state_dict()
    tm.detach()
    return out


def test_a_checkpoint_of_one_format_loads_into_another_converted_and_said(tmp_path, caplog):
    fp32 = lambda ps: tiermem.AdamW(ps, lr=1e-2)  # noqa: E731
    eight = lambda ps: tiermem.AdamW8bit(ps, lr=1e-2, min_8bit_size=SMALL_8BIT)  # noqa: E731
    _saved(eight, tmp_path / "8bit.tm")
    # 8-bit -> fp32 -> 8-bit: the moments dequantized, then quantized back to the same codes, so the
    # run resumed from the round trip is the run resumed from the 8-bit checkpoint itself
    m = TinyGPT()
    tm = TieredModel(m, optimizer=fp32(m.parameters()), precision="fp32")
    with caplog.at_level(logging.INFO, logger="tiermem"):
        tm.load(str(tmp_path / "8bit.tm"))
    assert "8-bit moments dequantized to fp32" in caplog.text
    tm.save(str(tmp_path / "fp32.tm"))
    tm.detach()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tiermem"):
        back = _resumed(eight, tmp_path / "fp32.tm")
    assert "fp32 moments quantized to 8 bits" in caplog.text
    assert diff(back, _resumed(eight, tmp_path / "8bit.tm")) == 0.0
    # fp32 moments into an 8-bit run: torch's AdamW whose moments are quantized from the load on
    _saved(fp32, tmp_path / "adam.tm")

    def from_load(moves):
        seen = []

        def after(opt):
            seen.append(1)
            if len(seen) >= 2:  # the load after step 2 quantizes; every 8-bit step after it too
                quantized_moments(opt, bound=len(seen) > 2)

        return torch_loop(lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False), after=after, moves=moves)

    moves: list[float] = []
    ref = from_load(moves)
    assert_rounding_apart(_resumed(eight, tmp_path / "adam.tm"), ref, max(moves))
    # fp32 master weights into bf16 ones (and back) load too
    bf16 = lambda ps: tiermem.AdamW(ps, lr=1e-2, bf16_stochastic_round=True)  # noqa: E731
    _saved(lambda ps: tiermem.AdamW(ps, lr=1e-2), tmp_path / "bf16_fp32master.tm", precision="bf16")
    _resumed(bf16, tmp_path / "bf16_fp32master.tm", precision="bf16")


def test_a_checkpoint_of_another_optimizer_is_refused_with_nothing_loaded(tmp_path):
    _saved(lambda ps: tiermem.SGD(ps, lr=0.05, momentum=0.9), tmp_path / "sgd.tm")
    m = TinyGPT()
    tm = TieredModel(m, optimizer=tiermem.AdamW(m.parameters(), lr=1e-2), precision="fp32")
    before = tm.state_dict()
    with pytest.raises(TierMemError, match=r"tiermem: checkpoint .* does not match this model: missing \['exp_avg"):
        tm.load(str(tmp_path / "sgd.tm"))
    assert diff(tm.state_dict(), before) == 0.0
    tm.detach()


def test_state_bytes_per_parameter_follow_the_format():
    """The host's OPTIM_STATE bytes under ZeroOffload (the report's ledger): what each format keeps
    per parameter (master included; page rounding is a few pages)."""

    def per_param(make, precision="bf16") -> float:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 256, bias=False))
        tm = TieredModel(m, optimizer=make(m.parameters()), precision=precision)
        got = tm.report().class_peak_bytes[(TensorClass.OPTIM_STATE, Tier.HOST)]
        tm.detach()
        return got / (2 * 256 * 256)

    assert 12 <= per_param(lambda ps: tiermem.AdamW(ps)) < 12.2
    assert 4 <= per_param(lambda ps: tiermem.SGD(ps, lr=0.1)) < 4.2
    assert 8 <= per_param(lambda ps: tiermem.SGD(ps, lr=0.1, momentum=0.9)) < 8.2
    assert 8 <= per_param(lambda ps: tiermem.Lion(ps)) < 8.2
    assert 6 + 8 / 256 <= per_param(lambda ps: tiermem.AdamW8bit(ps)) < 6.2  # fp32 master, 1 + 1 B and scales
    assert 4 + 8 / 256 <= per_param(lambda ps: tiermem.AdamW8bit(ps, bf16_stochastic_round=True)) < 4.2
    assert 10 <= per_param(lambda ps: tiermem.AdamW(ps, bf16_stochastic_round=True)) < 10.2


@pytest.mark.parametrize(
    "make, error, match",
    [
        (
            lambda ps: tiermem.AdamW(ps, bf16_stochastic_round=True),
            ConfigError,
            r"tiermem: AdamW\(bf16_stochastic_round=True\) keeps bf16 master weights, which needs precision='bf16'",
        ),
        (
            lambda ps: tiermem.SGD(ps, lr=0.1, bf16_stochastic_round=1),
            ConfigError,
            r"tiermem: SGD.bf16_stochastic_round=1 is invalid: it must be True or False",
        ),
        (lambda ps: tiermem.Lion(ps, betas=(0.9, 1.5)), ConfigError, r"tiermem: Lion.betas=\(0.9, 1.5\) is invalid"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, nesterov=True), ValueError, r"Nesterov momentum requires"),
        (
            lambda ps: tiermem.AdamW8bit(ps, min_8bit_size=0),
            ConfigError,
            r"tiermem: AdamW8bit.min_8bit_size=0 is invalid",
        ),
    ],
)
def test_bad_optimizer_arguments_are_refused_by_name(make, error, match):
    m = TinyGPT()
    with pytest.raises(error, match=match):
        TieredModel(m, optimizer=make(m.parameters()), precision="fp32")


def test_sgd_groups_keep_momentum_on_or_off_together():
    """A momentum buffer exists for every parameter or none: a group turning momentum off while
    another has it is refused up front, and so is a schedule that turns it off mid-run."""
    m = TinyGPT()
    groups = [{"params": list(m.parameters())[:2], "momentum": 0.0}, {"params": list(m.parameters())[2:]}]
    with pytest.raises(ConfigError, match=r"tiermem: SGD: some param groups have momentum 0 and others not"):
        tiermem.SGD(groups, lr=0.1, momentum=0.9)
    tm = TieredModel(m, optimizer=tiermem.SGD(m.parameters(), lr=0.1, momentum=0.9), precision="fp32")
    tm.optimizer.param_groups[0]["momentum"] = 0.0
    x, y = gpt_batch(0)
    tm.backward(gpt_loss(tm(x), y))
    with pytest.raises(ConfigError, match=r"tiermem: a param group's SGD momentum is 0.0 but the optimizer state"):
        tm.step()
    tm.detach()


# -- data parallel: 2 gloo ranks, each its chunk of every bucket's state ----------------------------
def _rank_formats(rank: int, world: int, nvme_dir: str) -> dict:
    """SGD (fp32) and Lion with bf16 stochastic rounding (two bucket sizes: the chunks' edges move
    inside parameters), each rank its own micro-batch per step."""
    out = {}
    runs = {
        "sgd": (lambda ps: tiermem.SGD(ps, lr=0.05, momentum=0.9, nesterov=True), "fp32", 3000, "zero_offload"),
        "lion_sr": (SR_SPECS["lion"], "bf16", 3000, "zero_offload"),
        "lion_sr_small": (SR_SPECS["lion"], "bf16", 1000, "state_on_nvme"),
    }
    for name, (make, precision, bucket_size, policy) in runs.items():
        torch.manual_seed(0)
        m = TinyGPT()
        nvme = {"nvme_dir": nvme_dir} if policy == "state_on_nvme" else {}
        tm = TieredModel(
            m, POLICIES[policy](), optimizer=make(m.parameters()), precision=precision, bucket_size=bucket_size, **nvme
        )
        for i in range(3):
            x, y = gpt_batch(100 * i + rank)
            tm.backward(gpt_loss(tm(x), y))
            tm.step()
        out[name] = {k: v.clone() for k, v in tm.state_dict().items()}
        tm.detach()
    return out


def test_two_ranks_shard_sgd_and_bf16_lion_state_and_train_as_one(tmp_path):
    from ranks import run_ranks

    r0, r1 = run_ranks(_rank_formats, str(tmp_path))
    for name in r0:
        assert diff(r0[name], r1[name]) == 0.0, name  # the ranks agree bit for bit
    assert diff(r0["lion_sr"], r0["lion_sr_small"]) == 0.0  # rounding keys follow the parameter, not the chunk

    def one_process(mean_after: bool) -> dict:
        """Both ranks' micro-batches in one process: each loss halved (accumulation), or the grads
        summed and halved (a mean, as the ranks' reduce-scatter takes it): two correct roundings."""
        torch.manual_seed(0)
        m = TinyGPT()
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True, foreach=False)
        for i in range(3):
            for r in range(2):
                x, y = gpt_batch(100 * i + r)
                (gpt_loss(m(x), y) / (1 if mean_after else 2)).backward()
            if mean_after:
                for p in m.parameters():
                    p.grad /= 2
            opt.step()
            opt.zero_grad()
        return m.state_dict()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank computes (tests/ranks.py): the matmuls' sums in one order
    try:
        halved, mean = one_process(False), one_process(True)
    finally:
        torch.set_num_threads(threads)
    assert diff(r0["sgd"], mean) <= diff(halved, mean), (diff(r0["sgd"], mean), diff(halved, mean))


def test_every_kind_has_one_registry_row_and_an_unknown_kind_is_refused():
    from tiermem.config.kinds import KINDS, Kind
    from tiermem.optim.families import FAMILIES

    assert set(FAMILIES) == set(Kind) and KINDS == tuple(k.value for k in Kind)
    state_format = tiermem.optim.state_format
    assert Kind.ADAM == "adam" and state_format("adamw").kind is Kind.ADAMW
    for call in (lambda: state_format("rmsprop"), lambda: tiermem.optim.state_layout("rmsprop", (3,))):
        with pytest.raises(ConfigError, match=r"^tiermem: state_(format|layout) kind='rmsprop' is unknown"):
            call()
    with pytest.raises(ConfigError, match=r"^tiermem: state_layout kind='generic' has no fixed layout"):
        tiermem.optim.state_layout("generic", (3,))
