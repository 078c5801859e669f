"""The numbers do not move: 20 steps of the examples' GPT under every built-in policy and
precision, hashed tensor by tensor and compared with hashes recorded before the architecture
was reworked (``tests/golden/hashes.json``).

Bit-exact float results depend on the CPU's kernels (AMX, AVX-512 and AVX2 round matmuls
differently), so the record is keyed by a fingerprint of this machine's arithmetic: plain torch
forward and backward of the same model, hashed. On a machine whose fingerprint was never
recorded the comparison with the record cannot be made; every run still checks that all
policies agree bit for bit with each other, which needs no record.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for examples.gpt

from examples.gpt import GPT, GPTConfig, lm_loss
from tiermem import AdamW, PerClass, TensorClass, Tier, TieredModel
from tiermem.policies import ActivationOffload, KeepOnDevice, ZeroInfinity, ZeroOffload

RECORD = Path(__file__).with_name("golden") / "hashes.json"
STEPS = 20
PRECISIONS = ("bf16", "fp16", "fp32")


class GradsOnNvme(PerClass):
    homes = {
        TensorClass.PARAM: Tier.DEVICE,
        TensorClass.ACTIVATION: Tier.DEVICE,
        TensorClass.GRAD: Tier.NVME,
        TensorClass.OPTIM_STATE: Tier.HOST,
    }


def setups(nvme_dir: str) -> dict[str, dict]:
    """Every built-in policy, plus the paths a policy alone does not reach (grads on NVMe,
    activations on NVMe, the one-step delayed update)."""
    return {
        "zero-offload": {"policy": ZeroOffload()},
        "keep-on-device": {"policy": KeepOnDevice()},
        "zero-infinity": {"policy": ZeroInfinity(), "nvme_dir": nvme_dir},
        "activation-offload-host": {"policy": ActivationOffload(ZeroOffload(), min_bytes=0)},
        "activation-offload-nvme": {
            "policy": ActivationOffload(ZeroOffload(), tier=Tier.NVME, min_bytes=0),
            "nvme_dir": nvme_dir,
        },
        "grads-on-nvme": {"policy": GradsOnNvme(), "nvme_dir": nvme_dir},
        "overlap-step": {"policy": ZeroOffload(), "overlap_step": True},
    }


def _cfg() -> GPTConfig:
    return GPTConfig.preset("tiny", vocab_size=41, block_size=16)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        idx = torch.randint(0, 41, (4, 17), generator=g)
        out.append((idx[:, :-1], idx[:, 1:]))
    return out


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[
        :16
    ]


def fingerprint() -> str:
    """This machine's float arithmetic: plain torch forward + backward of the same model."""
    torch.manual_seed(0)
    model = GPT(_cfg())
    x, y = _batches(1)[0]
    h = hashlib.sha256()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        model.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = lm_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            h.update(_digest(p.grad).encode())
    return h.hexdigest()[:16]


def train(setup: dict, precision: str, device: str = "cpu") -> dict[str, str]:
    torch.manual_seed(0)
    model = GPT(_cfg())
    tm = TieredModel(
        model,
        optimizer=AdamW(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1),
        precision=precision,
        grad_clip=1.0,
        bucket_size="64KiB",
        device=device,
        **setup,
    )
    batches = [(x.to(device), y.to(device)) for x, y in _batches(STEPS)]
    for i, (x, y) in enumerate(batches):
        for _ in range(2 if i % 5 == 0 else 1):  # some steps accumulate two micro-batches
            tm.backward(lm_loss(tm(x), y) / (2 if i % 5 == 0 else 1))
        tm.step()
    state = tm.state_dict()
    tm.detach()
    return {k: _digest(v) for k, v in sorted(state.items())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, str]]:
    out = {}
    for name, setup in setups(str(tmp_path_factory.mktemp("golden"))).items():
        for precision in PRECISIONS:
            out[f"{name}/{precision}"] = train(setup, precision)
    return out


def test_policies_agree_bit_for_bit(runs):
    for precision in PRECISIONS:
        ref = runs[f"zero-offload/{precision}"]
        for name in setups("-"):
            if name != "overlap-step":  # the delayed update computes other numbers by design
                assert runs[f"{name}/{precision}"] == ref, f"{name}/{precision} differs from zero-offload"
    assert runs["overlap-step/bf16"] != runs["zero-offload/bf16"]  # a delayed update is not a plain one


@pytest.mark.cuda
def test_policies_agree_bit_for_bit_on_cuda(tmp_path):
    """On a GPU every policy whose step runs on the CPU agrees bit for bit with ZeRO-Offload
    (KeepOnDevice steps on the GPU: it agrees to rounding, see test_cuda.py)."""
    names = [n for n in setups("-") if n not in ("keep-on-device", "overlap-step")]
    for precision in PRECISIONS:
        got = {
            name: train(setup, precision, "cuda")
            for name, setup in setups(str(tmp_path)).items()
            if name in names or name == "overlap-step"
        }
        for name in names:
            assert got[name] == got["zero-offload"], f"{name}/{precision} on cuda differs from zero-offload"
        assert got["overlap-step"] != got["zero-offload"]


def test_numbers_match_the_record(runs):
    record = json.loads(RECORD.read_text())
    fp = fingerprint()
    if fp not in record:
        pytest.skip(
            f"no hashes recorded for this CPU's arithmetic (fingerprint {fp}; recorded: "
            f"{sorted(record)}); run `python tests/test_golden.py --record` on the code before a change"
        )
    expected = record[fp]
    assert sorted(expected) == sorted(runs)
    for key, hashes in expected.items():
        assert runs[key] == hashes, f"{key}: the state after {STEPS} steps moved"


if __name__ == "__main__" and "--record" in sys.argv:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        got = {f"{n}/{p}": train(s, p) for n, s in setups(d).items() for p in PRECISIONS}
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    record[fingerprint()] = got
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(got)} runs under fingerprint {fingerprint()}")
