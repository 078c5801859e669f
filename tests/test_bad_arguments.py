"""Every public constructor answers a wrong argument (type, value, unknown or missing keyword) with
a one-line ``tiermem:`` error that names the keyword and says what it accepts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tiermem import (
    Adam,
    AdamW,
    ArgumentError,
    Budgets,
    ConfigError,
    LossScale,
    NvmeStore,
    TieredModel,
    TierMemError,
    from_deepspeed_config,
)
from tiermem.optim import CPUAdam, adam_step, warm_up
from tiermem.policies import ActivationOffload, Auto, KeepOnDevice, ZeroInfinity, ZeroOffload


def _lin() -> torch.nn.Module:
    return torch.nn.Linear(4, 4)


def _cpu_adam(**kw):
    return CPUAdam([torch.nn.Parameter(torch.zeros(3))], **kw)


def _adam_step(**kw):
    args = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    return adam_step(*(torch.zeros(3) for _ in range(4)), **{**args, **kw})


BAD = [  # (make, error type, what the message must say: the keyword and what is accepted)
    # the Adam specs
    (lambda: AdamW(no_decay=5), ConfigError, r"AdamW\.no_decay=5 .*a name pattern or a tuple of them"),
    (lambda: AdamW(no_decay=None), ConfigError, r"AdamW\.no_decay=None .*name pattern"),
    (lambda: Adam(no_decay=[1]), ConfigError, r"Adam\.no_decay=\[1\] .*name pattern"),
    (lambda: AdamW(no_decay_1d="yes"), ConfigError, r"AdamW\.no_decay_1d='yes' .*True or False"),
    (lambda: AdamW(lr="1e-3"), ConfigError, r"AdamW\.lr='1e-3' .*a finite number >= 0"),
    (lambda: AdamW(lr=True), ConfigError, r"AdamW\.lr=True .*a finite number >= 0"),
    (lambda: AdamW(lr=None), ConfigError, r"AdamW\.lr=None .*a finite number >= 0"),
    (lambda: AdamW(lr=math.nan), ConfigError, r"AdamW\.lr=nan .*a finite number >= 0"),
    (lambda: AdamW(betas=0.9), ConfigError, r"AdamW\.betas=0\.9 .*two numbers, each in \[0, 1\)"),
    (lambda: AdamW(betas=(0.9, 0.99, 0.9)), ConfigError, r"AdamW\.betas=.*two numbers"),
    (lambda: Adam(eps=-1.0), ConfigError, r"Adam\.eps=-1\.0 .*a finite number >= 0"),
    (lambda: AdamW(weight_decay=math.inf), ConfigError, r"AdamW\.weight_decay=inf .*finite number"),
    (
        lambda: AdamW(learning_rate=1e-3),
        ArgumentError,
        r"AdamW\(\): .*unexpected keyword argument 'learning_rate'"
        r".*it takes AdamW\(params=\.\.\., \*, lr=\.\.\., .*betas=",
    ),
    (
        lambda: AdamW(1e-3),
        ConfigError,
        r"AdamW\.params=0\.001 is invalid: the one positional argument is the "
        r"model's parameters or torch-style param groups.*pass hyperparameters by keyword",
    ),
    (lambda: AdamW(1e-3, 0.9), ArgumentError, r"AdamW\(\): too many positional arguments; it takes AdamW\(params="),
    (lambda: Adam(amsgrad=True), ArgumentError, r"'amsgrad'.*it takes Adam\(params=\.\.\., \*, lr=\.\.\."),
    # loss scaling and budgets
    (lambda: LossScale(init_scale="big"), ConfigError, r"LossScale\.init_scale='big' .*between 2\*\*-126"),
    (lambda: LossScale(growth_interval=2.5), ConfigError, r"LossScale\.growth_interval=2\.5 .*an int >= 1"),
    (lambda: LossScale(min_scale=4.0, init_scale=2.0), ConfigError, r"LossScale\.min_scale=4\.0 .*at most init_scale"),
    (lambda: LossScale(backoff=0.5), ArgumentError, r"'backoff'.*LossScale\(\*, init_scale=\.\.\., growth_interval"),
    (lambda: Budgets(device=[1]), ConfigError, r"Budgets\.device=\[1\] is not a size; give bytes as an int or"),
    (lambda: Budgets(host=1.5), ConfigError, r"Budgets\.host=1\.5 is not a size"),
    (lambda: Budgets(host="lots"), ConfigError, r"Budgets\.host='lots' does not parse as a size.*GiB"),
    (lambda: Budgets(gpu="1GiB"), ArgumentError, r"'gpu'.*it takes Budgets\(device=\.\.\., host=\.\.\., nvme=\.\.\.\)"),
    # policies
    (lambda: ZeroOffload(device_fraction="0.5"), ConfigError, r"device_fraction='0\.5'"),
    (lambda: ZeroOffload(device_fraction=2), ConfigError, r"device_fraction=2"),
    (lambda: ZeroOffload(0.5), ArgumentError, r"ZeroOffload\(\): too many positional.*\(\*, device_fraction"),
    (lambda: ZeroOffload(fraction=0.5), ArgumentError, r"did you mean device_fraction= instead of fraction=\?"),
    (lambda: ZeroInfinity(device_fraction=0.5), ArgumentError, r"'device_fraction'; it takes ZeroInfinity\(\)"),
    (lambda: KeepOnDevice(1), ArgumentError, r"KeepOnDevice\(\): too many positional arguments; it takes KeepOnDevice"),
    (
        lambda: ActivationOffload(),
        ArgumentError,
        r"missing a required argument: 'base'; it takes "
        r"ActivationOffload\(base, \*, tier=\.\.\., min_bytes=\.\.\.\)",
    ),
    (lambda: ActivationOffload("ZeroOffload"), ConfigError, r"ActivationOffload\.base='ZeroOffload' is not a tiermem"),
    (lambda: ActivationOffload(ZeroOffload(), tier="host"), ConfigError, r"ActivationOffload\.tier='host'.*Tier\.HOST"),
    (lambda: ActivationOffload(ZeroOffload(), min_bytes=[1]), ConfigError, r"ActivationOffload\.min_bytes=\[1\]"),
    (lambda: Auto(device_reserve="0.1"), ConfigError, r"Auto\.device_reserve='0\.1'.*from 0 up to"),
    (lambda: Auto(budget=1), ArgumentError, r"'budget'.*it takes Auto\(\*, profile=\.\.\."),
    # TieredModel's keywords
    (lambda: TieredModel("model"), ConfigError, r"TieredModel needs a torch\.nn\.Module, got str"),
    (lambda: TieredModel(_lin(), "zero"), ConfigError, r"policy='zero' is not a tiermem\.Policy"),
    (
        lambda: TieredModel(_lin(), lr=1e-3),
        ArgumentError,
        r"'lr'; it takes TieredModel\(module, policy=\.\.\., \*, "
        r"optimizer=\.\.\.",
    ),
    (lambda: TieredModel(_lin(), None, AdamW()), ArgumentError, r"too many positional arguments"),
    (
        lambda: TieredModel(_lin(), optimizer=AdamW),
        ConfigError,
        r"optimizer=.* is not an optimizer tiermem runs; pass tiermem.AdamW",
    ),
    (lambda: TieredModel(_lin(), optimizer=torch.optim.AdamW), ConfigError, r"optimizer=.*tiermem\.AdamW\(\.\.\.\)"),
    (lambda: TieredModel(_lin(), precision=torch.bfloat16), ConfigError, r"precision=torch\.bfloat16 .*'bf16'"),
    (lambda: TieredModel(_lin(), budgets={"host": 1}), ConfigError, r"budgets=\{'host': 1\} is not a tiermem\.Budgets"),
    (lambda: TieredModel(_lin(), bucket_size=[1]), ConfigError, r"bucket_size=\[1\] is not a size"),
    (lambda: TieredModel(_lin(), bucket_size=0), ConfigError, r"bucket_size=0 .*at least 4 bytes"),
    (lambda: TieredModel(_lin(), grad_clip="1"), ConfigError, r"grad_clip='1' .*a finite number > 0"),
    (lambda: TieredModel(_lin(), device=0), ConfigError, r"device=0 is not a device; pass 'cpu', 'cuda'"),
    (lambda: TieredModel(_lin(), overlap_step="yes"), ConfigError, r"overlap_step='yes' is not a bool"),
    (lambda: TieredModel(_lin(), prefetch=1), ConfigError, r"prefetch=1 is not a bool"),
    (lambda: TieredModel(_lin(), shard_weights="yes"), ConfigError, r"shard_weights='yes' is not a bool"),
    (lambda: TieredModel(_lin(), max_skipped_steps=0), ConfigError, r"max_skipped_steps=0 .*an int >= 1, or None"),
    (lambda: TieredModel(_lin(), loss_scale=LossScale()), ConfigError, r"loss_scale=.*only precision='fp16'"),
    (lambda: TieredModel(_lin(), nvme_dir=3), ConfigError, r"nvme_dir=3 is not a path"),
    (lambda: TieredModel(_lin(), trace_path=3), ConfigError, r"trace_path=3 is not a path"),
    (
        lambda: TieredModel(_lin(), process_group="world"),
        ConfigError,
        r"process_group= was given but torch\.distributed is not initialized",
    ),
    # from_deepspeed_config's keywords (its config keys: tests/test_deepspeed_config.py)
    (lambda: from_deepspeed_config(_lin(), {}, no_decay=5), ConfigError, r"AdamW\.no_decay=5 .*name pattern"),
    (lambda: from_deepspeed_config(_lin(), {}, no_decay_1d="y"), ConfigError, r"no_decay_1d='y' .*True or False"),
    (
        lambda: from_deepspeed_config(_lin(), {}, learning_rate=1),
        ConfigError,
        r"unexpected keyword arguments "
        r"\['learning_rate'\]; it takes",
    ),
    (lambda: from_deepspeed_config(_lin(), {}, prefetch="no"), ConfigError, r"prefetch='no' is not a bool"),
    (lambda: from_deepspeed_config(_lin(), 5), ConfigError, r"config"),
    # NvmeStore (a directory that exists: the checks of its options and directory run after the keywords')
    (
        lambda: NvmeStore(".", threads=2),
        ArgumentError,
        r"NvmeStore\(\): .*unexpected keyword argument 'threads'.*it takes NvmeStore\(directory, \*, budget=\.\.\., "
        r"io_threads=",
    ),
    (lambda: NvmeStore(".", io_thread=2), ArgumentError, r"did you mean io_threads= instead of io_thread=\?"),
    (lambda: NvmeStore(".", 1 << 20), ArgumentError, r"NvmeStore\(\): too many positional arguments"),
    (lambda: NvmeStore(), ArgumentError, r"missing a required argument: 'directory'"),
    # CPUAdam and adam_step
    (lambda: _cpu_adam(lr="x"), ConfigError, r"CPUAdam lr='x' .*a finite number >= 0"),
    (lambda: _cpu_adam(adamw="yes"), ConfigError, r"CPUAdam adamw='yes' .*True \(AdamW"),
    (lambda: _cpu_adam(check_finite=None), ConfigError, r"CPUAdam check_finite=None .*True or False"),
    (lambda: _cpu_adam(betas=(0.9,), amsgrad=True), ArgumentError, r"'amsgrad'.*it takes CPUAdam\(params, lr=\.\.\."),
    (lambda: _adam_step(lr="x"), ConfigError, r"adam_step lr='x' .*a finite number >= 0"),
    (lambda: _adam_step(lr=None), ConfigError, r"adam_step lr=None"),
    (lambda: _adam_step(adamw="no"), ConfigError, r"adam_step adamw='no' .*True \(AdamW"),
    (lambda: _adam_step(step=math.nan), ConfigError, r"adam_step step=nan .*whole number"),
    (lambda: _adam_step(step=math.inf), ConfigError, r"adam_step step=inf .*whole number"),
    (lambda: _adam_step(grad_scale=torch.ones(2)), ConfigError, r"adam_step grad_scale=tensor"),
    (lambda: warm_up(out_dtypes=(torch.int8,)), ConfigError, r"adam_step out has dtype torch.int8"),
    (lambda: warm_up(grad_dtypes=(), out_dtypes=(torch.int8,)), ConfigError, r"adam_step out has dtype torch.int8"),
]


@pytest.mark.parametrize("make, err, match", BAD)
def test_a_wrong_argument_is_a_one_line_tiermem_error(make, err, match):
    with pytest.raises(err, match=match) as info:
        make()
    message = str(info.value)
    assert isinstance(info.value, TierMemError)
    assert message.startswith("tiermem: ") and "\n" not in message, message


def test_an_unknown_keyword_is_still_a_type_error():
    """Code that catches Python's TypeError for a wrong call keeps working."""
    with pytest.raises(TypeError):
        AdamW(learning_rate=1e-3)


def test_good_arguments_still_pass():
    assert AdamW(no_decay="*.bias").no_decay == ("*.bias",)
    assert AdamW(no_decay=["*.bias", "ln*"]).no_decay == ("*.bias", "ln*")
    assert AdamW(no_decay={"ln*", "*.bias"}).no_decay == ("*.bias", "ln*")  # one order everywhere
    assert AdamW(lr=np.float32(0.5)).lr == 0.5 and AdamW(lr=1).lr == 1
    assert Adam(weight_decay=0).weight_decay == 0
    assert ActivationOffload(ZeroOffload(), min_bytes="1KiB").min_bytes == 1024
    assert _cpu_adam(lr=torch.tensor(1e-3)).defaults["adamw"] is True


def test_adam_step_takes_tensor_scalars_as_the_numbers_they_hold():
    """torch optimizers allow tensor hyperparameters: the update is the one with their values."""
    master, grad = torch.randn(5), torch.randn(5)
    got, want = master.clone(), master.clone()
    m, v = torch.zeros(5), torch.zeros(5)
    adam_step(
        got,
        m,
        v,
        grad,
        step=torch.tensor(1.0),
        lr=torch.tensor(1e-2),
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=torch.tensor(0.1),
    )
    m2, v2 = torch.zeros(5), torch.zeros(5)
    adam_step(
        want,
        m2,
        v2,
        grad,
        step=1,
        lr=float(torch.tensor(1e-2)),
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=float(torch.tensor(0.1)),
    )
    assert torch.equal(got, want) and not torch.equal(got, master)
