"""Adafactor inside TieredModel (NOTE [State formats]: factored parts, one kernel call per parameter
with its shape). Oracle: torch.optim.Adafactor in a plain for-loop, to rounding (NOTE [Arithmetic
tolerances] in tests/tolerance.py); under every policy, fp32 and bf16 (bit-identical
across policies), checkpoints, the state's true bytes, and data parallelism refused clearly."""

from __future__ import annotations

import functools

import pytest
import torch
from models import TinyGPT, gpt_batch, gpt_loss
from test_optim_formats import POLICIES, assert_rounding_apart, diff, oracle, tiered, torch_loop

import tiermem
from tiermem import ConfigError, TensorClass, Tier, TieredModel
from tiermem.optim.formats import state_format

HYPER = dict(lr=0.05, weight_decay=0.1, beta2_decay=-0.7, eps=(None, 1e-3), d=1.0)


def torch_adafactor(ps, **v):
    return torch.optim.Adafactor(ps, **HYPER, **v)


@functools.cache
def reference(maximize: bool = False) -> tuple[dict, float]:
    """torch's for-loop Adafactor and its largest step."""
    return oracle(lambda ps: torch_adafactor(ps, maximize=maximize, foreach=False))


@pytest.mark.numerics
@pytest.mark.parametrize("policy", list(POLICIES))
def test_torch_adafactor_given_as_optimizer_matches_torch_on_every_tier(policy, tmp_path):
    ref, step = reference()
    got = tiered(lambda ps: torch_adafactor(ps), policy=policy, tmp_path=tmp_path)
    assert_rounding_apart(got, ref, step)
    assert diff(got, torch_loop(lambda ps: torch.optim.SGD(ps, lr=0.0))) > 1e-3  # it trained


@pytest.mark.numerics
def test_tiermem_adafactor_spec_with_groups_and_maximize_matches_torch():
    """The spec takes torch's groups (per-group lr and weight decay), and maximize."""

    def groups(ps):
        ps = list(ps)
        return [{"params": ps[:3], "lr": 0.02, "weight_decay": 0.0}, {"params": ps[3:]}]

    want, step = oracle(lambda ps: torch.optim.Adafactor(groups(ps), **HYPER, maximize=True, foreach=False))
    got = tiered(lambda ps: tiermem.Adafactor(groups(ps), **HYPER, maximize=True), bucket_size=1000)
    assert_rounding_apart(got, want, step)
    assert diff(got, reference(False)[0]) > 1e-3  # other groups, maximize: another run


SPECS = {
    "fp32_master": lambda ps: tiermem.Adafactor(ps, lr=0.05, weight_decay=0.1),
    "bf16_master": lambda ps: tiermem.Adafactor(ps, lr=0.05, weight_decay=0.1, bf16_stochastic_round=True),
}


@pytest.mark.parametrize("kind", list(SPECS))
def test_adafactor_bf16_is_bit_identical_across_policies_and_bucket_sizes(kind, tmp_path):
    base = tiered(SPECS[kind], precision="bf16")
    assert diff(base, torch_loop(lambda ps: torch.optim.SGD(ps, lr=0.0))) > 1e-3
    for policy, bucket_size in (
        ("keep_on_device", 4000),
        ("zero_offload", 100_000),
        ("zero_infinity", 1000),
        ("state_on_nvme", 4000),
    ):
        got = tiered(SPECS[kind], precision="bf16", policy=policy, bucket_size=bucket_size, tmp_path=tmp_path)
        assert diff(got, base) == 0.0, (policy, bucket_size)


@pytest.mark.parametrize("policy", ["zero_offload", "state_on_nvme"])
def test_adafactor_checkpoint_resumes_bit_exact_and_keeps_the_factors(policy, tmp_path):
    make = SPECS["fp32_master"]
    whole = tiered(make, steps=4)
    tm_out: list = []
    (tmp_path / "a").mkdir()
    tiered(make, steps=2, policy=policy, tmp_path=tmp_path / "a", tm_out=tm_out)
    tm_out[0].save(str(tmp_path / "ckpt.tm"))
    tm_out[0].detach()
    torch.manual_seed(0)
    (tmp_path / "b").mkdir()
    nvme = {"nvme_dir": str(tmp_path / "b")} if policy == "state_on_nvme" else {}
    m = TinyGPT()
    tm = TieredModel(m, POLICIES[policy](), optimizer=make(m.parameters()), precision="fp32", bucket_size=1000, **nvme)
    tm.load(str(tmp_path / "ckpt.tm"))
    # the hyperparameters come back as given (eps a pair with None in it)
    assert tm.optimizer.param_groups[0]["eps"] == (None, 1e-3)
    for i in range(2, 4):
        x, y = gpt_batch(i)
        tm.backward(gpt_loss(tm(x), y))
        tm.step()
    assert diff(tm.state_dict(), whole) == 0.0
    # a fresh state (no load) would not resume: the factors were kept
    fresh = tiered(make, steps=2, start=2)
    assert diff(fresh, whole) > 1e-4
    tm.detach()


def test_adafactor_state_has_its_true_bytes_on_every_tier(tmp_path):
    """A matrix of r x c keeps r + c fp32 factors beside its master (Adam: 2 r c moments); the
    report's ledger counts the bytes on whichever tier the policy puts the state."""
    r, c = 256, 512
    fmt = state_format("adafactor")
    assert fmt.nbytes(r * c, (r, c)) == 4 * r * c + 4 * (r + c)
    assert fmt.nbytes(c, (c,)) == 4 * c + 4 * c  # a vector: the full variance
    assert fmt.nbytes(2 * r * c, (2, r, c)) == 4 * 2 * r * c + 4 * 2 * (r + c)  # leading dims: a batch of matrices

    def per_param(policy: str, tier: Tier) -> float:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(c, r, bias=False), torch.nn.Linear(r, c, bias=False))
        nvme = {"nvme_dir": str(tmp_path)} if policy == "state_on_nvme" else {}
        tm = TieredModel(m, POLICIES[policy](), optimizer=tiermem.Adafactor(m.parameters()), precision="fp32", **nvme)
        got = tm.report().class_peak_bytes[(TensorClass.OPTIM_STATE, tier)]
        tm.detach()
        return got / (2 * r * c)

    exact = 4 + 4 * (r + c) / (r * c)  # master + factors
    for policy, tier in (("zero_offload", Tier.HOST), ("keep_on_device", Tier.DEVICE), ("state_on_nvme", Tier.NVME)):
        got = per_param(policy, tier)
        assert exact <= got < exact + 0.1, (policy, got)  # page rounding only; Adam would be 12


def test_adafactor_bad_arguments_are_refused_by_name():
    m = TinyGPT()
    with pytest.raises(ConfigError, match=r"tiermem: Adafactor.eps=\(None, -1.0\) is invalid: it must be a pair"):
        tiermem.Adafactor(m.parameters(), eps=(None, -1.0))
    with pytest.raises(ConfigError, match=r"tiermem: Adafactor.d=0.5 is invalid: it must be a finite number >= 1"):
        tiermem.Adafactor(m.parameters(), d=0.5)
    with pytest.raises(ConfigError, match=r"tiermem: Adafactor.params\[0\].beta2_decay=0.5 is invalid"):
        tiermem.Adafactor([{"params": list(m.parameters()), "beta2_decay": 0.5}])


def _rank_adafactor(rank: int, world: int) -> str:
    m = TinyGPT()
    try:
        TieredModel(m, optimizer=tiermem.Adafactor(m.parameters()), precision="fp32")
    except ConfigError as e:
        return str(e)
    return "built"


def test_two_ranks_refuse_factored_state_and_say_what_to_change():
    from ranks import run_ranks

    for said in run_ranks(_rank_adafactor):
        assert said.startswith(
            "tiermem: under data parallelism this version shards elementwise and block-wise 8-bit optimizer state only"
        )
        assert "['adafactor'] keeps factored state" in said
        assert "pass process_group=False" in said
