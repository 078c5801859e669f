"""policies.Auto (NOTE [How Auto chooses] in tiermem/policies/auto.py): right at the extremes, never a
placement the constructor would refuse, and its prediction beside the measured stages in report().
Profiles are injected (made-up machines), so nothing here measures this machine for long."""

from __future__ import annotations

import logging
import os
import subprocess

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from models import TinyGPT, train_steps

from tiermem import AdamW, Budgets, ConfigError, OutOfTierMemory, TensorClass, TensorInfo, Tier, TieredModel
from tiermem.plan.choose import Evaluator
from tiermem.plan.policy import ModelInfo
from tiermem.plan.profile import Profile
from tiermem.policies import Auto, ZeroOffload
from tiermem.policies.auto import Assigned, AutoChoice, Verdict

GPU = {
    "device": {"accelerator": "a GPU", "h2d_GBps": 25, "d2h_GBps": 25},
    "host": {"copy_GBps": 20},
    "nvme": {"read_GBps": 2, "write_GBps": 1.5},
    "adam": {"tiermem_Gparams_per_s": 1.5, "device_Gparams_per_s": 60},
}
CPU = {
    "device": {"accelerator": None, "h2d_GBps": 20, "d2h_GBps": 20},
    "host": {"copy_GBps": 20},
    "nvme": {"read_GBps": 2, "write_GBps": 1.5},
    "adam": {"tiermem_Gparams_per_s": 1.5},
}
BUCKET = 3000


def _tm(policy, **kw) -> TieredModel:
    torch.manual_seed(0)
    return TieredModel(
        TinyGPT(), policy, optimizer=AdamW(lr=1e-2), precision="bf16", grad_clip=1.0, bucket_size=BUCKET, **kw
    )


def _split(tm: TieredModel) -> tuple[int, int, int]:
    """Parameters whose optimizer state is on the device, the host, NVMe."""
    n = {t: 0 for t in Tier}
    for b in tm.layout.buckets:
        n[b.state_tier] += len(b.slots)
    return n[Tier.DEVICE], n[Tier.HOST], n[Tier.NVME]


def _prefix(names: list[str], d: int) -> Assigned:
    return Assigned(
        f"first {d} on the device",
        Tier.DEVICE,
        {n: Tier.DEVICE if i < d else Tier.HOST for i, n in enumerate(names)},
        {n: Tier.DEVICE if i < d else Tier.HOST for i, n in enumerate(names)},
    )


def _forward_order() -> list[str]:
    seen, names = set(), []
    for name, p in TinyGPT().named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            names.append(name)
    return names


# -- the extremes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("profile", [GPU, CPU], ids=["gpu", "cpu"])
def test_memory_to_spare_puts_everything_on_the_device(profile):
    tm = _tm(Auto(profile=profile))
    assert all(b.state_tier == b.grad_tier == b.param_tier == Tier.DEVICE for b in tm.layout.buckets)
    assert tm.placement.chosen.verdict == "chosen" and "100% device" in tm.placement.chosen.label


@pytest.mark.parametrize("profile", [GPU, CPU], ids=["gpu", "cpu"])
def test_when_16_bytes_per_param_do_not_fit_the_state_splits_with_the_largest_device_share_that_fits(profile):
    names = _forward_order()
    budgets, reserve = Budgets(device=120_000), 0.25  # a quarter of the device left for activations
    fits = []
    for d in range(len(names) + 1):  # what the constructor accepts within the rest, tried one by one
        try:
            _tm(_prefix(names, d), budgets=Budgets(device=int(120_000 * (1 - reserve))))
            fits.append(d)
        except OutOfTierMemory:
            pass
    largest = max(fits)
    assert 0 < largest < len(names), "the budget must split the state for this test to say anything"
    tm = _tm(Auto(profile=profile, device_reserve=reserve), budgets=budgets)
    assert _split(tm) == (largest, len(names) - largest, 0)
    assert all(b.param_tier == Tier.DEVICE for b in tm.layout.buckets)
    device_state = {s.name for b in tm.layout.buckets if b.state_tier == Tier.DEVICE for s in b.slots}
    assert device_state == set(names[:largest]), "the device share is the first parameters forward uses"
    assert train_steps(tm, 2) == train_steps(_tm(ZeroOffload()), 2), "placement never changes the numbers"


def test_a_short_host_sends_the_state_that_does_not_fit_to_nvme(tmp_path):
    def run(policy, **kw):
        torch.manual_seed(0)
        tm = TieredModel(TinyGPT(d=64), policy, optimizer=AdamW(lr=1e-2), precision="bf16", bucket_size=16384, **kw)
        return tm, train_steps(tm, 2)

    tm, losses = run(
        Auto(profile=GPU, device_reserve=0.5), budgets=Budgets(device=300_000, host=800_000), nvme_dir=str(tmp_path)
    )
    d, h, nvme = _split(tm)
    assert nvme > 0 and h > 0, (d, h, nvme)
    ref, ref_losses = run(ZeroOffload())
    assert losses == ref_losses, "placement never changes the numbers"
    assert all(torch.equal(a, b) for a, b in zip(tm.state_dict().values(), ref.state_dict().values()))


def _two_slot_allowance(tm: TieredModel) -> int:
    """The NVMe bytes the planner used to add to the footprint (before NVMe kept one value per
    key): a page's rounding of two slot files per NVMe key."""

    def r(n: int) -> int:
        return (-n) % 4096

    out = 0
    for b in tm.layout.buckets:
        out += 3 * 2 * r(4 * b.numel) if b.state_tier == Tier.NVME else 0
        out += 2 * r(4 * b.numel) if b.grad_tier == Tier.NVME else 0
        out += sum(2 * r(2 * s.numel) for s in b.slots) if b.param_tier == Tier.NVME else 0
    return out


def test_a_disk_budget_at_the_footprint_is_accepted_and_trains(tmp_path):
    """NVMe holds each value once plus the journal (NOTE [Footprint]): Auto judges the disk with the
    constructor's rule and nothing more, so a disk budget of exactly the footprint, which the old
    allowance of two slots per key refused, is accepted, and the layout trains within it (du)."""

    def run(nvme, d):
        torch.manual_seed(0)
        tm = TieredModel(
            TinyGPT(d=64),
            Auto(profile=GPU, device_reserve=0.5),
            optimizer=AdamW(lr=1e-2),
            precision="bf16",
            bucket_size=16384,
            nvme_dir=str(d),
            budgets=Budgets(device=300_000, host=800_000, nvme=nvme),
        )
        return tm

    (tmp_path / "probe").mkdir()
    probe = run("1GiB", tmp_path / "probe")
    need = probe.placement.chosen.evaluation.need[Tier.NVME]
    assert _split(probe)[2] > 0 and need > 0, "the host budget must send state to NVMe"
    assert need + _two_slot_allowance(probe) > need, "the old allowance must have refused this budget"
    probe.detach()
    (tmp_path / "run").mkdir()
    tm = run(need, tmp_path / "run")  # the footprint exactly
    assert tm.placement.chosen.label == probe.placement.chosen.label
    losses = train_steps(tm, 3)
    torch.manual_seed(0)
    assert losses == train_steps(_tm_like(TinyGPT(d=64)), 3), "placement never changes the numbers"
    assert tm.report().peak_bytes[Tier.NVME] <= need
    files = [f for f in os.listdir(tmp_path / "run")]
    du = int(
        subprocess.run(
            ["du", "-s", "--block-size=1", str(tmp_path / "run")], capture_output=True, text=True, check=True
        ).stdout.split()[0]
    )
    # on disk: the budget's payload, and per file at most its 4 KiB header and a page of direct-I/O padding
    assert du <= need + 2 * 4096 * len(files) + 4096, (du, need, len(files))
    tm.detach()


def _tm_like(model) -> TieredModel:
    return TieredModel(model, ZeroOffload(), optimizer=AdamW(lr=1e-2), precision="bf16", bucket_size=16384)


def test_no_placement_that_fits_is_a_clear_error():
    with pytest.raises(
        ConfigError,
        match=r"^tiermem: Auto\(\) found no placement that fits: the closest .* short "
        r"by .*; raise the Budgets",
    ):
        _tm(Auto(profile=GPU), budgets=Budgets(device=20_000, host=30_000))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(device=st.integers(10_000, 250_000), host=st.integers(0, 400_000), nvme=st.booleans(), overlap=st.booleans())
def test_auto_never_chooses_what_the_constructor_refuses(tmp_path_factory, device, host, nvme, overlap):
    """Whatever the budgets, Auto either chooses a placement the constructor builds or says that
    nothing fits; it never hands the constructor one it refuses (it judges with the constructor's
    footprint, page rounding included, and no allowance of its own)."""
    nvme_dir = str(tmp_path_factory.mktemp("nvme")) if nvme else None
    budgets = Budgets(device=device, host=host, nvme="1GiB" if nvme else None)
    try:
        tm = _tm(Auto(profile=GPU, device_reserve=0.0), budgets=budgets, nvme_dir=nvme_dir, overlap_step=overlap)
    except ConfigError as e:
        assert "found no placement that fits" in str(e)
        assert not isinstance(e, OutOfTierMemory)
        return
    assert tm.placement.chosen.evaluation.fits
    tm.detach()  # constructed: every buffer was allocated within its budget


def test_auto_finds_a_fit_whenever_a_builtin_fits():
    """The converse, to the byte: budgets where ZeroOffload fits with nothing to spare on the host
    (what its construction allocates, pages and all), and the device holds the weights only."""
    budgets = Budgets(device=50_000, host=_host_need(ZeroOffload()))
    _tm(ZeroOffload(), budgets=budgets)
    tm = _tm(Auto(profile=GPU, device_reserve=0.0), budgets=budgets)
    assert tm.placement.chosen.evaluation.fits


def _host_need(policy) -> int:
    tm = _tm(policy)
    return tm.report().peak_bytes.get(Tier.HOST, 0)


# -- what it says ---------------------------------------------------------------------------------------------
def test_report_sets_the_prediction_beside_the_measured_stages():
    tm = _tm(Auto(profile=CPU, device_reserve=0.5), budgets=Budgets(device=120_000))
    train_steps(tm, 2)
    rep = tm.report()
    assert set(rep.stages) == {"forward+backward", "grads home", "norm, Adam, weights up"}
    predicted, measured = rep.stages["forward+backward"]
    assert predicted == measured > 0  # the prediction is fed the measured compute
    assert all(p >= 0 and m >= 0 for p, m in rep.stages.values())
    text = str(rep)
    assert "predicted" in text and "Auto(chose" in text


def test_every_rejected_alternative_says_why():
    tm = _tm(Auto(profile=GPU), budgets=Budgets(device=60_000))
    choices = tm.placement.choices
    assert choices[0].verdict == "chosen" and choices[0].outcome is Verdict.CHOSEN
    assert len(choices) > 2
    assert all(
        c.verdict.startswith(("slower: ", "as fast within 1%", "does not fit: ", "refused: ")) for c in choices[1:]
    )
    assert {c.outcome for c in choices[1:]} <= {Verdict.SLOWER, Verdict.AS_FAST, Verdict.DOES_NOT_FIT, Verdict.REFUSED}
    assert all(c.verdict == f"{c.outcome.value}: {c.why}" for c in choices[1:])  # the words follow the outcome
    assert any(c.outcome is Verdict.DOES_NOT_FIT and c.why.startswith("device") for c in choices[1:])


def test_binding_returns_a_choice_and_leaves_auto_as_it_was():
    auto = Auto(profile=GPU)
    before = dict(vars(auto))
    tm = _tm(auto)
    assert isinstance(tm.placement, AutoChoice) and tm.placement.profile is GPU
    assert vars(auto) == before and repr(auto) == "Auto()"
    assert tm.placement.for_model(ModelInfo(())) is tm.placement  # binding a bound policy gives it back


def test_the_judge_keeps_nothing_a_search_asked_it():
    """Evaluator.predict answers from the policy it is given (Auto's choice keeps the profile it was
    chosen with), never from whichever profile the last search passed it."""
    evaluator = Evaluator(
        TinyGPT(),
        AdamW(),
        torch.bfloat16,
        BUCKET,
        limits={Tier.DEVICE: 10**9, Tier.HOST: 10**9},
        machine=lambda: Profile(CPU),
    )
    evaluator.rates()  # this machine's figures: CPU's
    zero = evaluator.bind(ZeroOffload())
    before = evaluator.predict(zero, 0.1)
    choice = evaluator.bind(Auto(profile=GPU))  # a search with another machine's figures
    assert evaluator.predict(zero, 0.1) == before
    assert evaluator.predict(choice, 0.1) == dict(evaluator(choice.chosen.policy, GPU, 0.1).stages)
    assert evaluator.predict(choice, 0.1) != dict(evaluator(choice.chosen.policy, CPU, 0.1).stages)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(forward_backward=-1.0), "Auto.forward_backward=-1.0 is invalid"),
        (dict(forward_backward=True), "Auto.forward_backward=True is invalid"),
        (dict(device_reserve=1.0), "Auto.device_reserve=1.0 is invalid"),
        (dict(device_reserve=-0.5), "Auto.device_reserve=-0.5 is invalid"),
        (dict(profile="profile.json"), "Auto.profile='profile.json' is invalid: pass a machine profile"),
    ],
)
def test_bad_arguments_are_refused(kw, match):
    with pytest.raises(ConfigError, match="^tiermem: " + match):
        Auto(**kw)


def test_auto_needs_the_whole_model_and_a_planner():
    info = TensorInfo("w", TensorClass.GRAD, 40, (10,), torch.float32)
    with pytest.raises(ConfigError, match="for_model"):
        Auto().place(info)
    assert Auto().place(TensorInfo("m", TensorClass.ACTIVATION, 40, (10,), torch.float32)) == Tier.DEVICE
    with pytest.raises(ConfigError, match="needs the planner"):
        Auto().for_model(ModelInfo((info,)))


def test_without_a_profile_the_machine_is_measured_once_and_saved(tmp_path, monkeypatch, caplog):
    from tiermem.model import machine

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(machine, "_BYTES", 2**20)  # a test must not spend long measuring
    monkeypatch.setattr(machine, "_ADAM_PARAMS", 2**14)
    with caplog.at_level(logging.WARNING, logger="tiermem.model.machine"):
        tm = _tm(Auto())
    assert "measuring this machine once" in caplog.text
    assert (tmp_path / "cache" / "tiermem" / "profile.json").is_file()
    assert tm.placement.chosen is not None
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tiermem.model.machine"):
        _tm(Auto())
    assert "measuring" not in caplog.text  # the saved profile is used from then on


def test_report_without_a_usable_profile_leaves_the_stages_out(tmp_path, monkeypatch):
    """A saved profile that lacks a figure (an older bench's) makes report() say nothing of the
    stages; it never fails a report."""
    from tiermem.plan import profile

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    profile.save_profile(
        {"schema": profile.SCHEMA, "device": {"accelerator": "a GPU"}, "host": {}, "nvme": {}, "adam": {}}
    )
    tm = _tm(ZeroOffload())
    train_steps(tm, 1)
    assert tm.report().stages == {}
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "none"))
    tm = _tm(ZeroOffload())
    train_steps(tm, 1)
    assert tm.report().stages == {}  # no profile, and ZeroOffload needed none: nothing is measured for it
