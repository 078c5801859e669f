"""``TieredModel(torch.compile(model), ...)``: a compiled model trains under every policy.

Oracles: the same compiled model under ZeroOffload (placement never changes the numbers: bit for
bit on this CPU-only machine), and plain PyTorch (the compiled model trained with
``torch.optim.AdamW``; the uncompiled model, for the policy whose weights live off the device,
where the forward runs eagerly: NOTE [Parameters off the device]).

Compiling is slow on two cores: each model is compiled a few times at most (inductor caches the
kernels on disk, so a second run of this file is quicker). The whole file, measured on this
machine while three other jobs ran: ~120 s with an empty inductor cache (half of it the two
tests marked slow, a fifth tiermem's own Adam kernel, compiled once per cache), ~30 s warm.
"""

from __future__ import annotations

import collections
import inspect
import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from configs: never a download
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch
import transformers
from models import TinyGPT, gpt_batch, gpt_loss, same_state
from tolerance import assert_adam_within, second_moments
from torch import nn
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
from torch.nn import functional as F

from tiermem import AdamW, Policy, TensorClass, Tier, TieredModel
from tiermem.policies import ActivationOffload, Auto, KeepOnDevice, ZeroInfinity, ZeroOffload
from tiermem.train.activations import ActivationOffloader
from tiermem.train.weights.offdevice import OffDeviceWeight

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

ACT = TensorClass.ACTIVATION
LR, WD = 1e-2, 0.1


class _ByModule(Policy):
    """Offloads the activations of the modules under ``prefix``: a policy that needs the module."""

    def __init__(self, prefix: str):
        self.prefix, self.asked = prefix, collections.Counter()

    def place(self, info):
        if info.kind is ACT:
            self.asked[info.module] += 1
            if info.module.startswith(self.prefix):
                return Tier.HOST
        return ZeroOffload().place(info)


def _policies(tmp_path) -> dict[str, dict]:
    return {
        "zero-offload": {"policy": ZeroOffload()},
        "keep-on-device": {"policy": KeepOnDevice()},
        "activation-offload": {"policy": ActivationOffload(ZeroOffload(), min_bytes=0)},
        "activation-offload-nvme": {
            "policy": ActivationOffload(KeepOnDevice(), tier=Tier.NVME, min_bytes=0),
            "nvme_dir": str(tmp_path),
        },
        "by-module": {"policy": _ByModule("_orig_mod")},
        "zero-infinity": {"policy": ZeroInfinity(), "nvme_dir": str(tmp_path)},
    }


def _plain(sd: dict) -> dict:
    return {k.removeprefix("_orig_mod."): v for k, v in sd.items()}


# -- the hooks a policy needs ------------------------------------------------------------------
_PROFILE = {
    "device": {"accelerator": None, "h2d_GBps": 20, "d2h_GBps": 20},
    "host": {"copy_GBps": 20},
    "nvme": {"read_GBps": 2, "write_GBps": 1.5},
    "adam": {"tiermem_Gparams_per_s": 1.5},
}


class _Custom(Policy):
    def place(self, info):
        return ZeroOffload().place(info)


@pytest.mark.parametrize(
    "policy, by_module",
    [
        (ZeroOffload(), False),
        (KeepOnDevice(), False),
        (ZeroInfinity(), False),
        (ActivationOffload(ZeroOffload(), min_bytes=0), False),
        (ActivationOffload(_Custom()), True),
        (_Custom(), True),
        (ZeroOffload(device_fraction=0.5), False),
        (Auto(profile=_PROFILE), False),
    ],
)
def test_module_hooks_only_for_a_policy_that_places_activations_by_module(policy, by_module, tmp_path):
    assert policy.places_activations_by_module() is by_module
    model = TinyGPT()
    tm = TieredModel(model, policy, nvme_dir=str(tmp_path))
    weights_off = {
        m
        for m in model.modules()
        if isinstance(policy, ZeroInfinity) and any(True for _ in m.parameters(recurse=False))
    }  # ParamOffload's hooks
    for m in model.modules():
        hooked = bool(m._forward_pre_hooks) or bool(m._forward_hooks)
        assert hooked is (by_module or m in weights_off), type(m).__name__
    x, y = gpt_batch(0, batch=8)
    tm.backward(gpt_loss(tm(x), y))  # activations are still accounted, hooks or not
    assert tm.activations.stats.saved > 0 and tm.report().class_peak_bytes[(ACT, Tier.DEVICE)] > 0
    tm.step()
    tm.detach()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


# -- a plain torch model ------------------------------------------------------------------------
def _train_gpt(module, steps: int = 3, **kw):
    tm = TieredModel(module, optimizer=AdamW(lr=LR, weight_decay=WD), bucket_size=2000, **kw)
    losses = []
    for i in range(steps):
        x, y = gpt_batch(i, batch=8)
        loss = gpt_loss(tm(x), y)
        tm.backward(loss)
        tm.step()
        losses.append(loss.item())
    sd = _plain(tm.state_dict())
    return losses, sd, tm


@pytest.fixture(scope="module")
def compiled_zero_offload():
    """The reference run, shared: TinyGPT compiled, bf16, under ZeroOffload."""
    torch.manual_seed(0)
    losses, sd, tm = _train_gpt(torch.compile(TinyGPT()), policy=ZeroOffload())
    tm.detach()
    return losses, sd


@pytest.mark.parametrize("setup", ["keep-on-device", "activation-offload", "activation-offload-nvme", "by-module"])
def test_compiled_model_trains_bit_identically_under_every_policy(setup, compiled_zero_offload, tmp_path):
    kw = _policies(tmp_path)[setup]
    torch.manual_seed(0)
    model = torch.compile(TinyGPT())
    losses, sd, tm = _train_gpt(model, **kw)
    assert losses == compiled_zero_offload[0]
    assert same_state(sd, compiled_zero_offload[1])
    if setup.startswith("activation-offload"):
        assert sum(tm.activations.stats.offloaded.values()) > 0  # the compiled graph's saved tensors left
    if setup == "by-module":  # a compiled region saves its activations under the compiled module's name
        assert set(kw["policy"].asked) == {"_orig_mod"} and tm.activations.stats.offloaded[Tier.HOST] > 0
    tm.detach()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def _blocks_compiled_in_place() -> nn.Module:
    model = TinyGPT()
    for block in model.blocks:
        block.compile()
    return model


@pytest.mark.parametrize(
    "make, overlap",
    [
        (lambda: torch.compile(TinyGPT()), False),
        (_blocks_compiled_in_place, False),
        (lambda: torch.compile(TinyGPT()), True),
    ],
    ids=["torch.compile(model)", "block.compile()", "overlap_step"],
)
def test_compiled_model_under_zero_infinity_runs_eagerly_with_the_uncompiled_numbers(make, overlap, tmp_path, caplog):
    torch.manual_seed(0)
    eager = _train_gpt(TinyGPT(), policy=ZeroOffload(), overlap_step=overlap)
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="tiermem.model.build"):
        compiled = _train_gpt(make(), **_policies(tmp_path)["zero-infinity"], overlap_step=overlap)
    assert "forward runs eagerly" in caplog.text
    assert compiled[0] == eager[0] and same_state(compiled[1], eager[1])
    # dynamo compiled no code of tiermem's own callbacks (NOTE [Callbacks dynamo must not trace])
    for fn in (inspect.unwrap(OffDeviceWeight.__torch_dispatch__.__func__), ActivationOffloader._pack):
        assert _debug_get_cache_entry_list(fn.__code__) == [], fn.__qualname__
    compiled[2].detach()
    eager[2].detach()


class _ReadsAnotherModulesWeight(nn.Module):
    """The root's own forward reads the embedding's weight (a head written as ``F.linear``)."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(37, 24)
        self.ln = nn.LayerNorm(24)

    def forward(self, idx):
        return F.linear(self.ln(self.wte(idx)), self.wte.weight)


def test_compiled_model_reading_an_off_device_weight_outside_its_module(tmp_path):
    """Traced, the watch on the forward's ops would have been compiled away, and the graph would
    have computed with the NaN placeholder."""
    runs = {}
    for name, compiled, policy in (("eager", False, ZeroOffload()), ("zero-infinity", True, ZeroInfinity())):
        torch.manual_seed(0)
        model = _ReadsAnotherModulesWeight()
        tm = TieredModel(
            torch.compile(model) if compiled else model,
            policy,
            precision="fp32",
            nvme_dir=str(tmp_path),
            optimizer=AdamW(lr=LR),
        )
        for i in range(2):
            x, _ = gpt_batch(i)
            loss = tm(x).logsumexp(-1).mean()
            assert torch.isfinite(loss)
            tm.backward(loss)
            assert not tm.step().skipped
        runs[name] = _plain(tm.state_dict())
        tm.detach()
    assert same_state(runs["eager"], runs["zero-infinity"])


@pytest.mark.slow  # ~17 s with an empty inductor cache on this 2-core machine (a fp32 compile), <1 s warm
def test_compiled_model_agrees_with_torch_adamw_in_fp32():
    """fp32: the compiled model trained by tiermem and by ``torch.optim.AdamW``'s for-loop kernel, to
    rounding (NOTE [Arithmetic tolerances] in tests/tolerance.py). One module, compiled once,
    restarted from the same weights for each run."""
    torch.manual_seed(0)
    model = TinyGPT()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    for i in range(3):
        x, y = gpt_batch(i, batch=8)
        gpt_loss(compiled(x), y).backward()
        opt.step()
        opt.zero_grad()
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    exp_avg_sq = second_moments(model, opt)
    model.load_state_dict(init)
    _, ours, tm = _train_gpt(compiled, policy=ZeroOffload(), precision="fp32")
    tm.detach()
    assert_adam_within(ours, ref, exp_avg_sq, lr=LR, steps=3, eps=1e-8, weight_decay=WD)


# -- a transformers model -----------------------------------------------------------------------
def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.slow  # ~10 s with a warm inductor cache, 27-45 s cold, on this loaded 2-core machine
def test_compiled_transformers_model_trains_under_every_policy(tmp_path):
    """Tiny GPT-2 from a config (never downloaded), compiled: the same bits under ZeroOffload and
    with its activations offloaded (KeepOnDevice reads weights and keeps activations as
    ZeroOffload does); under ZeroInfinity, whose forward runs eagerly, the bits of the uncompiled
    model."""

    def run(setup: str, compiled: bool):
        torch.manual_seed(0)
        model = torch.compile(_gpt2()) if compiled else _gpt2()
        tm = TieredModel(model, optimizer=AdamW(lr=LR), **_policies(tmp_path / setup)[setup])
        losses = []
        for i in range(2):
            ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(i))
            out = tm(input_ids=ids, labels=ids)
            tm.backward(out.loss)
            assert not tm.step().skipped
            losses.append(out.loss.item())
        state, offloaded = _plain(tm.state_dict()), sum(tm.activations.stats.offloaded.values())
        tm.detach()
        return losses, state, offloaded

    (tmp_path / "zero-infinity").mkdir()
    ref = run("zero-offload", compiled=True)
    assert ref[0][1] < ref[0][0]  # it learns
    offloaded = run("activation-offload", compiled=True)
    assert offloaded[2] > 0 and offloaded[0] == ref[0] and same_state(offloaded[1], ref[1])
    eager = run("zero-offload", compiled=False)
    infinity = run("zero-infinity", compiled=True)
    assert infinity[0] == eager[0] and same_state(infinity[1], eager[1])
