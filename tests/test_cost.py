"""The cost model (NOTE [Cost model] in tiermem/plan/cost.py): each stage's arithmetic on made-up
buckets and rates, checked against figures worked out by hand."""

from __future__ import annotations

import pytest
import torch

from tiermem import ConfigError
from tiermem.optim.formats import state_format
from tiermem.plan.buckets import Bucket
from tiermem.plan.cost import Rates, predict
from tiermem.plan.profile import Profile
from tiermem.types import Tier

G = 1e9
RATES = Rates(
    h2d=10 * G,
    d2h=20 * G,
    host_copy=40 * G,
    nvme_read=2 * G,
    nvme_write=1 * G,
    cpu_adam=1 * G,
    device_adam=50 * G,
    device_is_cpu=False,
)


def _b(i: int, numel: int, state: Tier, grad: Tier = None, param: Tier = Tier.DEVICE) -> Bucket:
    return Bucket(
        i,
        grad_tier=grad or (Tier.HOST if state == Tier.NVME else state),
        state_tier=state,
        group=0,
        param_tier=param,
        numel=numel,
    )


def test_zero_offload_stages_by_hand():
    buckets = [_b(0, 10**9, Tier.HOST), _b(1, 10**9, Tier.HOST)]
    s = predict(buckets, 2, RATES, forward_backward=0.3).stages
    assert s["forward+backward"] == 0.3
    # grads: 2 GB each at 20 GB/s = 0.1 s each, 0.2 s behind 0.2 s of backward: the last trip shows
    assert s["grads home"] == pytest.approx(0.1)
    assert s["grads to Adam"] == 0
    assert s["grad norm"] == pytest.approx(8e9 / 40e9)
    assert s["optimizer"] == pytest.approx(2.0)  # 2e9 params at 1 Gparam/s
    assert s["weights up"] == pytest.approx(0.2)  # hidden behind Adam but the last bucket's 2 GB at 10 GB/s


def test_a_device_share_runs_beside_the_cpu_on_an_accelerator_and_after_it_on_a_cpu():
    buckets = [_b(0, 10**9, Tier.HOST), _b(1, 10**9, Tier.DEVICE)]
    on_gpu = predict(buckets, 2, RATES).stages
    assert on_gpu["optimizer"] == pytest.approx(max(1.0, 1e9 / 50e9))
    assert on_gpu["grad norm"] == pytest.approx(4e9 / 40e9)  # the device's grads are read on the device
    cpu = Rates(**{**RATES.__dict__, "device_adam": 1 * G, "device_is_cpu": True})
    assert predict(buckets, 2, cpu).stages["optimizer"] == pytest.approx(2.0)
    all_device = predict([_b(0, 2 * 10**9, Tier.DEVICE)], 2, RATES).stages
    assert all_device["grads home"] == all_device["weights up"] == 0
    assert all_device["optimizer"] == pytest.approx(2e9 / 50e9)


def test_a_cpu_devices_grads_go_home_inside_backward_and_weights_are_written_in_place():
    """NOTE [A CPU device]: the copies home are backward's own work (in a prediction of the
    compute from FLOPs; a measured compute holds them), only an NVMe write behind them is exposed,
    and the host's Adam writes the weights where the parameters read them."""
    cpu = Rates(**{**RATES.__dict__, "device_is_cpu": True, "matmul": {"bf16": 5 * G}})
    buckets = [_b(0, 10**9, Tier.HOST), _b(1, 10**9, Tier.HOST)]
    measured = predict(buckets, 2, cpu, forward_backward=0.3).stages
    assert measured["forward+backward"] == 0.3 and measured["grads home"] == 0 and measured["weights up"] == 0
    from_flops = predict(buckets, 2, cpu, flops=30 * G, precision="bf16").stages
    assert from_flops["forward+backward"] == pytest.approx(6.0 + 2 * 2e9 / 20e9)  # and the copies, 0.1 s each
    grads_on_nvme = [_b(i, 10**9, Tier.NVME, grad=Tier.NVME) for i in range(2)]
    on_nvme = predict(grads_on_nvme, 2, cpu, forward_backward=0.3).stages
    # two 4 GB writes at 1 GB/s behind 0.2 s of backward: 8 - 0.2 s exposed
    assert on_nvme["grads home"] == pytest.approx(8.0 - 0.2)


def test_state_on_nvme_streams_at_the_slowest_of_read_adam_and_write():
    s = predict([_b(0, 10**9, Tier.NVME)], 2, RATES).stages
    assert s["optimizer"] == pytest.approx(12e9 / 1e9)  # the write: 12 GB at 1 GB/s, past Adam's 1 s
    weights_too = predict([_b(0, 10**9, Tier.NVME, param=Tier.NVME)], 2, RATES, forward_backward=1.0).stages
    assert weights_too["optimizer"] == pytest.approx(14e9 / 1e9)  # the new weights are written too
    # weights read twice (forward, backward): 2 x (2 GB at 2 GB/s + 2 GB at 10 GB/s) = 2.4 s > 1 s of compute
    assert weights_too["forward+backward"] == pytest.approx(2.4)
    assert weights_too["weights up"] == 0  # off-device weights are not uploaded by the step


def test_a_bf16_master_that_is_the_weights_is_written_once():
    """NOTE [One copy of bf16 master weights]: 8-bit moments and a bf16 master on NVMe beside NVMe
    weights: the step writes the state's 4.03 B/param (the master being the weights), not 6.03;
    on the host, no weights go up; with overlap_step or under data parallelism, two copies."""
    sr = state_format("adamw8bit", master_dtype=torch.bfloat16, numel=10**9, min_8bit_size=1)
    nvme = Bucket(0, Tier.HOST, Tier.NVME, 0, param_tier=Tier.NVME, numel=10**9, state=sr)
    joined = nvme.joined_bytes()
    assert predict([nvme], 2, RATES).stages["optimizer"] == pytest.approx(joined / 1e9)
    for apart in ({"overlap": True}, {"world": 2}, {"world": 2, "shard_weights": True}):
        assert predict([nvme], 2, RATES, **apart).stages["optimizer"] == pytest.approx((joined + 2e9) / 1e9)
    # sharding is the placement's (weights_sharded): one rank's weights are never sharded, whatever shard_weights says
    assert predict([nvme], 2, RATES, shard_weights=True).stages["optimizer"] == pytest.approx(joined / 1e9)
    host = Bucket(0, Tier.HOST, Tier.HOST, 0, param_tier=Tier.HOST, numel=10**9, state=sr)
    assert predict([host], 2, RATES).stages["weights up"] == 0
    assert predict([host], 2, RATES, overlap=True).stages["weights up"] == pytest.approx(2e9 / 40e9)


def test_grads_on_another_memory_tier_are_copied_to_adam_first():
    s = predict([_b(0, 10**9, Tier.HOST, grad=Tier.DEVICE)], 2, RATES).stages
    assert s["grads to Adam"] == pytest.approx(4e9 / 20e9)


def test_rates_from_a_profile_and_what_is_missing():
    data = {
        "device": {"accelerator": None, "h2d_GBps": 5, "d2h_GBps": 6},
        "host": {"copy_GBps": 7},
        "nvme": {"read_GBps": 2, "write_GBps": 1},
        "adam": {"tiermem_Gparams_per_s": 1.5},
    }
    r = Rates.from_profile(Profile(data))
    assert (r.h2d, r.d2h, r.host_copy, r.nvme_read, r.nvme_write) == (5e9, 6e9, 7e9, 2e9, 1e9)
    assert r.device_is_cpu and r.cpu_adam == r.device_adam == 1.5e9  # no accelerator: the same kernel
    gpu = {**data, "device": {**data["device"], "accelerator": "H100"}}
    with pytest.raises(ConfigError, match=r"^tiermem: the machine profile lacks adam.device_Gparams_per_s; run"):
        Rates.from_profile(Profile(gpu))
    with pytest.raises(ConfigError, match="lacks nvme.read_GBps"):
        Rates.from_profile(Profile({**data, "nvme": {"write_GBps": 1}}))


def test_a_prediction_beside_a_measured_step_groups_what_step_runs():
    from tiermem.plan.cost import against_measured

    predicted = {
        "forward+backward": 1.0,
        "grads home": 0.1,
        "grads to Adam": 0.0,
        "grad norm": 0.2,
        "optimizer": 0.5,
        "weights up": 0.05,
    }
    pairs = against_measured(predicted, forward_backward=1.2, grads_home=0.3, step=1.0)
    assert pairs == {
        "forward+backward": (1.0, 1.2),
        "grads home": (0.1, 0.3),
        "norm, Adam, weights up": (pytest.approx(0.75), pytest.approx(0.7)),
    }


def test_unmeasured_compute_is_predicted_at_the_matmul_rate_of_the_precision_in_use():
    from tiermem.plan.cost import step_flops

    assert step_flops(10**6, 2 * 10**5, 1000) == 1000 * (6e6 + 4 * 2e5)
    rates = Rates(**{**RATES.__dict__, "matmul": {"fp32": 50 * G, "bf16": 5 * G}})
    buckets = [_b(0, 10**9, Tier.HOST), _b(1, 10**9, Tier.HOST)]
    fp32 = predict(buckets, 4, rates, flops=30 * G, precision="fp32").stages
    bf16 = predict(buckets, 2, rates, flops=30 * G, precision="bf16").stages
    assert fp32["forward+backward"] == pytest.approx(0.6) and bf16["forward+backward"] == pytest.approx(6.0)
    # the grads' trips (4 GB and 2 GB a bucket at 20 GB/s) hide behind two thirds of that compute,
    # all but the last bucket's
    assert fp32["grads home"] == pytest.approx(0.2) and bf16["grads home"] == pytest.approx(0.1)
    measured = predict(buckets, 2, rates, forward_backward=0.3, flops=30 * G, precision="bf16").stages
    assert measured["forward+backward"] == 0.3  # a measured compute wins over the prediction
    assert predict(buckets, 2, rates).stages["forward+backward"] == 0  # neither: not counted
    with pytest.raises(
        ConfigError,
        match=r"^tiermem: the machine profile has no fp16 matmul figure .* run "
        r"`tiermem bench`",
    ):
        predict(buckets, 2, rates, flops=30 * G, precision="fp16")


def test_the_matmul_rates_are_the_devices_and_a_cpus_scale_with_its_threads(monkeypatch):
    import torch

    data = {
        "device": {"accelerator": None, "h2d_GBps": 5, "d2h_GBps": 6},
        "host": {"copy_GBps": 7},
        "nvme": {"read_GBps": 2, "write_GBps": 1},
        "adam": {"tiermem_Gparams_per_s": 1.5},
        "matmul": {"cpu_fp32_GFLOPs": 40, "cpu_bf16_GFLOPs": 4, "device_bf16_GFLOPs": 900},
    }
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert Rates.from_profile(Profile(data)).matmul == {"fp32": 120e9, "bf16": 12e9}  # one thread's, times 3
    gpu = {
        **data,
        "device": {**data["device"], "accelerator": "H100"},
        "adam": {**data["adam"], "device_Gparams_per_s": 50},
    }
    assert Rates.from_profile(Profile(gpu)).matmul == {"bf16": 900e9}  # forward and backward run there
