"""tiermem.plan.sizing: bytes per tensor class and per tier, checked against real tensors' nbytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tiermem.config import specs as config
from tiermem.errors import ConfigError
from tiermem.plan import sizing
from tiermem.plan.sizing import Limits, StateBytes
from tiermem.types import TensorClass, TensorInfo, Tier

DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def real_state(model: torch.nn.Module, precision: str) -> StateBytes:
    """The oracle: the tensors a mixed-precision Adam step keeps, made for real, and their nbytes.
    Frozen parameters get a working copy only."""
    sums = dict(params=0, grads=0, master=0, momentum=0, variance=0)
    for p in model.parameters():
        work = p.detach().to(DTYPE[precision])
        sums["params"] += work.nbytes
        if not p.requires_grad:
            continue
        master = p.detach().float().clone()
        sums["grads"] += torch.zeros_like(work).nbytes  # autograd's grad has the weights' dtype
        sums["master"] += master.nbytes
        sums["momentum"] += torch.zeros_like(master).nbytes
        sums["variance"] += torch.zeros_like(master).nbytes
    return StateBytes(**sums)


class Tied(torch.nn.Module):
    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.mid = torch.nn.Linear(dim, dim)
        self.frozen = torch.nn.Linear(dim, 3).requires_grad_(False)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied: counted once


def test_worked_example_of_design_md():
    s = sizing.state_bytes(7_500_000_000, "bf16")
    assert s == StateBytes(
        params=15 * 10**9, grads=15 * 10**9, master=30 * 10**9, momentum=30 * 10**9, variance=30 * 10**9
    )
    assert s.total == 120 * 10**9
    zero = sizing.tier_bytes(7_500_000_000, "bf16", sizing.placement_of("ZeroOffload"))
    assert zero[Tier.DEVICE] == 15 * 10**9


@pytest.mark.parametrize("precision", sizing.PRECISIONS)
def test_state_bytes_match_real_tensors(precision):
    model = Tied(vocab=37, dim=11)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert sizing.state_bytes(trainable, precision, frozen=frozen) == real_state(model, precision)


@settings(max_examples=60, deadline=None)
@given(
    trainable=st.integers(0, 10**13),
    frozen=st.integers(0, 10**12),
    precision=st.sampled_from(sizing.PRECISIONS),
    policy=st.sampled_from(list(sizing.BUILTIN_PLACEMENTS)),
)
def test_tiers_hold_every_part_once_with_grads_sized_at_their_home(trainable, frozen, precision, policy):
    placement = sizing.placement_of(policy)
    state = sizing.state_bytes(trainable, precision, frozen=frozen)
    tiers = sizing.tier_bytes(trainable, precision, placement, frozen=frozen)
    grad_home = placement[TensorClass.GRAD]
    grad_elem = torch.float32.itemsize  # accumulated in fp32 at home, whatever the tier
    # every tier holds exactly the parts whose class the policy homes there, once (NVMe included)
    for tier in Tier:
        expect = sum(
            b for part, b in state.as_dict().items() if part != "grads" and placement[sizing.PART_CLASS[part]] is tier
        )
        expect += grad_elem * trainable if grad_home is tier else 0
        assert tiers[tier] == expect


@pytest.mark.parametrize(
    "policy, device, host, nvme",
    [
        # bytes per trainable parameter in mixed precision; grads accumulate in fp32 (4 B) at home;
        # NVMe holds each value once (a failed step is rolled forward): 14 B/param for ZeroInfinity
        ("ZeroOffload", 2, 4 + 12, 0),
        ("KeepOnDevice", 2 + 4 + 12, 0, 0),
        ("ZeroInfinity", 0, 4, 2 + 12),
    ],
)
def test_builtin_policies_per_param(policy, device, host, nvme):
    n = 1_000_003
    got = sizing.tier_bytes(n, "fp16", sizing.placement_of(policy))
    assert got == {Tier.DEVICE: device * n, Tier.HOST: host * n, Tier.NVME: nvme * n}


def test_builtin_placements_are_the_documented_ones():
    """DESIGN.md: ZeRO-Offload keeps PARAM and ACTIVATION on the device, GRAD and OPTIM_STATE on
    the host; ZeRO-Infinity puts PARAM and OPTIM_STATE on NVMe and GRAD on the host."""
    P, G, O, A = TensorClass.PARAM, TensorClass.GRAD, TensorClass.OPTIM_STATE, TensorClass.ACTIVATION  # noqa: E741 - the classes by initial
    D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME
    documented = {
        "ZeroOffload": {P: D, A: D, G: H, O: H},
        "KeepOnDevice": {P: D, A: D, G: D, O: D},
        "ZeroInfinity": {P: N, O: N, G: H, A: D},
    }
    assert {k: dict(v) for k, v in sizing.BUILTIN_PLACEMENTS.items()} == documented
    import tiermem.policies as builtins

    for name, homes in documented.items():
        policy = getattr(builtins, name)()
        for kind, tier in homes.items():
            info = TensorInfo(
                name="blocks.0.fc.weight",
                kind=kind,
                nbytes=4096,
                shape=(32, 32),
                dtype=torch.float32,
                module="blocks.0.fc",
            )
            assert policy.place(info) is tier, (name, kind)


@pytest.mark.parametrize(
    "need, limits, fits, short, headroom",
    [
        ((10, 20, 30), Limits(10, 20, 30), True, {}, 0),
        ((11, 20, 30), Limits(10, 20, 30), False, {Tier.DEVICE: 1}, -1),
        ((1, 25, 31), Limits(10, 20, 30), False, {Tier.HOST: 5, Tier.NVME: 1}, 9),
        # no accelerator: device and host share RAM, and the device may use all of it
        ((10, 20, 0), Limits(40, 40, 0, device_shares_host=True), True, {}, 10),
        ((30, 20, 0), Limits(40, 40, 0, device_shares_host=True), False, {Tier.HOST: 10}, -10),
        # ... or a device budget below the RAM: both limits apply
        ((30, 5, 0), Limits(25, 40, 0, device_shares_host=True), False, {Tier.DEVICE: 5}, -5),
    ],
)
def test_check_fit(need, limits, fits, short, headroom):
    got = sizing.check_fit(dict(zip(Tier, need)), limits)
    assert (got.fits, got.short, got.device_headroom) == (fits, short, headroom)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: sizing.bytes_per_param("fp8"), r"^tiermem: precision='fp8' is not one of bf16, fp16, fp32"),
        (lambda: sizing.state_bytes(-1, "bf16"), r"^tiermem: trainable=-1 is not a parameter count"),
        (lambda: sizing.state_bytes(True, "bf16"), r"^tiermem: trainable=True is not a parameter count"),
        (lambda: sizing.state_bytes(10, "bf16", frozen=1.5), r"^tiermem: frozen=1.5 is not a parameter count"),
        (lambda: sizing.placement_of("ZeRO3"), r"^tiermem: no built-in policy named 'ZeRO3'; pick one of"),
        (lambda: sizing.policies(["KeepOnDevice", "nope"]), r"^tiermem: no built-in policy named 'nope'"),
    ],
)
def test_errors(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


def test_precisions_are_the_configs():
    """One list of precisions (tiermem.config.specs); plan's bytes per element are its dtypes' sizes."""
    assert sizing.PRECISIONS == tuple(config.PRECISIONS)
    for precision, dtype in config.PRECISIONS.items():
        assert sizing.bytes_per_param(precision).params == dtype.itemsize == DTYPE[precision].itemsize


def test_sizing_does_not_import_the_policies():
    """The plan layer reads the built-in placements when asked, not at import (policies build on tiermem)."""
    import subprocess
    import sys

    code = (
        "import sys, tiermem.plan.sizing as s; assert 'tiermem.policies' not in sys.modules; "
        "assert 'ZeroOffload' in s.BUILTIN_PLACEMENTS and 'tiermem.policies' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_bf16_master_beside_its_weights_off_the_device_is_counted_once():
    """NOTE [One copy of bf16 master weights]: what ``tiermem plan`` prints for 8-bit moments and a
    bf16 master with the weights off the device beside the state: the master once (4.03 B/param of
    weights and state, not 6.03); a fp32 master stays a copy of its own, and so does a bf16 one
    whose weights are on the device."""
    n = 8 * 10**9
    moments = 2 * (n + 4 * n // 256)  # two 8-bit moments, each with a fp32 scale per 256
    one_copy = sizing.state_option("8-bit + bf16 master", n, "bf16")
    fp32_master = sizing.state_option("8-bit", n, "bf16")

    def placed(param: Tier, state: Tier) -> dict:
        return {
            TensorClass.PARAM: param,
            TensorClass.OPTIM_STATE: state,
            TensorClass.GRAD: Tier.HOST,
            TensorClass.ACTIVATION: Tier.DEVICE,
        }

    assert sizing.tier_bytes(n, "bf16", placed(Tier.NVME, Tier.NVME), state=one_copy)[Tier.NVME] == 2 * n + moments
    assert sizing.tier_bytes(n, "bf16", placed(Tier.NVME, Tier.NVME), state=fp32_master)[Tier.NVME] == 6 * n + moments
    host = sizing.tier_bytes(n, "bf16", placed(Tier.HOST, Tier.HOST), state=one_copy)
    assert host[Tier.HOST] == 4 * n + 2 * n + moments  # fp32 grads, the master (the weights), the moments
    apart = sizing.tier_bytes(n, "bf16", placed(Tier.DEVICE, Tier.HOST), state=one_copy)
    assert (apart[Tier.DEVICE], apart[Tier.HOST]) == (2 * n, 4 * n + 2 * n + moments)
