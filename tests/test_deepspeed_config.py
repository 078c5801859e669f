"""tiermem.from_deepspeed_config: DeepSpeed configs shaped like DeepSpeed's documented ZeRO-Offload
(stage 2, optimizer state on the CPU) and ZeRO-Infinity (stage 3, weights and optimizer state on
NVMe) examples give the TieredModel they describe, train exactly as that TieredModel built by
hand, and say one line per key not honoured; bad configs get one-line tiermem: errors."""

from __future__ import annotations

import copy
import json
import logging
import re

import pytest
import torch
import torch.nn.functional as F
from models import TinyGPT

import tiermem
from tiermem import Adam, AdamW, ConfigError, LossScale, TensorClass, Tier, TieredModel
from tiermem.integrations.deepspeed.walk import OffloadPolicy, translate
from tiermem.policies import KeepOnDevice, ZeroInfinity, ZeroOffload

# As in DeepSpeed's ZeRO-Offload tutorial and the HF Trainer's ds_config_zero2.json ("auto": the
# Trainer fills them from TrainingArguments).
ZERO_OFFLOAD = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
# As in DeepSpeed's config documentation for ZeRO-Infinity (offload_param / offload_optimizer to NVMe).
ZERO_INFINITY = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "NVME",
            "pin_memory": True,
            "buffer_count": 4,
            "fast_init": False,
        },
        "offload_param": {
            "device": "nvme",
            "nvme_path": "NVME",
            "pin_memory": True,
            "buffer_count": 5,
            "buffer_size": 1e8,
            "max_in_cpu": 1e9,
        },
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False, "overlap_events": True},
}
OFFLOAD_IGNORED = {
    "scheduler",
    "zero_optimization.allgather_partitions",
    "zero_optimization.allgather_bucket_size",
    "zero_optimization.overlap_comm",
    "zero_optimization.reduce_scatter",
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.contiguous_gradients",
    "fp16.hysteresis",
    "steps_per_print",
    "wall_clock_breakdown",
}
INFINITY_IGNORED = {
    "zero_optimization.stage",
    "zero_optimization.offload_optimizer.buffer_count",
    "zero_optimization.offload_optimizer.fast_init",
    "zero_optimization.offload_param.buffer_count",
    "zero_optimization.offload_param.buffer_size",
    "zero_optimization.offload_param.max_in_cpu",
    "zero_optimization.overlap_comm",
    "zero_optimization.contiguous_gradients",
    "zero_optimization.sub_group_size",
    "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "aio",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
}
FILLS = dict(
    lr=1e-3,
    betas=(0.9, 0.999),
    eps=1e-8,
    weight_decay=0.01,
    precision="fp16",
    grad_clip=1.0,
    train_batch_size=16,
    train_micro_batch_size_per_gpu=4,
    gradient_accumulation_steps=4,
)
NOTE = re.compile(r"^tiermem: DeepSpeed config (\S+)=.* not honoured: .+$")


def infinity(path) -> dict:
    cfg = copy.deepcopy(ZERO_INFINITY)
    for block in ("offload_optimizer", "offload_param"):
        cfg["zero_optimization"][block]["nvme_path"] = str(path)
    return cfg


def noted(notes: list[str]) -> set[str]:
    keys = [NOTE.match(line)[1] for line in notes]
    assert len(keys) == len(set(keys)), notes  # one line per key
    return set(keys)


def test_zero_offload_example(tmp_path):
    options, notes = translate(ZERO_OFFLOAD, **FILLS)
    assert isinstance(options["policy"], ZeroOffload) and options["nvme_dir"] is None
    assert options["precision"] == "fp16" and options["grad_clip"] == 1.0
    assert options["loss_scale"] == LossScale(init_scale=2.0**16, growth_interval=1000, min_scale=1)
    assert options["optimizer"] == AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    assert noted(notes) == OFFLOAD_IGNORED
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ZERO_OFFLOAD))
    from_file, notes_from_file = translate(str(path), **FILLS)  # a file reads as the dict
    assert notes_from_file == notes and repr(from_file) == repr(options)


def test_zero_infinity_example(tmp_path):
    options, notes = translate(infinity(tmp_path))
    assert isinstance(options["policy"], ZeroInfinity) and options["nvme_dir"] == str(tmp_path)
    assert options["precision"] == "bf16" and options["grad_clip"] == 1.0 and "loss_scale" not in options
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false
    assert options["optimizer"] == AdamW(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    assert noted(notes) == INFINITY_IGNORED


def _train(tm: TieredModel, steps: int = 3) -> list[float]:
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 37, (3, 11), generator=g)
        for _ in range(2):  # gradient accumulation
            loss = F.cross_entropy(tm(idx).float().flatten(0, 1), idx.flatten())
            tm.backward(loss)
            losses.append(loss.item())
        tm.step()
    return losses


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


@pytest.mark.parametrize("example", ["zero-offload", "zero-infinity"])
def test_trains_as_the_tiered_model_it_describes(tmp_path, caplog, example):
    if example == "zero-offload":  # bf16 here: fp16 matmuls are slow on CPUs
        cfg, fills = ZERO_OFFLOAD, {**FILLS, "precision": "bf16"}
        by_hand = dict(
            policy=ZeroOffload(), optimizer=AdamW(lr=1e-3, weight_decay=0.01), precision="bf16", grad_clip=1.0
        )
    else:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        cfg, fills = infinity(tmp_path / "a"), {}
        by_hand = dict(
            policy=ZeroInfinity(),
            nvme_dir=str(tmp_path / "b"),
            precision="bf16",
            grad_clip=1.0,
            optimizer=AdamW(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1),
        )
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        tm = tiermem.from_deepspeed_config(_model(), cfg, **fills)
    lines = [r.getMessage() for r in caplog.records if r.name == "tiermem.integrations.deepspeed.walk"]
    # (the fp16 block is off when bf16 is asked for: its hysteresis does not matter then)
    assert noted(lines) == (OFFLOAD_IGNORED - {"fp16.hysteresis"} if example == "zero-offload" else INFINITY_IGNORED)
    ref = TieredModel(_model(), **by_hand)
    assert _train(tm) == _train(ref)
    got, want = tm.state_dict(), ref.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_other_offload_pairs_and_adam_modes():
    cfg = {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "nvme", "nvme_path": "/x"},
        },
        "optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "lr": 1e-4}},
    }
    options, notes = translate(cfg)
    assert isinstance(options["policy"], OffloadPolicy)
    homes = {
        k: options["policy"].place(tiermem.TensorInfo(name="w", kind=k, nbytes=4, shape=(1,), dtype=torch.float32))
        for k in TensorClass
    }
    assert homes == {
        TensorClass.PARAM: Tier.HOST,
        TensorClass.OPTIM_STATE: Tier.NVME,
        TensorClass.GRAD: Tier.HOST,
        TensorClass.ACTIVATION: Tier.DEVICE,
    }
    assert type(options["optimizer"]) is Adam and options["optimizer"].weight_decay == 0.0  # DeepSpeed's default
    assert options["precision"] == "fp32" and options["grad_clip"] is None
    assert noted(notes) == {"zero_optimization.stage"}
    options, notes = translate({})  # nothing: DeepSpeed's defaults, everything on the device
    assert isinstance(options["policy"], KeepOnDevice) and notes == []
    assert options["optimizer"] == AdamW(lr=1e-3, weight_decay=0.0)


def test_keywords_fill_auto_and_must_agree():
    options, _ = translate({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}, lr=3e-4, budgets=tiermem.Budgets())
    assert options["optimizer"].lr == 3e-4 and isinstance(options["budgets"], tiermem.Budgets)
    options, _ = translate({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}}}, betas=[0.9, 0.95])
    assert options["optimizer"].betas == (0.9, 0.95)  # a list and a tuple agree
    options, _ = translate({"gradient_clipping": 0}, grad_clip=None)
    assert options["grad_clip"] is None
    options, _ = translate({}, precision="bf16", grad_clip=2.0, nvme_dir="/d")  # absent keys: the keyword applies
    assert (options["precision"], options["grad_clip"], options["nvme_dir"]) == ("bf16", 2.0, "/d")


BAD = {
    "device gpu": (
        {"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
        r"offload_optimizer\.device=\"gpu\" is invalid: it must be \"none\", \"cpu\" or \"nvme\"",
    ),
    "typo in zero block": (
        {"zero_optimization": {"stage": 2, "offload_optimiser": {"device": "cpu"}}},
        r"zero_optimization\.offload_optimiser is not a ZeRO setting",
    ),
    "typo in offload block": (
        {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_mem": True}}},
        r"offload_optimizer\.pin_mem is not a DeepSpeed offload setting",
    ),
    "bf16 and fp16": ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, r"enables both bf16 and fp16"),
    "enabled yes": ({"bf16": {"enabled": "yes"}}, r"bf16\.enabled=\"yes\" is not true, false or 'auto'"),
    "lamb": ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, r"optimizer\.type=\"Lamb\" is not supported"),
    "amsgrad": ({"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}}, r"with amsgrad"),
    "AdamW without w mode": (
        {"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}},
        r"adam_w_mode=false with type 'AdamW'",
    ),
    "lr a string": (
        {"optimizer": {"type": "AdamW", "params": {"lr": "0.1"}}},
        r"optimizer block: AdamW\.lr='0\.1' is invalid",
    ),
    "param offload at stage 2": (
        {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
        r"offloads parameters \(offload_param\) at stage 2",
    ),
    "stage 4": ({"zero_optimization": {"stage": 4}}, r"zero_optimization\.stage=4 is invalid"),
    "two nvme paths": (
        {
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": "/a"},
                "offload_optimizer": {"device": "nvme", "nvme_path": "/b"},
            }
        },
        r"gives two NVMe paths",
    ),
    "deprecated cpu_offload beside offload_optimizer": (
        {"zero_optimization": {"stage": 2, "cpu_offload": False, "offload_optimizer": {"device": "cpu"}}},
        r"both zero_optimization\.cpu_offload \(deprecated\) and offload_optimizer, which DeepSpeed refuses too",
    ),
    "deprecated cpu_offload not a bool": (
        {"zero_optimization": {"stage": 2, "cpu_offload": "cpu"}},
        r"zero_optimization\.cpu_offload=\"cpu\" is invalid: it must be true or false",
    ),
    "deprecated cpu_offload_param at stage 2": (
        {"zero_optimization": {"stage": 2, "cpu_offload_param": True}},
        r"offloads parameters \(offload_param\) at stage 2",
    ),
    "static loss scale": ({"fp16": {"enabled": True, "loss_scale": 128}}, r"fp16\.loss_scale=128 \(a static loss"),
    "scale power": ({"fp16": {"enabled": True, "initial_scale_power": -1}}, r"initial_scale_power=-1 is invalid"),
    "window zero": ({"fp16": {"enabled": True, "loss_scale_window": 0}}, r"fp16 block .*growth_interval=0 is invalid"),
    "negative clipping": ({"gradient_clipping": -1.0}, r"gradient_clipping=-1\.0 is invalid"),
    "auto without keyword": (
        {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
        r"optimizer\.params\.lr='auto' needs a value: pass lr=\.\.\.",
    ),
    "auto precision without keyword": ({"bf16": {"enabled": "auto"}}, r"bf16\.enabled='auto' needs a value"),
    "not an object": ({"zero_optimization": [1]}, r"zero_optimization=\[1\] is not an object"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_configs(case):
    cfg, match = BAD[case]
    with pytest.raises(ConfigError, match="^tiermem: .*" + match):
        translate(cfg)


def test_bad_calls(tmp_path):
    cases = [
        (lambda: translate({}, policy=ZeroOffload()), r"unexpected keyword arguments \['policy'\]"),
        (
            lambda: translate({"gradient_clipping": 1.0}, grad_clip=2.0),
            r"gradient_clipping=1\.0 but grad_clip=2\.0 was given; make them agree",
        ),
        (
            lambda: translate({"bf16": {"enabled": True}}, precision="fp32"),
            r"enables bf16 but precision='fp32' was given",
        ),
        (
            lambda: translate({"fp16": {"enabled": False}}, precision="fp16"),
            r"has fp16\.enabled=false but precision='fp16' was given",
        ),
        (lambda: translate([1, 2]), r"needs a path to a DeepSpeed JSON file or a dict, got list"),
        (lambda: translate(str(tmp_path / "missing.json")), r"cannot read the DeepSpeed config .*missing\.json"),
    ]
    (tmp_path / "broken.json").write_text('{"fp16": {"enabled": true,}}')
    cases.append((lambda: translate(str(tmp_path / "broken.json")), r"is not valid JSON \(line 1, column 27"))
    for call, match in cases:
        with pytest.raises(ConfigError, match="^tiermem: .*" + match):
            call()


def test_loss_scale_window_and_floor_are_honoured():
    torch.manual_seed(0)
    tm = TieredModel(
        torch.nn.Linear(4, 4), precision="fp16", loss_scale=LossScale(init_scale=8.0, growth_interval=2, min_scale=4.0)
    )
    x = torch.ones(2, 4)
    scales = []
    for blow_up in (True, True, False, False, False):
        loss = tm(x).float().sum() * (float("inf") if blow_up else 1.0)
        tm.backward(loss)
        scales.append(tm.step().loss_scale)
    assert scales == [4.0, 4.0, 4.0, 8.0, 8.0]  # halved, held at the floor, doubled after 2 clean steps
    with pytest.raises(ConfigError, match=r"^tiermem: loss_scale=.* only precision='fp16' scales the loss"):
        TieredModel(torch.nn.Linear(4, 4), precision="bf16", loss_scale=LossScale())
    with pytest.raises(ConfigError, match=r"^tiermem: LossScale\.min_scale=16\.0 is invalid"):
        LossScale(init_scale=8.0, min_scale=16.0)


def test_adagrad_and_lion_blocks_are_tiermems():
    """DeepSpeed's CPU optimizers besides Adam: its defaults for what a block leaves out."""
    options, notes = translate({"optimizer": {"type": "Adagrad", "params": {"lr": 0.05}}})
    assert options["optimizer"] == tiermem.Adagrad(lr=0.05, eps=1e-10) and notes == []
    options, _ = translate({"optimizer": {"type": "Lion", "params": {"lr": "auto", "betas": [0.9, 0.99]}}}, lr=1e-4)
    assert options["optimizer"] == tiermem.Lion(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0)
    with pytest.raises(
        ConfigError,
        match=r"^tiermem: DeepSpeed config optimizer.params has \['eps'\], which Lion "
        r"does not take; use lr, betas, weight_decay$",
    ):
        translate({"optimizer": {"type": "Lion", "params": {"eps": 1e-8}}})


DEPRECATED = {  # DeepSpeed's deprecated booleans (it still reads them, with a warning): the policy each means
    "cpu_offload true": ({"stage": 2, "cpu_offload": True}, ZeroOffload()),
    "cpu_offload false": ({"stage": 2, "cpu_offload": False}, KeepOnDevice()),
    "both on at stage 3": (
        {"stage": 3, "cpu_offload": True, "cpu_offload_param": True},
        OffloadPolicy({**{c: Tier.HOST for c in TensorClass}, TensorClass.ACTIVATION: Tier.DEVICE}),
    ),
}


@pytest.mark.parametrize("case", sorted(DEPRECATED))
def test_deprecated_cpu_offload_keys_are_read_as_deepspeed_reads_them_and_said(case, caplog):
    zero, policy = DEPRECATED[case]
    options, notes = translate({"zero_optimization": zero})
    assert repr(options["policy"]) == repr(policy)
    for key in ("cpu_offload", "cpu_offload_param"):
        if key in zero:
            new = "offload_optimizer" if key == "cpu_offload" else "offload_param"
            device = "cpu" if zero[key] else "none"
            said = [line for line in notes if f"zero_optimization.{key}=" in line]
            assert said == [
                f"tiermem: DeepSpeed config zero_optimization.{key}={json.dumps(zero[key])} is deprecated "
                f'(DeepSpeed warns too); read as {new}: {{"device": "{device}"}}: write that instead'
            ]
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        tm = tiermem.from_deepspeed_config(torch.nn.Linear(4, 4), {"zero_optimization": zero})
    assert repr(tm.policy) == repr(policy)
    assert any(
        "is deprecated" in r.getMessage() for r in caplog.records if r.name == "tiermem.integrations.deepspeed.walk"
    )


def test_cpu_offload_use_pin_memory_is_said_not_honoured():
    _, notes = translate({"zero_optimization": {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True}})
    assert any(
        line.startswith("tiermem: DeepSpeed config zero_optimization.cpu_offload_use_pin_memory=true not honoured:")
        for line in notes
    )


@pytest.mark.parametrize("on", [True, False])
def test_zero_optimization_as_a_boolean_is_deepspeeds_stage_switch(on):
    options, notes = translate({"zero_optimization": on})
    assert repr(options["policy"]) == repr(KeepOnDevice())
    assert notes[0] == (
        f"tiermem: DeepSpeed config zero_optimization={json.dumps(on)} is deprecated (DeepSpeed warns too); "
        f'read as zero_optimization: {{"stage": {int(on)}}}: write that instead'
    )
