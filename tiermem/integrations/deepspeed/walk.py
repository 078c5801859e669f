"""``tiermem.from_deepspeed_config``: a DeepSpeed JSON config read as TieredModel options.

This module walks a whole config: the precision and loss-scale blocks, the training loop's keys
and the top-level keys tiermem does not honour are read here; the reader it walks with, the
``optimizer`` block and the ``zero_optimization`` block are :mod:`tiermem.integrations.deepspeed`'s.

# NOTE [DeepSpeed config]
What a DeepSpeed config says, tiermem does where it has the same thing:

- ``zero_optimization.offload_optimizer.device`` (``none``/``cpu``/``nvme``) is the home of the
  optimizer state (and, off the device, of the fp32 gradients, as in ZeRO-Offload);
  ``offload_param.device`` the home of the weights; ``nvme_path`` the NVMe directory. The pairs
  DeepSpeed's documentation shows are tiermem's built-in policies: optimizer ``cpu`` =
  ``ZeroOffload``, both ``nvme`` = ``ZeroInfinity``, neither = ``KeepOnDevice``; other pairs get a
  :class:`tiermem.PerClass` policy with those homes.
- ``bf16``/``fp16`` ``enabled`` is the precision (neither: fp32); fp16's ``initial_scale_power``,
  ``loss_scale_window`` and ``min_loss_scale`` are a :class:`tiermem.LossScale`, with DeepSpeed's
  defaults for those left out (2**16, 1000, 1).
- ``gradient_clipping`` is ``grad_clip`` (0: none); the ``optimizer`` block (``Adam``/``AdamW``:
  ``lr``, ``betas``, ``eps``, ``weight_decay``, ``adam_w_mode``) is ``tiermem.AdamW``/``Adam``, with
  DeepSpeed's defaults for what it leaves out (weight decay 0; ``Adam`` is AdamW unless
  ``adam_w_mode`` is false, as in DeepSpeed); ``Adagrad`` and ``Lion`` blocks are
  ``tiermem.Adagrad``/``Lion`` (the optimizers DeepSpeed runs on the CPU).
- DeepSpeed's deprecated forms it still reads are read as it reads them, with a warning line each:
  ``zero_optimization.cpu_offload``/``cpu_offload_param`` (booleans) as ``offload_optimizer``/
  ``offload_param`` on ``cpu`` or ``none``, ``"zero_optimization": true/false`` as stage 1/0.

Every key it does not honour (tuning knobs of DeepSpeed's own buffers and collectives, a
scheduler block, a partial offload ratio...) is logged as one warning line that says why and
what tiermem does instead. Values that cannot be right (an unknown device, a typo inside a ZeRO
block, which DeepSpeed refuses too, bf16 and fp16 both enabled) raise a ``tiermem:`` error.

``"auto"`` (the Hugging Face Trainer's placeholder) takes the keyword argument of the same
meaning (``lr=``, ``precision=``, ``grad_clip=``...); without one it is an error. A keyword given
for a value the config sets to something else is an error too (as the Trainer's DeepSpeed
integration does): the config and the call must agree.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping

import torch

from tiermem.config.rules import is_int, is_number
from tiermem.config.specs import LossScale
from tiermem.errors import ConfigError
from tiermem.integrations.deepspeed.optimizer_block import optimizer_spec
from tiermem.integrations.deepspeed.reader import ABSENT, NO_SUCH_SETTING, Reader, block, read_config, short
from tiermem.integrations.deepspeed.zero_block import OffloadPolicy, placement
from tiermem.model.tiered_model import TieredModel

log = logging.getLogger(__name__)

# read_config and OffloadPolicy live in tiermem.integrations.deepspeed; importable from here as before
__all__ = ["from_deepspeed_config", "read_config", "translate", "OffloadPolicy"]

#: keyword arguments that fill or check a config value ("auto" takes them)
CONFIG_KEYWORDS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "precision",
    "grad_clip",
    "nvme_dir",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
)
#: keyword arguments passed to TieredModel (or the optimizer spec) as they are: the config has no say
PASS_THROUGH = (
    "budgets",
    "device",
    "bucket_size",
    "overlap_step",
    "trace_path",
    "prefetch",
    "process_group",
    "max_skipped_steps",
    "no_decay",
    "no_decay_1d",
)

_REPORT = "tiermem reports through tm.report() and the logging module"
_COMMS = "tiermem reduces fp32 gradients over its process group; see the README's Data parallel section"

_TOP_IGNORED = {
    "scheduler": "tiermem leaves the learning-rate schedule to a torch lr scheduler on tm.optimizer "
    "(in the HF Trainer: lr_scheduler_type / warmup_steps)",
    "activation_checkpointing": "use the model's gradient checkpointing (torch.utils.checkpoint), and an "
    "ActivationOffload policy to keep activations off the device",
    "aio": "tiermem's NvmeStore runs its own I/O threads and block sizes",
    "zero_allow_untested_optimizer": "tiermem runs its own fused optimizers only",
    "zero_force_ds_cpu_optimizer": "tiermem runs its own fused optimizers only",
    "amp": "tiermem's precision is its weights' dtype (bf16/fp16 blocks), not apex AMP",
    **{
        k: _REPORT
        for k in (
            "steps_per_print",
            "wall_clock_breakdown",
            "dump_state",
            "tensorboard",
            "wandb",
            "csv_monitor",
            "comet",
            "flops_profiler",
            "comms_logger",
            "memory_breakdown",
        )
    },
    **{
        k: _COMMS
        for k in (
            "communication_data_type",
            "prescale_gradients",
            "gradient_predivide_factor",
            "sparse_gradients",
            "seq_parallel_communication_data_type",
            "data_types",
        )
    },
}
#: fp16 loss-scale keys tiermem reads: DeepSpeed's defaults, also for "auto" (the Trainer has none of these)
_FP16_DEFAULTS = {"initial_scale_power": 16, "loss_scale_window": 1000, "min_loss_scale": 1}
#: fp16 keys whose value tiermem always has: (is the value tiermem's?, why not honoured otherwise)
_FP16_FIXED = {
    "hysteresis": (lambda v: v == 1, "tiermem lowers the loss scale at the first overflow (hysteresis 1)"),
    "consecutive_hysteresis": (lambda v: not v, "tiermem lowers the loss scale at the first overflow"),
    "auto_cast": (lambda v: v is True, "tiermem always casts floating-point inputs to the working precision"),
    "fp16_master_weights_and_grads": (lambda v: not v, "tiermem's master weights and grads are fp32"),
}
#: the training loop's keys: checked against the keywords when given, otherwise noted with why
_LOOP = {
    "train_micro_batch_size_per_gpu": "the micro-batch size is your data loader's",
    "gradient_accumulation_steps": "call tm.backward(loss / N) once per micro-batch (DeepSpeed's "
    "engine divided by N) and tm.step() after the last",
    "train_batch_size": "the global batch size is your loop's (micro-batch x accumulation x ranks)",
}


def _enabled(cfg: Mapping, key: str) -> Any:
    """A precision block's ``enabled``: True, False, "auto", or None when the block is absent."""
    if key not in cfg:
        return None
    value = block(cfg, key, "").get("enabled", False)
    if value != "auto" and not isinstance(value, bool):
        raise ConfigError(f"tiermem: DeepSpeed config {key}.enabled={short(value)} is not true, false or 'auto'")
    return value


def _precision(r: Reader, cfg: Mapping) -> str:
    """The block enabled explicitly, else the ``precision`` keyword (as the HF Trainer adds the
    block its bf16=/fp16= asks for), else fp32 (DeepSpeed's default)."""
    if "bf16" in cfg and "bfloat16" in cfg:
        raise ConfigError("tiermem: DeepSpeed config has both 'bf16' and 'bfloat16' (the same block); keep one")
    flags = {
        "bf16": _enabled({"bf16": cfg["bfloat16"]} if "bfloat16" in cfg else cfg, "bf16"),
        "fp16": _enabled(cfg, "fp16"),
    }
    on = [k for k, v in flags.items() if v is True]
    if len(on) == 2:
        raise ConfigError("tiermem: DeepSpeed config enables both bf16 and fp16; enable one of them")
    given = r.overrides.get("precision", ABSENT)
    if given is ABSENT:
        auto = [k for k, v in flags.items() if v == "auto"]
        if auto:
            raise ConfigError(
                f"tiermem: DeepSpeed config {auto[0]}.enabled='auto' needs a value: pass precision=... "
                f"(the HF Trainer takes it from bf16=/fp16=) or write true/false"
            )
        return on[0] if on else "fp32"
    if (on and on[0] != given) or flags.get(given) is False:
        why = f"enables {on[0]}" if on and on[0] != given else f"has {given}.enabled=false"
        raise ConfigError(
            f"tiermem: DeepSpeed config {why} but precision={given!r} was given; make them agree "
            f"(or write 'auto' for enabled)"
        )
    return given


def _loss_scale(r: Reader, cfg: Mapping) -> LossScale:
    fp16 = block(cfg, "fp16", "")
    for key, value in fp16.items():
        if key == "loss_scale" and value not in (0, 0.0, "auto"):
            raise ConfigError(
                f"tiermem: DeepSpeed config fp16.loss_scale={short(value)} (a static loss scale) is "
                f"not supported: tiermem scales fp16 losses dynamically; write 0 or leave it out"
            )
        if key in _FP16_FIXED:
            ours, why = _FP16_FIXED[key]
            if not ours(value):
                r.note(f"fp16.{key}", value, why)
        elif key not in ("enabled", "loss_scale", *_FP16_DEFAULTS):
            r.note(f"fp16.{key}", value, NO_SUCH_SETTING)
    power, window, floor = (
        default if fp16.get(key, "auto") == "auto" else fp16[key] for key, default in _FP16_DEFAULTS.items()
    )
    if not is_int(power) or not 0 <= power < 126:
        raise ConfigError(
            f"tiermem: DeepSpeed config fp16.initial_scale_power={short(power)} is invalid: it must "
            f"be an int in [0, 126) (the scale is 2**power)"
        )
    try:
        return LossScale(init_scale=2.0**power, growth_interval=window, min_scale=floor)
    except ConfigError as e:
        raise ConfigError(
            f"tiermem: DeepSpeed config fp16 block (loss_scale_window -> growth_interval, "
            f"min_loss_scale -> min_scale): {str(e).removeprefix('tiermem: ')}"
        ) from None


def _batch(r: Reader, cfg: Mapping) -> None:
    """Batch sizes and accumulation are the training loop's: checked against the keywords when
    given (the Trainer passes its own), otherwise reported as the loop's business."""
    for key, why in _LOOP.items():
        if key not in cfg:
            continue
        if key in r.overrides:
            r.take(key, cfg[key], key)
        elif cfg[key] != "auto":
            r.note(key, cfg[key], why)


def translate(config: Any, **overrides: Any) -> tuple[dict[str, Any], list[str]]:
    """The TieredModel keyword arguments a DeepSpeed config (path or dict) means, and one line per
    key not honoured (NOTE [DeepSpeed config]). ``overrides``: :data:`CONFIG_KEYWORDS` fill
    "auto" and must agree with the config; :data:`PASS_THROUGH` go to TieredModel as they are."""
    bad = sorted(set(overrides) - set(CONFIG_KEYWORDS) - set(PASS_THROUGH))
    if bad:
        raise ConfigError(
            f"tiermem: from_deepspeed_config got unexpected keyword arguments {bad}; it takes "
            f"{', '.join(CONFIG_KEYWORDS + PASS_THROUGH)} (the config gives policy and optimizer)"
        )
    cfg = read_config(config)
    r = Reader(overrides)
    precision = _precision(r, cfg)
    policy, nvme_dir = placement(r, cfg)
    clip = r.take(
        "gradient_clipping",
        cfg.get("gradient_clipping", ABSENT),
        "grad_clip",
        default=None,
        norm=lambda v: None if v == 0 else v,
    )
    if clip is not None and (not is_number(clip) or not clip > 0 or math.isinf(clip)):
        raise ConfigError(
            f"tiermem: DeepSpeed config gradient_clipping={short(clip)} is invalid: it must be a "
            f"number >= 0 (0: no clipping)"
        )
    _batch(r, cfg)
    options: dict[str, Any] = dict(
        policy=policy, optimizer=optimizer_spec(r, cfg), precision=precision, grad_clip=clip, nvme_dir=nvme_dir
    )
    if precision == "fp16":
        options["loss_scale"] = _loss_scale(r, cfg)
    handled = {"bf16", "bfloat16", "fp16", "zero_optimization", "gradient_clipping", "optimizer", *_LOOP}
    for key, value in cfg.items():
        if key not in handled:
            r.note(key, value, _TOP_IGNORED.get(key, NO_SUCH_SETTING))
    options.update({k: v for k, v in overrides.items() if k in PASS_THROUGH and k not in ("no_decay", "no_decay_1d")})
    return options, r.notes


def from_deepspeed_config(model: torch.nn.Module, config: Any, **overrides: Any) -> TieredModel:
    """A :class:`~tiermem.TieredModel` of ``model`` as the DeepSpeed config ``config`` describes it;
    logs one warning line per key tiermem does not honour, saying why and what it does instead
    (NOTE [DeepSpeed config]).

    Args:
        model: the ``torch.nn.Module`` to train.
        config: a DeepSpeed config: a path to its JSON file, or the dict.
        **overrides: values for the config's ``"auto"`` entries (``lr``, ``betas``, ``eps``,
            ``weight_decay``, ``precision``, ``grad_clip``, ``nvme_dir``, ...; one that contradicts a
            value the config sets is an error), and options passed to TieredModel as they are
            (``budgets``, ``device``, ``bucket_size``, ...).

    Returns:
        The TieredModel, built.
    """
    options, notes = translate(config, **overrides)
    for line in notes:
        log.warning("%s", line)
    return TieredModel(model, **options)
