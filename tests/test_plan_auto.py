"""``tiermem plan --policy auto`` (tiermem/cli/plan_auto.py): Auto's choice for a parameter count,
with a made-up GPU machine's profile saved where the planner looks for it."""

from __future__ import annotations

import json

import pytest
import torch
from models import TinyGPT, train_steps

from tiermem import Budgets, OutOfTierMemory, Tier, TieredModel
from tiermem.cli import main
from tiermem.plan import profile
from tiermem.policies import Auto

GPU = {
    "schema": profile.SCHEMA,
    "device": {"accelerator": "a GPU", "h2d_GBps": 25, "d2h_GBps": 25},
    "host": {"copy_GBps": 20},
    "nvme": {"read_GBps": 2, "write_GBps": 1.5},
    "adam": {"tiermem_Gparams_per_s": 1.5, "device_Gparams_per_s": 60},
}


@pytest.fixture(autouse=True)
def gpu_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    profile.save_profile(GPU)


def _auto(capsys, *caps: str) -> dict:
    assert main(["plan", "--params", "7.5e9", "--precision", "bf16", "--policy", "auto", *caps, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["auto"]


def test_memory_to_spare_puts_everything_on_the_device(capsys):
    out = _auto(capsys, "--device-mem", "1TB", "--host-mem", "1TB", "--nvme-free", "0")
    chosen = out["choices"][0]
    assert chosen["verdict"] == "chosen" and "100% device" in chosen["placement"] and "host" not in chosen["placement"]
    assert chosen["bytes"]["host"] == 0


def test_an_80gb_device_gets_the_largest_share_of_the_state_that_fits(capsys):
    out = _auto(capsys, "--device-mem", "80GB", "--host-mem", "1TB", "--nvme-free", "0")
    chosen, rest = out["choices"][0], out["choices"][1:]
    assert "weights on device" in chosen["placement"] and "device (" in chosen["placement"]
    assert "host (" in chosen["placement"] and "NVMe" not in chosen["placement"]
    # the bytes the device would hold stay within 90% of 80 GB (device_reserve), and any candidate
    # with more on the device was refused for that reason
    assert chosen["bytes"]["device"] <= 0.9 * 80e9
    more = [c for c in rest if c["bytes"].get("device", 0) > chosen["bytes"]["device"]]
    assert more and all(c["verdict"].startswith("does not fit: ") for c in more)
    assert all(c["verdict"] != "chosen" for c in rest)
    # the predicted stages add up to the step
    assert sum(chosen["predicted_s"].values()) == pytest.approx(chosen["step_s"])


def test_a_short_host_sends_state_to_nvme(capsys):
    out = _auto(capsys, "--device-mem", "24GB", "--host-mem", "64GB", "--nvme-free", "4TB")
    chosen = out["choices"][0]["placement"]
    assert "NVMe" in chosen and "weights on device" in chosen


def test_the_printed_plan_says_what_was_chosen_and_why_the_others_were_not(capsys):
    assert (
        main(
            [
                "plan",
                "--params",
                "1.5B",
                "--policy",
                "auto",
                "--device-mem",
                "16GB",
                "--host-mem",
                "1TB",
                "--nvme-free",
                "0",
                "--forward-backward",
                "0.5",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "chose:" in text and "predicted step" in text and "rejected (" in text
    assert "does not fit: " in text and "forward+backward 500.0 ms" in text


def test_nothing_fits_is_a_one_line_error(capsys):
    assert (
        main(
            [
                "plan",
                "--params",
                "7.5e9",
                "--policy",
                "auto",
                "--device-mem",
                "1GB",
                "--host-mem",
                "1GB",
                "--nvme-free",
                "0",
            ]
        )
        != 0
    )
    err = capsys.readouterr().err
    assert "tiermem: Auto() found no placement that fits" in err


def test_the_printed_bytes_are_what_the_constructor_checks(capsys, tmp_path):
    """`tiermem plan --model ... --policy auto` prints, for its choice, the bytes the constructor
    checks, page rounding of host buffers included: the same choice and bytes as TieredModel's
    Auto, and a budget of those bytes on the host builds and trains while one byte less is refused.
    (The disk's rule, through Auto: tests/test_auto.py; a model of one 32 MiB bucket gains nothing
    from NVMe, whose pipeline takes three buckets of the host.)"""
    device, host = 60_000, 200_000
    assert (
        main(
            [
                "plan",
                "--model",
                "models:TinyGPT",
                "--policy",
                "auto",
                "--device-mem",
                str(device),
                "--host-mem",
                str(host),
                "--nvme-free",
                "1GiB",
                "--json",
            ]
        )
        == 0
    )
    auto = json.loads(capsys.readouterr().out)["auto"]
    chosen = auto["choices"][0]
    printed = {Tier(t): n for t, n in chosen["bytes"].items()}
    assert printed[Tier.DEVICE] > 20_000 and printed[Tier.HOST] > 0, "the budgets must split the state"
    tm = TieredModel(
        TinyGPT(),
        Auto(),
        budgets=Budgets(device=device, host=host, nvme="1GiB"),
        nvme_dir=str(tmp_path),
        precision="auto",
    )  # the plan's precision without --precision
    assert (tm.placement.chosen.label, dict(tm.placement.chosen.evaluation.need)) == (chosen["placement"], printed)
    same = (
        "buckets",
        "trainable_params",
        "homes",
        "footprint",
    )  # the plan the model was built from (NOTE [Plan, then build])
    assert {k: auto["plan"][k] for k in same} == {k: tm.model_plan.summary()[k] for k in same}
    policy = tm.placement.chosen.policy
    tm.detach()

    def build(**short):
        budgets = {t.value: printed[t] - short.get(t.value, 0) for t in (Tier.HOST, Tier.NVME)}
        d = tmp_path / f"nvme-{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        # the device: room for this batch's activations beside the choice (what device_reserve is for)
        return TieredModel(
            TinyGPT(), policy, budgets=Budgets(device=10 * device, **budgets), nvme_dir=str(d), precision="auto"
        )

    for tier in [t.value for t in (Tier.HOST, Tier.NVME) if printed[t]]:
        with pytest.raises(OutOfTierMemory, match=rf"^tiermem: out of {tier} memory"):
            build(**{tier: 1})
    assert len(train_steps(build(), 2)) == 2


def test_tokens_predict_the_compute_at_the_matmul_rate_of_the_precision(capsys, monkeypatch):
    """``--tokens`` (Auto(tokens_per_step=...)): forward and backward predicted as 6 FLOPs per parameter
    and token at the profile's matmul rate of the precision planned for, one CPU thread's figure
    times torch's threads; and --precision auto plans for this machine's precision."""
    from tiermem.config.specs import CpuFeatures
    from tiermem.model import compute

    monkeypatch.setattr(CpuFeatures, "detect", classmethod(lambda cls: CpuFeatures("AVX2", False, False)))
    monkeypatch.setattr(compute, "_sections", {})
    cpu = {
        **GPU,
        "device": {"accelerator": None, "h2d_GBps": 20, "d2h_GBps": 20},
        "matmul": {
            "conditions": compute.conditions(torch.device("cpu")),
            "cpu_shape": [1, 1, 1],
            "cpu_fp32_GFLOPs": 60.0,
            "cpu_bf16_GFLOPs": 6.0,
            "cpu_fp16_GFLOPs": 5.0,
        },
    }
    profile.save_profile(cpu)
    fb = {}
    for precision in ("fp32", "bf16", "auto"):
        assert (
            main(
                [
                    "plan",
                    "--params",
                    "1e8",
                    "--precision",
                    precision,
                    "--policy",
                    "auto",
                    "--tokens",
                    "4096",
                    "--device-mem",
                    "1TB",
                    "--host-mem",
                    "1TB",
                    "--nvme-free",
                    "0",
                    "--json",
                ]
            )
            == 0
        )
        out = json.loads(capsys.readouterr().out)["auto"]
        fb[precision] = out["choices"][0]["predicted_s"]["forward+backward"]
        assert out["tokens_per_step"] == 4096
    assert out["precision"] == "fp32"  # auto on a CPU without fast bf16
    threads = torch.get_num_threads()
    assert fb["fp32"] == pytest.approx(6 * 1e8 * 4096 / (60e9 * threads)) == fb["auto"]
    assert fb["bf16"] == pytest.approx(10 * fb["fp32"])
    assert (
        main(
            [
                "plan",
                "--params",
                "1e8",
                "--policy",
                "auto",
                "--tokens",
                "4096",
                "--device-mem",
                "1TB",
                "--host-mem",
                "1TB",
                "--nvme-free",
                "0",
            ]
        )
        == 0
    )
    assert "predicted for 4,096 tokens at the fp32 matmul rate" in capsys.readouterr().out
