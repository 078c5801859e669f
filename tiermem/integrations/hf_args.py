"""The Hugging Face ``TrainingArguments`` and ``TieredTrainer``'s keywords read as tiermem's (NOTE
[Trainer integration] in ``tiermem.integrations.transformers``): the optimizer names tiermem runs
(:data:`OPTIM_NAMES`) and the hyperparameters the Trainer gives each, the optimizer built from
``optim=``, ``optimizer_cls_and_kwargs=`` or ``optimizers=`` (and its lr scheduler moved onto
tiermem's groups), the Trainer's copy of the arguments, and the checks of what cannot be trained."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from transformers import TrainingArguments

from tiermem.config.optimizers import SGD, Adagrad, AdamW8bit, Lion
from tiermem.config.specs import AdamW, _Spec
from tiermem.config.torch_optim import runs, spec_from_torch, supported_names
from tiermem.errors import ConfigError, TierMemError
from tiermem.integrations.deepspeed.reader import read_config
from tiermem.integrations.deepspeed.walk import PASS_THROUGH

__all__ = [
    "OPTIM_NAMES",
    "TRAINER_TAKES",
    "OPTIM_ARGS",
    "trainer_arguments",
    "precision_of",
    "named_spec",
    "built_named",
    "given_optimizer",
    "has_optimizer_block",
    "tiermem_options",
    "check_supported",
    "move_scheduler",
]

#: the optimizers TrainingArguments(optim=...) may name, each with the tiermem spec that runs it
#: (built with those of the arguments' learning_rate, adam_beta1/2, adam_epsilon, weight_decay that
#: it takes, as the Trainer builds them: Lion takes the adam betas; and the Trainer's no-decay
#: group); one row per optimizer whose meaning tiermem's has (bitsandbytes' and torchao's 8-bit
#: AdamW are block-wise 8-bit moments; paged state is homed by the policy instead), any other name
#: (4-bit, 8-bit Lion, RMSprop, ...) is refused with this list
OPTIM_NAMES: dict[str, type[_Spec]] = {
    "adamw_torch": AdamW,
    "adamw_torch_fused": AdamW,
    "adamw_torch_xla": AdamW,
    "adamw_torch_npu_fused": AdamW,
    "paged_adamw_32bit": AdamW,
    "sgd": SGD,
    "adagrad": Adagrad,
    "lion_32bit": Lion,
    "paged_lion_32bit": Lion,
    "adamw_8bit": AdamW8bit,
    "adamw_bnb_8bit": AdamW8bit,
    "paged_adamw_8bit": AdamW8bit,
    "adamw_torch_8bit": AdamW8bit,
}
#: which of the arguments' hyperparameters the Trainer gives each (the Adams all of theirs; SGD and
#: Adagrad the lr and the groups' weight decay, their eps their own; Lion the adam betas too)
TRAINER_TAKES: dict[type, tuple[str, ...]] = {
    SGD: ("lr", "weight_decay"),
    Adagrad: ("lr", "weight_decay"),
    Lion: ("lr", "betas", "weight_decay"),
}
#: the ``optim_args`` keys the Trainer reads for an optimizer ("momentum=0.9,nesterov=True"), as it reads them
OPTIM_ARGS: dict[type, dict[str, Any]] = {
    SGD: {
        "momentum": float,
        "dampening": float,
        "weight_decay": float,
        "nesterov": lambda v: v.lower() in ("true", "1", "yes"),
    },
    Adagrad: {"lr_decay": float, "weight_decay": float, "eps": float},
}


class _NoPlacementArguments:
    """Mixed into the Trainer's copy of the arguments: tiermem places the weights (the override
    the Trainer documents for integrations that do)."""

    @property
    def place_model_on_device(self) -> bool:
        return False


def trainer_arguments(args: TrainingArguments) -> TrainingArguments:
    """The user's arguments with bf16/fp16 off and no device placement (NOTE [Trainer integration])."""
    cls = type(f"Tiered{type(args).__name__}", (_NoPlacementArguments, type(args)), {})
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    return cls(**{**values, "bf16": False, "fp16": False})


def precision_of(args: TrainingArguments) -> str:
    """tiermem's precision for ``TrainingArguments(bf16=/fp16=)``."""
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def built_named(args: TrainingArguments, hyper: dict[str, Any], no_decay: tuple[str, ...]) -> _Spec:
    """The spec of ``args.optim`` with the arguments' hyperparameters it takes (``hyper``), the
    Trainer's no-decay parameters and ``args.optim_args``."""
    spec = named_spec(args)
    taken = TRAINER_TAKES.get(spec, spec.HYPER)
    kwargs = {k: v for k, v in hyper.items() if k in taken}
    given = args.optim_args
    if given and spec in OPTIM_ARGS:
        pairs = dict(x.split("=", 1) for x in given.replace(" ", "").split(",") if "=" in x)
        kwargs.update({k: read(pairs[k]) for k, read in OPTIM_ARGS[spec].items() if k in pairs})
    return spec(**kwargs, no_decay=no_decay)


def named_spec(args: TrainingArguments) -> type[_Spec]:
    """The spec of ``TrainingArguments(optim=...)``, by :data:`OPTIM_NAMES`."""
    optim = getattr(args.optim, "value", args.optim)  # an OptimizerNames (a str enum) or a str
    if optim == "adafactor":  # the Trainer's name builds transformers' Adafactor, another update than torch's
        raise ConfigError(
            "tiermem: TrainingArguments(optim='adafactor') is transformers' Adafactor with an absolute "
            "step size (relative_step=False, scale_parameter=False), which tiermem does not run; "
            "tiermem runs torch.optim.Adafactor (a step relative to the weights' RMS, other numbers): "
            "pass TieredTrainer(optimizer_cls_and_kwargs=(torch.optim.Adafactor, {'lr': ...})) to "
            "train with it"
        )
    if optim not in OPTIM_NAMES:
        raise ConfigError(
            f"tiermem: TrainingArguments(optim={optim!r}) is not an optimizer tiermem runs; it runs "
            f"{', '.join(repr(n) for n in OPTIM_NAMES)} (the default is 'adamw_torch_fused')"
        )
    return OPTIM_NAMES[optim]


def given_optimizer(
    model: torch.nn.Module,
    decay: set[str],
    *,
    optimizer: Optional[torch.optim.Optimizer],
    cls_and_kwargs: Optional[tuple[Any, Any]],
    weight_decay: float,
) -> Any:
    """The ``optimizer`` of ``optimizers=`` or one built as the Trainer builds
    ``optimizer_cls_and_kwargs`` (its weight-decay groups: ``decay`` at ``weight_decay``, the
    rest at 0), or None."""
    if optimizer is not None:  # its scheduler, if any, moves onto tiermem's groups (move_scheduler)
        return spec_from_torch(optimizer, scheduled=True)
    if cls_and_kwargs is None:
        return None
    cls, kwargs = cls_and_kwargs
    if not runs(cls) and not (isinstance(cls, type) and issubclass(cls, _Spec)):
        raise ConfigError(
            f"tiermem: TieredTrainer(optimizer_cls_and_kwargs=({getattr(cls, '__name__', cls)}, ...)) "
            f"is not an optimizer tiermem runs; it runs {supported_names()} and tiermem's specs fused, "
            f"any other torch.optim.Optimizer generically"
        )
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    return cls(groups, **dict(kwargs))


def has_optimizer_block(config: Any) -> bool:
    """Whether the DeepSpeed config (path, dict or None) has an ``optimizer`` block."""
    if config is None:
        return False
    return "optimizer" in read_config(config)


def tiermem_options(options: Optional[dict], deepspeed: Any) -> dict:
    """``TieredTrainer(tiermem=...)``, checked: nothing the arguments (or a DeepSpeed config) say."""
    options = dict(options or {})
    fixed = {"optimizer", "precision", "grad_clip", "no_decay", "no_decay_1d"} & set(options)
    if fixed:
        raise ConfigError(
            f"tiermem: TieredTrainer(tiermem={{{', '.join(sorted(fixed))}: ...}}): these come from "
            f"TrainingArguments (learning_rate, adam_*, weight_decay, bf16/fp16, max_grad_norm) and "
            f"the Trainer's get_decay_parameter_names(); set them there"
        )
    if deepspeed is not None:
        bad = sorted(set(options) - set(PASS_THROUGH) - {"nvme_dir"})
        if bad:
            raise ConfigError(
                f"tiermem: TieredTrainer(deepspeed=..., tiermem={{{', '.join(bad)}: ...}}): the "
                f"DeepSpeed config says these (where tensors live, loss scaling); drop them, or drop "
                f"deepspeed= and give TieredModel's options in tiermem="
            )
    return options


def check_supported(args: TrainingArguments, kwargs: dict) -> None:
    """Refuse the arguments and Trainer keywords tiermem cannot train with, saying what to pass."""
    if args.deepspeed:
        raise ConfigError(
            "tiermem: TrainingArguments(deepspeed=...) would start DeepSpeed itself; pass the config to "
            "TieredTrainer(..., deepspeed='ds.json') instead and leave it out of TrainingArguments"
        )
    if args.n_gpu > 1:
        raise ConfigError(
            f"tiermem: TieredTrainer drives one device per process ({args.n_gpu} GPUs are visible to "
            f"this one); run one process per GPU with torchrun --nproc_per_node {args.n_gpu}"
        )
    optimizer, _ = kwargs.get("optimizers") or (None, None)
    if optimizer is not None and kwargs.get("optimizer_cls_and_kwargs") is not None:
        raise ConfigError("tiermem: TieredTrainer got both optimizers= and optimizer_cls_and_kwargs=; give one")
    if optimizer is not None and not runs(type(optimizer)):
        raise ConfigError(
            f"tiermem: TieredTrainer(optimizers=({type(optimizer).__name__}(...), ...)) is not an "
            f"optimizer tiermem runs; it runs {supported_names()} fused and any other torch.optim.Optimizer "
            f"generically, built on the model's parameters"
        )


def move_scheduler(scheduler: Any, given: torch.optim.Optimizer, tiered: torch.optim.Optimizer) -> None:
    """The lr scheduler of ``optimizers=(optimizer, scheduler)``, built on the torch optimizer
    tiermem read (and never steps), drives tiermem's groups instead: the same groups in the same
    order, each with the lr and initial_lr the scheduler set. Torch schedulers check that the
    optimizer's step is wrapped by one of them, and wrap it when they are built: a scheduler
    built on ``tiered`` and dropped does that, its lr then put back."""
    if getattr(scheduler, "optimizer", None) is not given:
        raise ConfigError(
            "tiermem: TieredTrainer(optimizers=(optimizer, scheduler)): the scheduler was not built on "
            "that optimizer; build it on the optimizer you pass with it"
        )
    if len(given.param_groups) != len(tiered.param_groups):
        raise TierMemError(
            "tiermem: the optimizer's param groups and tiermem's differ in number; pass param groups "
            "that hold the model's trainable parameters"
        )
    kept = [{k: g[k] for k in ("lr", "initial_lr") if k in g} for g in given.param_groups]
    torch.optim.lr_scheduler.LambdaLR(tiered, lambda _: 1.0)  # wraps tiered.step as torch's schedulers expect
    for group, values in zip(tiered.param_groups, kept):
        group.update(values)
    scheduler.optimizer = tiered
